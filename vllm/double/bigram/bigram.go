// Package bigram is the tiny real model behind the vLLM double: a character
// bigram table over the 128 ASCII bytes, stored as one safetensors tensor
// "bigram.logits" (F32, shape [128, 128], row = previous byte, column = next).
//
// It exists so that a CPU-only demo can show generations change when new
// weights arrive and scores improve after training; it is not a language
// model and the double is not an inference engine.
//
// Invariants: a *Model is immutable once built (safe for concurrent
// sampling), every logit is finite, and token 0 (NUL, EOS) both starts and
// ends a text. A text is one line: training never sees a newline inside a
// text, so a prompt that is empty or ends in a newline is conditioned on EOS
// (a new text begins), and sampling EOS finishes with reason "stop".
package bigram

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
)

const (
	// Vocab is the number of tokens: one per ASCII byte.
	Vocab = 128
	// EOS is the token that starts and ends every text.
	EOS = 0
	// TensorName is the only tensor a bigram checkpoint holds.
	TensorName = "bigram.logits"
	// unknownToken stands for every byte outside ASCII (and for NUL inside
	// a prompt, which would otherwise read as the end of the text).
	unknownToken = '?'
	// offLogit is the logit Random gives bytes that would only produce
	// unreadable output (control characters): low but finite, because
	// logprobs are reported in JSON, which has no -Inf.
	offLogit = -30
	// greedyBelow is vLLM's _SAMPLING_EPS: a smaller temperature means greedy.
	greedyBelow = 1e-5
)

// Model is a bigram logit table. The zero value is not usable; build one
// with Random, Train, FromLogits or Load.
type Model struct {
	logits []float32 // Vocab*Vocab, row-major [prev][next]
}

// FromLogits builds a model from a row-major [Vocab, Vocab] table; it copies
// the slice and rejects a wrong length or a non-finite value.
func FromLogits(logits []float32) (*Model, error) {
	if len(logits) != Vocab*Vocab {
		return nil, fmt.Errorf("bigram: %d logits, want %d (%dx%d)", len(logits), Vocab*Vocab, Vocab, Vocab)
	}
	for i, v := range logits {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("bigram: logit [%d,%d] is %v, want a finite value", i/Vocab, i%Vocab, v)
		}
	}
	return &Model{logits: slices.Clone(logits)}, nil
}

// Logits returns a copy of the row-major [Vocab, Vocab] table.
func (m *Model) Logits() []float32 { return slices.Clone(m.logits) }

// Random returns an untrained model: independent random logits over the
// printable bytes, newline and EOS, so that its samples are visible nonsense.
// The same seed always gives the same model.
func Random(seed uint64) *Model {
	r := rand.New(rand.NewPCG(seed, 0x6269677261))
	l := make([]float32, Vocab*Vocab)
	for prev := range Vocab {
		for next := range Vocab {
			v := float32(offLogit)
			if readable(byte(next)) {
				v = float32(r.NormFloat64())
			}
			l[prev*Vocab+next] = v
		}
	}
	return &Model{logits: l}
}

func readable(b byte) bool { return b == EOS || b == '\n' || (b >= ' ' && b < 127) }

// TrainOptions tune Train.
type TrainOptions struct {
	// Smoothing is the pseudo-count added to every transition between
	// readable bytes (default 1e-4): it keeps every logit finite while
	// keeping unseen transitions rare enough that samples read as corpus text.
	Smoothing float64
}

// Train fits the bigram table to corpus by counting transitions: every
// non-empty line is one text, EOS -> line bytes -> EOS. Bytes outside ASCII
// count as '?'. The logits are log-probabilities, so sampling at
// temperature 1 reproduces the corpus' bigram statistics.
func Train(corpus string, opts TrainOptions) (*Model, error) {
	alpha := opts.Smoothing
	if alpha == 0 {
		alpha = 1e-4
	}
	if alpha < 0 || math.IsNaN(alpha) || math.IsInf(alpha, 0) {
		return nil, fmt.Errorf("bigram: smoothing %v, want a positive finite value", opts.Smoothing)
	}
	counts, texts := Counts(corpus)
	if texts == 0 {
		return nil, errors.New("bigram: corpus has no non-empty line to train on")
	}
	l := make([]float32, Vocab*Vocab)
	for prev := range Vocab {
		row := counts[prev*Vocab : (prev+1)*Vocab]
		total := 0.0
		for next, c := range row {
			if readable(byte(next)) {
				total += c + alpha
			}
		}
		for next, c := range row {
			v := float32(offLogit)
			if readable(byte(next)) {
				v = float32(math.Log((c + alpha) / total))
			}
			l[prev*Vocab+next] = v
		}
	}
	return &Model{logits: l}, nil
}

// Counts is the corpus' transition counts, [prev*Vocab+next], the way Train
// sees them: every non-empty line is one text, EOS -> line bytes -> EOS. It
// also returns the number of texts.
func Counts(corpus string) ([]float64, int) {
	counts := make([]float64, Vocab*Vocab)
	texts := 0
	for line := range strings.SplitSeq(corpus, "\n") {
		line = strings.TrimRight(line, "\r")
		if strings.TrimSpace(line) == "" {
			continue
		}
		texts++
		prev := byte(EOS)
		for _, t := range Tokenize(line) {
			counts[int(prev)*Vocab+int(t)]++
			prev = t
		}
		counts[int(prev)*Vocab+EOS]++
	}
	return counts, texts
}

// Tokenize maps text to tokens, one per byte; bytes outside ASCII and NUL
// become '?', so every token of a prompt is a valid non-EOS row.
func Tokenize(s string) []byte {
	out := []byte(s)
	for i, b := range out {
		if b >= Vocab || b == EOS {
			out[i] = unknownToken
		}
	}
	return out
}

// Checksum is the hex SHA-256 of the table's little-endian float32 bytes:
// equal checksums mean identical weights.
func (m *Model) Checksum() string {
	sum := sha256.Sum256(m.Bytes())
	return hex.EncodeToString(sum[:])
}

// SampleOptions tune Sample.
type SampleOptions struct {
	// MaxTokens bounds the generated tokens; <= 0 generates none.
	MaxTokens int
	// Temperature scales the logits; below 1e-5 (vLLM's threshold) sampling is greedy.
	Temperature float64
	// TopP keeps the smallest set of most likely tokens whose probability
	// reaches TopP (nucleus sampling); 0 or >= 1 keeps every token.
	TopP float64
	// Rand drives sampling; nil means greedy regardless of Temperature,
	// so sampling is never silently non-deterministic.
	Rand *rand.Rand
	// Stop strings end the text before their first occurrence (reason "stop").
	Stop []string
	// Logprobs reports each generated token's log-probability, and
	// TopLogprobs (capped at Vocab) the most likely alternatives at each step.
	Logprobs    bool
	TopLogprobs int
}

// TokenLogprob is one generated token with its log-probability under the
// model at temperature 1 (vLLM's default "raw" logprobs).
type TokenLogprob struct {
	Token   string
	Logprob float64
	Top     []TopLogprob // most likely first
}

// TopLogprob is one alternative at a position.
type TopLogprob struct {
	Token   string
	Logprob float64
}

// Sample is one generated text.
type Sample struct {
	Text         string
	Tokens       int // generated tokens, EOS included when it ended the text
	FinishReason string
	Logprobs     []TokenLogprob // nil unless SampleOptions.Logprobs
}

// Sample continues prompt: the next byte is conditioned on the last prompt
// byte (EOS for an empty prompt). It ends on EOS or a stop string ("stop")
// or after MaxTokens tokens ("length").
func (m *Model) Sample(prompt string, o SampleOptions) Sample {
	prev := byte(EOS)
	if p := Tokenize(prompt); len(p) > 0 && p[len(p)-1] != '\n' {
		prev = p[len(p)-1]
	}
	greedy := o.Rand == nil || o.Temperature < greedyBelow || math.IsNaN(o.Temperature)
	var (
		text  strings.Builder
		lps   []TokenLogprob
		probs [Vocab]float64
		raw   [Vocab]float64
	)
	for n := 0; n < o.MaxTokens; n++ {
		row := m.logits[int(prev)*Vocab : (int(prev)+1)*Vocab]
		LogSoftmax(row, 1, raw[:])
		var next byte
		if greedy {
			next = byte(argmax(row))
		} else {
			LogSoftmax(row, o.Temperature, probs[:])
			if o.TopP > 0 && o.TopP < 1 {
				nucleus(probs[:], o.TopP)
			}
			next = draw(probs[:], o.Rand)
		}
		if o.Logprobs {
			lps = append(lps, tokenLogprob(next, raw[:], o.TopLogprobs))
		}
		if next == EOS {
			return Sample{Text: text.String(), Tokens: n + 1, FinishReason: "stop", Logprobs: lps}
		}
		text.WriteByte(next)
		if s, ok := cutStop(text.String(), o.Stop); ok {
			return Sample{Text: s, Tokens: n + 1, FinishReason: "stop", Logprobs: lps}
		}
		prev = next
	}
	return Sample{Text: text.String(), Tokens: max(o.MaxTokens, 0), FinishReason: "length", Logprobs: lps}
}

// cutStop returns text up to the first occurrence of any stop string.
func cutStop(text string, stop []string) (string, bool) {
	cut, found := len(text), false
	for _, s := range stop {
		if s == "" {
			continue
		}
		if i := strings.Index(text, s); i >= 0 && i < cut {
			cut, found = i, true
		}
	}
	return text[:cut], found
}

// LogSoftmax writes log(softmax(row / temp)) into out (len(row) values),
// stably: the row's maximum is subtracted before exponentiating.
func LogSoftmax(row []float32, temp float64, out []float64) {
	mx := math.Inf(-1)
	for _, v := range row {
		mx = math.Max(mx, float64(v)/temp)
	}
	sum := 0.0
	for i, v := range row {
		out[i] = float64(v)/temp - mx
		sum += math.Exp(out[i])
	}
	ls := math.Log(sum)
	for i := range out {
		out[i] -= ls
	}
}

func argmax(row []float32) int {
	best := 0
	for i, v := range row {
		if v > row[best] {
			best = i
		}
	}
	return best
}

// nucleus keeps the most likely tokens up to cumulative probability p and
// renormalises: dropped tokens get -Inf (probability 0).
func nucleus(logp []float64, p float64) {
	idx := byRank(logp)
	acc, keep := 0.0, len(idx)
	for k, i := range idx {
		acc += math.Exp(logp[i])
		if acc >= p {
			keep = k + 1
			break
		}
	}
	ls := math.Log(acc)
	if keep == len(idx) {
		ls = 0 // rounding kept everything: already normalised
	}
	for k, i := range idx {
		if k < keep {
			logp[i] -= ls
		} else {
			logp[i] = math.Inf(-1)
		}
	}
}

// byRank returns token indices, most likely first (ties: lower index first).
func byRank(logp []float64) []int {
	idx := make([]int, len(logp))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int {
		switch {
		case logp[a] > logp[b]:
			return -1
		case logp[a] < logp[b]:
			return 1
		}
		return 0
	})
	return idx
}

// draw samples an index from log-probabilities.
func draw(logp []float64, r *rand.Rand) byte {
	u := r.Float64()
	acc := 0.0
	last := 0
	for i, lp := range logp {
		p := math.Exp(lp)
		if p == 0 {
			continue
		}
		last = i
		acc += p
		if u < acc {
			return byte(i)
		}
	}
	return byte(last) // rounding left u above the total: take the last possible token
}

func tokenLogprob(tok byte, raw []float64, top int) TokenLogprob {
	tl := TokenLogprob{Token: string(rune(tok)), Logprob: raw[tok]}
	if tok == EOS {
		tl.Token = ""
	}
	top = min(top, Vocab)
	if top <= 0 {
		return tl
	}
	for _, i := range byRank(raw)[:top] {
		t := string(rune(i))
		if i == EOS {
			t = ""
		}
		tl.Top = append(tl.Top, TopLogprob{Token: t, Logprob: raw[i]})
	}
	return tl
}
