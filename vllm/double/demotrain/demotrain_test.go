package demotrain

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func demoCorpus(t *testing.T) *Corpus {
	t.Helper()
	c, err := LoadCorpus(filepath.Join(testutil.ModuleRoot(), "pipelines/examples/data/corpus.txt"))
	require.NoError(t, err)
	return c
}

var prompts = []string{"the ", "a ", "the cat ", "the dog ", "the sea "}

// rollouts samples from m as the generate step would (seeded, temperature 1).
func rollouts(m *bigram.Model, seed uint64) []Rollout {
	r := rand.New(rand.NewPCG(seed, 1))
	var out []Rollout
	for _, p := range prompts {
		for range 4 {
			s := m.Sample(p, bigram.SampleOptions{MaxTokens: 32, Temperature: 1, Rand: r})
			out = append(out, Rollout{Prompt: p, Text: s.Text})
		}
	}
	return out
}

func meanReward(c *Corpus, rs []Rollout) float64 {
	sum := 0.0
	for _, r := range rs {
		sum += c.Reward(r.Prompt, r.Text)
	}
	return sum / float64(len(rs))
}

// The demo loop in miniature: sample from the current model, train on the
// samples, repeat. The corpus loss falls and the samples' reward rises at
// every step.
func TestStepImprovesLossAndRewardStepAfterStep(t *testing.T) {
	c := demoCorpus(t)
	m := bigram.Random(0)
	prevLoss := c.Loss(m)
	prevReward := meanReward(c, rollouts(m, 100))
	for step := 1; step <= 4; step++ {
		res, err := Step(m, c, rollouts(m, uint64(step)), Options{LR: 0.5, RewardWeight: DefaultRewardWeight})
		require.NoError(t, err)
		assert.InDelta(t, prevLoss, res.LossBefore, 1e-9)
		reward := meanReward(c, rollouts(res.Model, 100))
		t.Logf("step %d: corpus loss %.3f -> %.3f nats/char, sample reward %.3f -> %.3f", step, res.LossBefore, res.LossAfter, prevReward, reward)
		assert.Less(t, res.LossAfter, res.LossBefore, "step %d: corpus loss", step)
		assert.Greater(t, reward, prevReward, "step %d: sample reward", step)
		m, prevLoss, prevReward = res.Model, res.LossAfter, reward
	}
}

// The reward term alone (no corpus pull) still moves the model toward its
// own high-reward samples: their log-likelihood rises, the low-reward ones' falls.
func TestRewardTermFavoursHighRewardSamples(t *testing.T) {
	c := demoCorpus(t)
	m := bigram.Random(3)
	good := Rollout{Prompt: "the ", Text: "cat sat on the mat"}
	bad := Rollout{Prompt: "the ", Text: "x#Qz!k@@p~"}
	require.Greater(t, c.Reward(good.Prompt, good.Text), c.Reward(bad.Prompt, bad.Text))
	res, err := Step(m, c, []Rollout{good, bad}, Options{LR: 1e-9, RewardWeight: 1e8})
	require.NoError(t, err)
	assert.Greater(t, logLik(res.Model, good), logLik(m, good))
	assert.Less(t, logLik(res.Model, bad), logLik(m, bad))
}

func logLik(m *bigram.Model, r Rollout) float64 {
	l := m.Logits()
	var row [v]float64
	sum := 0.0
	for _, t := range transitions(r.Prompt, r.Text) {
		bigram.LogSoftmax(l[t/v*v:(t/v+1)*v], 1, row[:])
		sum += row[t%v]
	}
	return sum
}

func TestStepIsDeterministicAndLeavesItsInputAlone(t *testing.T) {
	c := demoCorpus(t)
	m := bigram.Random(0)
	before := m.Checksum()
	rs := rollouts(m, 9)
	o := Options{RewardWeight: DefaultRewardWeight}
	a, err := Step(m, c, rs, o)
	require.NoError(t, err)
	b, err := Step(m, c, rs, o)
	require.NoError(t, err)
	assert.Equal(t, a.Model.Checksum(), b.Model.Checksum())
	assert.Equal(t, before, m.Checksum())
	assert.NotEqual(t, before, a.Model.Checksum())
}

func TestStepRejectsBadOptions(t *testing.T) {
	c := demoCorpus(t)
	m := bigram.Random(0)
	rs := rollouts(m, 1)
	for _, o := range []Options{{LR: -0.1}, {LR: 1.5}, {RewardWeight: -1}} {
		_, err := Step(m, c, rs, o)
		assert.Error(t, err, "%+v", o)
	}
	_, err := Step(m, c, nil, Options{})
	assert.ErrorContains(t, err, "no rollouts")
}

func TestRunWritesACheckpointTheDoubleCanLoad(t *testing.T) {
	dir := t.TempDir()
	var pl, rl []string
	for i, p := range prompts {
		pl = append(pl, fmt.Sprintf(`{"id": %d, "prompt": %q}`, i, p))
		for k, text := range []string{"cat sat", "#$%"} {
			rl = append(rl, fmt.Sprintf(`{"prompt_id": "%d", "sample": %d, "text": %q, "finish_reason": "length"}`, i, k, text))
		}
	}
	ps := filepath.Join(dir, "prompts.jsonl")
	rs := filepath.Join(dir, "rollouts.jsonl")
	require.NoError(t, os.WriteFile(ps, []byte(strings.Join(pl, "\n")+"\n"), 0o644))
	require.NoError(t, os.WriteFile(rs, []byte(strings.Join(rl, "\n")+"\n"), 0o644))
	files := Files{Init: "random:0", Rollouts: rs, Prompts: ps, Corpus: filepath.Join(testutil.ModuleRoot(), "pipelines/examples/data/corpus.txt"), Out: filepath.Join(dir, "ckpt", "iter-1")}
	res, out, err := Run(files, Options{RewardWeight: DefaultRewardWeight})
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(dir, "ckpt", "iter-1"), out)
	assert.Equal(t, 2*len(prompts), res.Rollouts)
	m, err := bigram.Load(out) // the disk backend loads the directory
	require.NoError(t, err)
	assert.Equal(t, res.Model.Checksum(), m.Checksum())

	// Chained: the next step starts from the checkpoint just written.
	files.Init, files.Out = out, filepath.Join(dir, "ckpt", "iter-2")
	res2, _, err := Run(files, Options{})
	require.NoError(t, err)
	assert.InDelta(t, res.LossAfter, res2.LossBefore, 1e-6)
}

func TestBadInputsNameThePlace(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(text), 0o644))
		return p
	}
	ps := map[string]string{"a": "the "}
	for text, want := range map[string]string{
		"{\"prompt_id\": \"a\", \"text\": \"b\"}\nnot json\n": "bad.jsonl:2: not a JSON object",
		"{\"prompt_id\": \"a\"}\n":                            "bad.jsonl:1: want \"prompt_id\" and \"text\"",
		"{\"prompt_id\": \"z\", \"text\": \"b\"}\n":           `bad.jsonl:1: prompt_id "z" is not in the prompts file`,
		"{\"prompt_id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"text\": \"b\"}\n": `bad.jsonl:1: a chat rollout ("messages")`,
		"\n\n": "bad.jsonl: no samples",
	} {
		_, err := ReadRollouts(write("bad.jsonl", text), ps)
		assert.ErrorContains(t, err, want)
	}
	// Rows that carry their prompt need no prompts file; rows that do not,
	// without one, say so.
	got0, err := ReadRollouts(write("own.jsonl", "{\"prompt_id\": \"q\", \"prompt\": \"\", \"text\": \"b\"}\n{\"prompt_id\": \"a\", \"prompt\": \"the \", \"text\": \"c\"}\n"), nil)
	require.NoError(t, err)
	assert.Equal(t, []Rollout{{Prompt: "", Text: "b"}, {Prompt: "the ", Text: "c"}}, got0)
	_, err = ReadRollouts(write("bare.jsonl", "{\"prompt_id\": \"a\", \"text\": \"b\"}\n"), nil)
	assert.ErrorContains(t, err, `bare.jsonl:1: prompt_id "a": the row has no "prompt" and no prompts file was given`)
	for text, want := range map[string]string{
		"{\"messages\": []}\n":               `p.jsonl:1: no "prompt"`,
		"\n{\"id\": [1], \"prompt\": \"x\"}": "p.jsonl:2: id must be",
	} {
		_, err := ReadPrompts(write("p.jsonl", text))
		assert.ErrorContains(t, err, want)
	}
	got, err := ReadPrompts(write("p.jsonl", "{\"prompt\": \"x\"}\n\n{\"id\": 7, \"prompt\": \"y\"}\n"))
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"1": "x", "7": "y"}, got)
	for spec, want := range map[string]string{
		"random:x":                     "want random:SEED",
		filepath.Join(dir, "nope"):     "init: bigram:",
		write("empty.safetensors", ""): "init: bigram:",
	} {
		_, err := LoadInit(spec)
		assert.ErrorContains(t, err, want, spec)
	}
	_, err = LoadCorpus(write("blank.txt", "\n \n"))
	assert.ErrorContains(t, err, "blank.txt")
}
