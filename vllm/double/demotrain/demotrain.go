// Package demotrain is rlflow's DEMO TRAINER: one tiny but real learning
// step for the vLLM double's character bigram model (package
// vllm/double/bigram), run by `rlflow demo-train` from an exec step of the
// demo pipeline. It is not a trainer for real models.
//
// One step is reward-weighted maximum likelihood over the rollouts the
// served model generated, anchored to a text corpus:
//
//   - every rollout is scored against the corpus' bigram statistics (its
//     reward is the mean corpus log-probability of its character
//     transitions, so corpus-like text scores higher);
//   - the logits move by the learning rate toward the corpus' bigram
//     log-frequencies (the maximum-likelihood table), and along the
//     advantage-weighted log-likelihood gradient of the rollouts (REINFORCE
//     with the batch mean reward as baseline, standardised), so high-reward samples
//     become more likely and low-reward ones less.
//
// Invariants: Step is a pure function of its inputs (no randomness, rollouts
// applied in file order), never changes its input model, and returns a
// model whose logits are all finite.
package demotrain

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

const v = bigram.Vocab

// Corpus holds the statistics the demo trainer learns from.
type Corpus struct {
	counts []float64 // v*v transition counts, [prev][next]
	total  float64
	target []float32 // the corpus' bigram log-frequencies (bigram.Train)
}

// MaxCorpusBytes bounds the corpus a demo trainer reads.
const MaxCorpusBytes = bigram.MaxCorpusBytes

// NewCorpus computes the statistics of text: every non-empty line is one
// text, EOS -> bytes -> EOS, as bigram.Train counts them.
func NewCorpus(text string) (*Corpus, error) {
	m, err := bigram.Train(text, bigram.TrainOptions{})
	if err != nil {
		return nil, err
	}
	counts, _ := bigram.Counts(text)
	c := &Corpus{counts: counts, target: m.Logits()}
	for _, n := range c.counts {
		c.total += n
	}
	return c, nil
}

// LoadCorpus reads a corpus file (at most MaxCorpusBytes).
func LoadCorpus(path string) (*Corpus, error) {
	text, err := bigram.ReadCorpus(path)
	if err != nil {
		return nil, err
	}
	c, err := NewCorpus(text)
	if err != nil {
		return nil, fmt.Errorf("corpus %s: %w", path, err)
	}
	return c, nil
}

// Loss is the cross-entropy of the corpus under m, in nats per character
// transition: lower means m predicts the corpus better.
func (c *Corpus) Loss(m *bigram.Model) float64 {
	l := m.Logits()
	var row [v]float64
	sum := 0.0
	for prev := range v {
		cs := c.counts[prev*v : (prev+1)*v]
		if !anyPositive(cs) {
			continue
		}
		bigram.LogSoftmax(l[prev*v:(prev+1)*v], 1, row[:])
		for next, n := range cs {
			if n > 0 {
				sum -= n * row[next]
			}
		}
	}
	return sum / c.total
}

// Reward scores a continuation of prompt: the mean log-probability of its
// character transitions under the corpus' bigram statistics (the first
// transition comes from the prompt's last byte). It is 0-free and negative;
// corpus-like text scores near the corpus' own entropy, nonsense far below.
// An empty text has no transitions and scores the worst logit.
func (c *Corpus) Reward(prompt, text string) float64 {
	ts := transitions(prompt, text)
	if len(ts) == 0 {
		return float64(minLogit(c.target))
	}
	sum := 0.0
	for _, t := range ts {
		sum += float64(c.target[t])
	}
	return sum / float64(len(ts))
}

// Rollout is one generated sample the trainer learns from.
type Rollout struct {
	Prompt string
	Text   string
}

// Options tune Step.
type Options struct {
	// LR is the step size in (0, 1]: the fraction of the way the logits
	// move toward the corpus table (default 0.5).
	LR float64
	// RewardWeight scales the rollouts' advantage-weighted gradient
	// relative to the corpus term (0: off; the demo uses DefaultRewardWeight).
	RewardWeight float64
}

// The demo's settings.
const (
	DefaultLR           = 0.5
	DefaultRewardWeight = 1.0
)

// Result is what one step did.
type Result struct {
	Model      *bigram.Model
	LossBefore float64 // corpus cross-entropy of the input model
	LossAfter  float64 // and of the updated one
	MeanReward float64 // the rollouts' mean reward (their model's quality)
	Rollouts   int
}

// Step performs one demo training step from init on the rollouts.
func Step(init *bigram.Model, c *Corpus, rollouts []Rollout, o Options) (*Result, error) {
	if o.LR == 0 {
		o.LR = DefaultLR
	}
	if !(o.LR > 0 && o.LR <= 1) {
		return nil, fmt.Errorf("learning rate %v, want 0 < lr <= 1", o.LR)
	}
	if !(o.RewardWeight >= 0) || math.IsInf(o.RewardWeight, 0) {
		return nil, fmt.Errorf("reward weight %v, want a finite value >= 0", o.RewardWeight)
	}
	if len(rollouts) == 0 {
		return nil, errors.New("no rollouts to learn from")
	}
	l := init.Logits()
	res := &Result{LossBefore: c.Loss(init), Rollouts: len(rollouts)}

	rewards := make([]float64, len(rollouts))
	for i, r := range rollouts {
		rewards[i] = c.Reward(r.Prompt, r.Text)
		res.MeanReward += rewards[i]
	}
	res.MeanReward /= float64(len(rollouts))
	std := 0.0
	for _, r := range rewards {
		std += (r - res.MeanReward) * (r - res.MeanReward)
	}
	std = math.Sqrt(std / float64(len(rollouts)))

	// The policy gradient of sum_s A_s log p(s), with A_s the standardised
	// reward, per logit: count(prev->next) - count(prev->*) * softmax.
	grad := make([]float64, v*v)
	if std > 1e-9 {
		fromRow := make([]float64, v)
		for i, r := range rollouts {
			a := (rewards[i] - res.MeanReward) / std
			for _, t := range transitions(r.Prompt, r.Text) {
				grad[t] += a
				fromRow[t/v] += a
			}
		}
		var row [v]float64
		for prev, n := range fromRow {
			if n == 0 {
				continue
			}
			bigram.LogSoftmax(l[prev*v:(prev+1)*v], 1, row[:])
			for next := range v {
				grad[prev*v+next] -= n * math.Exp(row[next])
			}
		}
		for i := range grad {
			grad[i] /= float64(len(rollouts))
		}
	}
	out := make([]float32, v*v)
	for i := range l {
		x := float64(l[i]) + o.LR*(float64(c.target[i])-float64(l[i])) + o.LR*o.RewardWeight*grad[i]
		out[i] = float32(x)
	}
	m, err := bigram.FromLogits(out)
	if err != nil {
		return nil, fmt.Errorf("updated model: %w", err)
	}
	res.Model = m
	res.LossAfter = c.Loss(m)
	return res, nil
}

// transitions returns the flat [prev*v+next] indices of text's character
// transitions, starting from prompt's last byte (EOS for an empty prompt or
// one ending in a newline, as the bigram model conditions).
func transitions(prompt, text string) []int {
	prev := byte(bigram.EOS)
	if p := bigram.Tokenize(prompt); len(p) > 0 && p[len(p)-1] != '\n' {
		prev = p[len(p)-1]
	}
	toks := bigram.Tokenize(text)
	out := make([]int, 0, len(toks))
	for _, t := range toks {
		out = append(out, int(prev)*v+int(t))
		prev = t
	}
	return out
}

func anyPositive(xs []float64) bool {
	for _, x := range xs {
		if x > 0 {
			return true
		}
	}
	return false
}

func minLogit(l []float32) float32 {
	m := l[0]
	for _, x := range l {
		m = min(m, x)
	}
	return m
}

// LoadInit reads the model to start from: a bigram checkpoint (file or
// directory), or "random:SEED" for the untrained model bigram.Random(SEED),
// which is what the vLLM double serves when started without --model.
func LoadInit(spec string) (*bigram.Model, error) {
	if s, ok := strings.CutPrefix(spec, "random:"); ok {
		seed, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("init %q: want random:SEED with SEED an unsigned integer", spec)
		}
		return bigram.Random(seed), nil
	}
	m, err := bigram.Load(spec)
	if err != nil {
		return nil, fmt.Errorf("init: %w", err)
	}
	return m, nil
}

// MaxLineBytes bounds one line of a rollouts or prompts file.
const MaxLineBytes = 16 << 20

// ReadPrompts reads a prompts JSONL file as the generate step does: one
// object per line with "prompt" (a string) and an optional "id" (a string
// or a number; default: the line number). It returns prompt text by id.
func ReadPrompts(path string) (map[string]string, error) {
	out := map[string]string{}
	err := eachLine(path, func(n int, b []byte) error {
		var l struct {
			ID     json.RawMessage `json:"id"`
			Prompt *string         `json:"prompt"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("not a JSON object: %w", err)
		}
		if l.Prompt == nil {
			return errors.New(`no "prompt" string (the demo trainer takes plain prompts, not chat messages)`)
		}
		id := strconv.Itoa(n)
		if len(l.ID) > 0 && string(l.ID) != "null" {
			s, ok := vllm.ScalarText(l.ID)
			if !ok {
				return fmt.Errorf("id must be a string or a number, got %s", l.ID)
			}
			id = s
		}
		out[id] = *l.Prompt
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("prompts %w", err)
	}
	return out, nil
}

// ReadRollouts reads a rollouts JSONL file as the generate step writes it,
// one sample per line ({"prompt_id", "prompt", "text", ...}), and pairs
// each sample with its prompt: the row's own "prompt", else prompts'
// entry for its prompt_id (rollouts written before rows carried their
// prompt). prompts may be nil.
func ReadRollouts(path string, prompts map[string]string) ([]Rollout, error) {
	var out []Rollout
	err := eachLine(path, func(n int, b []byte) error {
		var l struct {
			PromptID *string         `json:"prompt_id"`
			Prompt   *string         `json:"prompt"`
			Messages json.RawMessage `json:"messages"`
			Text     *string         `json:"text"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("not a JSON object: %w", err)
		}
		if l.PromptID == nil || l.Text == nil {
			return errors.New(`want "prompt_id" and "text" strings`)
		}
		if l.Prompt != nil {
			out = append(out, Rollout{Prompt: *l.Prompt, Text: *l.Text})
			return nil
		}
		if len(l.Messages) > 0 && string(l.Messages) != "null" {
			return errors.New(`a chat rollout ("messages"): the demo trainer takes plain prompts`)
		}
		if prompts == nil {
			return fmt.Errorf("prompt_id %q: the row has no \"prompt\" and no prompts file was given", *l.PromptID)
		}
		p, ok := prompts[*l.PromptID]
		if !ok {
			return fmt.Errorf("prompt_id %q is not in the prompts file", *l.PromptID)
		}
		out = append(out, Rollout{Prompt: p, Text: *l.Text})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("rollouts %w", err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("rollouts %s: no samples", path)
	}
	return out, nil
}

// eachLine calls f with every non-blank line of a file and its 1-based
// number; errors read "PATH:LINE: problem".
func eachLine(path string, f func(n int, b []byte) error) error {
	fh, err := os.Open(path)
	if err != nil {
		return err
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	sc.Buffer(make([]byte, 64<<10), MaxLineBytes)
	n := 0
	for sc.Scan() {
		n++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		if err := f(n, b); err != nil {
			return fmt.Errorf("%s:%d: %w", path, n, err)
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("%s:%d: %w", path, n+1, err)
	}
	return nil
}

// Files names the inputs and output of a demo training step on disk.
type Files struct {
	Init     string // checkpoint or random:SEED (see LoadInit)
	Rollouts string // rollouts JSONL (generate's output)
	Prompts  string // the prompts JSONL the rollouts came from; "": the rows' own prompts
	Corpus   string // text corpus, one text per line
	Out      string // checkpoint directory to write
}

// CheckpointFile is the file a demo checkpoint directory holds.
const CheckpointFile = "model.safetensors"

// Run loads the inputs, performs one Step and writes the new model to
// Out/model.safetensors atomically. It returns the step's result and the
// absolute checkpoint directory.
func Run(f Files, o Options) (*Result, string, error) {
	if f.Out == "" {
		return nil, "", errors.New("no output directory")
	}
	init, err := LoadInit(f.Init)
	if err != nil {
		return nil, "", err
	}
	c, err := LoadCorpus(f.Corpus)
	if err != nil {
		return nil, "", err
	}
	var ps map[string]string
	if f.Prompts != "" {
		if ps, err = ReadPrompts(f.Prompts); err != nil {
			return nil, "", err
		}
	}
	rs, err := ReadRollouts(f.Rollouts, ps)
	if err != nil {
		return nil, "", err
	}
	res, err := Step(init, c, rs, o)
	if err != nil {
		return nil, "", err
	}
	dir, err := filepath.Abs(f.Out)
	if err != nil {
		return nil, "", fmt.Errorf("output directory: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, "", fmt.Errorf("output directory: %w", err)
	}
	if err := res.Model.Save(filepath.Join(dir, CheckpointFile)); err != nil {
		return nil, "", err
	}
	return res, dir, nil
}
