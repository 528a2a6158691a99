package bigram

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/safetensors"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const corpus = `the cat sat on the mat
the dog ran to the park
a bird can sing
the sun is hot
`

// wordHitRate samples n texts and returns the fraction of their words that
// are corpus words: the shape of score the demo's evaluate step computes.
func wordHitRate(t *testing.T, m *Model, n int, temp float64) float64 {
	t.Helper()
	words := map[string]bool{}
	for _, w := range strings.Fields(corpus) {
		words[w] = true
	}
	r := rand.New(rand.NewPCG(7, 7))
	hit, total := 0, 0
	for range n {
		s := m.Sample("", SampleOptions{MaxTokens: 40, Temperature: temp, Rand: r})
		for _, w := range strings.Fields(s.Text) {
			total++
			if words[w] {
				hit++
			}
		}
	}
	if total == 0 {
		return 0
	}
	return float64(hit) / float64(total)
}

func TestTrainedModelSpeaksTheCorpusRandomDoesNot(t *testing.T) {
	trained, err := Train(corpus, TrainOptions{})
	require.NoError(t, err)
	random := Random(1)
	for temp, floor := range map[float64]float64{1: 0.15, 0.7: 0.3} {
		tr, rd := wordHitRate(t, trained, 200, temp), wordHitRate(t, random, 200, temp)
		t.Logf("temperature %v: corpus-word rate trained %.2f, random %.2f", temp, tr, rd)
		assert.Greater(t, tr, floor, "trained model at temperature %v: corpus-word rate", temp)
		assert.Less(t, rd, 0.02, "random model at temperature %v: corpus-word rate", temp)
	}
	// Greedy from the start of a text is the corpus' most common opening.
	s := trained.Sample("", SampleOptions{MaxTokens: 3})
	assert.Equal(t, "the", s.Text)
}

func TestRandomSamplesAreReadableNonsense(t *testing.T) {
	m := Random(3)
	r := rand.New(rand.NewPCG(1, 1))
	s := m.Sample("x", SampleOptions{MaxTokens: 200, Temperature: 1, Rand: r})
	for _, b := range []byte(s.Text) {
		assert.True(t, b == '\n' || (b >= ' ' && b < 127), "byte %#x is not readable", b)
	}
	assert.Equal(t, Random(3).Checksum(), m.Checksum(), "same seed, same model")
	assert.NotEqual(t, Random(4).Checksum(), m.Checksum())
}

func TestSampleIsDeterministicPerSeed(t *testing.T) {
	m := Random(1)
	opts := func(seed uint64) SampleOptions {
		return SampleOptions{MaxTokens: 30, Temperature: 1, Rand: rand.New(rand.NewPCG(seed, 0))}
	}
	a, b := m.Sample("hi", opts(5)), m.Sample("hi", opts(5))
	assert.Equal(t, a, b)
	c := m.Sample("hi", opts(6))
	assert.NotEqual(t, a.Text, c.Text)
}

func TestSampleFinishReasons(t *testing.T) {
	m, err := Train("ab\n", TrainOptions{})
	require.NoError(t, err)
	// Greedy: EOS -> a -> b -> EOS.
	s := m.Sample("", SampleOptions{MaxTokens: 10})
	assert.Equal(t, Sample{Text: "ab", Tokens: 3, FinishReason: "stop"}, s)
	s = m.Sample("", SampleOptions{MaxTokens: 1})
	assert.Equal(t, Sample{Text: "a", Tokens: 1, FinishReason: "length"}, s)
	s = m.Sample("", SampleOptions{MaxTokens: 10, Stop: []string{"b"}})
	assert.Equal(t, Sample{Text: "a", Tokens: 2, FinishReason: "stop"}, s)
	s = m.Sample("", SampleOptions{MaxTokens: 0})
	assert.Equal(t, "length", s.FinishReason)
	assert.Empty(t, s.Text)
	// A prompt ending in a newline starts a new text, like an empty one.
	assert.Equal(t, "ab", m.Sample("zzz\n", SampleOptions{MaxTokens: 10}).Text)
}

func TestLogprobs(t *testing.T) {
	m, err := Train("ab\n", TrainOptions{})
	require.NoError(t, err)
	s := m.Sample("", SampleOptions{MaxTokens: 2, Logprobs: true, TopLogprobs: 2})
	require.Len(t, s.Logprobs, 2)
	assert.Equal(t, "a", s.Logprobs[0].Token)
	assert.InDelta(t, 0, s.Logprobs[0].Logprob, 0.01, "a follows EOS almost surely")
	require.Len(t, s.Logprobs[0].Top, 2)
	assert.Equal(t, "a", s.Logprobs[0].Top[0].Token)
	for _, lp := range s.Logprobs {
		assert.False(t, math.IsInf(lp.Logprob, 0) || math.IsNaN(lp.Logprob))
	}
}

func TestTopPKeepsOnlyTheNucleus(t *testing.T) {
	// After "x": y with p~0.9, z with p~0.1 (counts 9:1).
	m, err := Train(strings.Repeat("xy\n", 9)+"xz\n", TrainOptions{})
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		s := m.Sample("x", SampleOptions{MaxTokens: 1, Temperature: 1, TopP: 0.5, Rand: r})
		require.Equal(t, "y", s.Text)
	}
	zs := 0
	for range 400 {
		if m.Sample("x", SampleOptions{MaxTokens: 1, Temperature: 1, Rand: r}).Text == "z" {
			zs++
		}
	}
	assert.InDelta(t, 40, zs, 25, "without top_p, z comes about 10%% of the time")
}

func TestTemperatureSharpens(t *testing.T) {
	m, err := Train(strings.Repeat("xy\n", 7)+strings.Repeat("xz\n", 3), TrainOptions{})
	require.NoError(t, err)
	count := func(temp float64) int {
		r := rand.New(rand.NewPCG(3, 3))
		n := 0
		for range 1000 {
			if m.Sample("x", SampleOptions{MaxTokens: 1, Temperature: temp, Rand: r}).Text == "z" {
				n++
			}
		}
		return n
	}
	assert.Less(t, count(0.3), count(1)/2)
	assert.Equal(t, 0, count(0), "temperature 0 is greedy")
}

func TestBadInputs(t *testing.T) {
	_, err := FromLogits(make([]float32, 3))
	assert.ErrorContains(t, err, "3 logits, want 16384")
	l := make([]float32, Vocab*Vocab)
	l[5] = float32(math.NaN())
	_, err = FromLogits(l)
	assert.ErrorContains(t, err, "logit [0,5] is NaN")
	_, err = Train("\n \n", TrainOptions{})
	assert.ErrorContains(t, err, "no non-empty line")
	_, err = Train("ab", TrainOptions{Smoothing: -1})
	assert.ErrorContains(t, err, "smoothing")
	// Non-ASCII and NUL never index outside the table.
	s := Random(1).Sample("héllo\x00\xff", SampleOptions{MaxTokens: 5, Temperature: 1, Rand: rand.New(rand.NewPCG(1, 1))})
	assert.NotEmpty(t, s.FinishReason)
	_, err = Train("日本語\x00", TrainOptions{})
	assert.NoError(t, err)
}

func TestSaveLoadRoundTrip(t *testing.T) {
	dir := t.TempDir()
	corpusPath := dir + "/corpus.txt"
	require.NoError(t, os.WriteFile(corpusPath, []byte(corpus), 0o644))
	out := filepath.Join(dir, "ckpt", "model.safetensors")
	m, err := TrainFile(corpusPath, out, TrainOptions{})
	require.NoError(t, err)
	for _, p := range []string{out, filepath.Dir(out)} { // a file or its directory
		got, err := Load(p)
		require.NoError(t, err, p)
		assert.Equal(t, m.Checksum(), got.Checksum())
		assert.Equal(t, m.Logits(), got.Logits())
	}
}

func TestLoadRejectsForeignCheckpoints(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, tensors ...safetensors.WriteTensor) string {
		p := filepath.Join(dir, name)
		require.NoError(t, safetensors.Write(p, tensors, nil))
		return p
	}
	good := Random(1).Bytes()
	cases := map[string]struct {
		path string
		want string
	}{
		"wrong shape": {write("a.safetensors", safetensors.WriteTensor{Name: TensorName, DType: safetensors.F32, Shape: []int64{64, 256}, Data: good}), "shape [64 256]"},
		"wrong dtype": {write("b.safetensors", safetensors.WriteTensor{Name: TensorName, DType: safetensors.I32, Shape: []int64{128, 128}, Data: good}), "dtype I32"},
		"extra tensor": {write("c.safetensors",
			safetensors.WriteTensor{Name: TensorName, DType: safetensors.F32, Shape: []int64{128, 128}, Data: good},
			safetensors.WriteTensor{Name: "lm_head.weight", DType: safetensors.F32, Shape: []int64{1}, Data: make([]byte, 4)}), "unexpected tensor(s) lm_head.weight"},
		"no bigram tensor": {write("d.safetensors", safetensors.WriteTensor{Name: "x", DType: safetensors.F32, Shape: []int64{1}, Data: make([]byte, 4)}), "unexpected tensor(s) x"},
		"missing":          {filepath.Join(dir, "nope.safetensors"), "no such file"},
	}
	for name, c := range cases {
		_, err := Load(c.path)
		assert.ErrorContains(t, err, c.want, name)
	}
	nan := slices.Clone(good)
	binary.LittleEndian.PutUint32(nan[4*7:], math.Float32bits(float32(math.Inf(1))))
	_, err := FromTensor("F32", []int64{128, 128}, nan)
	assert.ErrorContains(t, err, "logit [0,7] is +Inf")
}
