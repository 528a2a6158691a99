package worker

import (
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/testsuite"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"github.com/rlflow/rlflow/workflows"
)

// TestRLHFIterationOnTheDouble runs a whole RLHF pipeline through the
// interpreter with the real control activities against two vLLM doubles:
// generate, a "trainer" that hands over a checkpoint, pause, a disk
// broadcast with verification, resume, evaluate. The eval set's answers are
// the trained model's greedy completions, so the score is 0 before the
// broadcast and 1 after it: the loop's until stops after one iteration.
func TestRLHFIterationOnTheDouble(t *testing.T) {
	dir := t.TempDir()
	var urls []string
	var doubles []*double.Server
	for range 2 {
		d, err := double.New(double.Config{DevMode: true, Seed: 3})
		require.NoError(t, err)
		hs := httptest.NewServer(d.Handler())
		t.Cleanup(func() { hs.Close(); d.Close() })
		urls = append(urls, hs.URL)
		doubles = append(doubles, d)
	}
	trained, err := bigram.Train(strings.Repeat("the cat sat on the mat. ", 20), bigram.TrainOptions{})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "ckpt"), 0o755))
	require.NoError(t, trained.Save(filepath.Join(dir, "ckpt", "model.safetensors")))

	var prompts, eval []string
	for i, p := range []string{"the c", "on t", "sat "} {
		prompts = append(prompts, fmt.Sprintf(`{"id": "q%d", "prompt": %q}`, i, p))
		want := trained.Sample(p, bigram.SampleOptions{MaxTokens: 6})
		before := doubles[0].Model().Sample(p, bigram.SampleOptions{MaxTokens: 6})
		require.NotEqual(t, want.Text, before.Text, "the served model answers differently before the broadcast")
		eval = append(eval, fmt.Sprintf(`{"id": "e%d", "prompt": %q, "answer": %q}`, i, p, want.Text))
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "prompts.jsonl"), []byte(strings.Join(prompts, "\n")), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "eval.jsonl"), []byte(strings.Join(eval, "\n")), 0o644))
	yaml := fmt.Sprintf(`version: 1
name: rlhf-double
servers: [{url: %q}, {url: %q, api: C}]
weight_transfer: {backend: disk}
params:
  ckpt: {type: string, default: ckpt}
loop: {until: "${{ steps.eval.outputs.score >= 0.5 }}", max_iterations: 3}
steps:
  - {id: rollout, uses: generate, with: {prompts: prompts.jsonl, n: 2, max_tokens: 8, concurrency: 4}}
  - id: train
    uses: noop
    needs: [rollout]
    with: {outputs: {checkpoint: "${{ params.ckpt }}", rollouts: "${{ steps.rollout.outputs.path }}"}}
  - {id: pause, uses: pause, needs: [train], with: {mode: keep}}
  - {id: sync, uses: broadcast, needs: [pause], with: {checkpoint: "${{ steps.train.outputs.checkpoint }}", verify: true}}
  - {id: resume, uses: resume, needs: [sync], always: true}
  - id: eval
    uses: evaluate
    needs: [resume]
    with: {prompts: eval.jsonl, temperature: 0, max_tokens: 6, scorer: {type: exact_match}}
`, urls[0], urls[1])
	path := filepath.Join(dir, "rlhf.yaml")
	require.NoError(t, os.WriteFile(path, []byte(yaml), 0o644))
	spec, err := pipelines.LoadFile(path)
	require.NoError(t, err)

	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	env.SetTestTimeout(60 * time.Second)
	RegisterWorkflows(env)
	RegisterControlActivities(env, activities.New(activities.Deps{LogDir: filepath.Join(dir, "logs"), DataDir: filepath.Join(dir, "data")}))
	env.ExecuteWorkflow(workflows.PipelineWorkflow, workflows.PipelineInput{Spec: spec})
	require.True(t, env.IsWorkflowCompleted())
	require.NoError(t, env.GetWorkflowError())
	var res workflows.PipelineResult
	require.NoError(t, env.GetWorkflowResult(&res))
	assert.Equal(t, 1, res.Iterations)
	assert.Equal(t, "until", res.StoppedBy)
	for _, d := range doubles {
		assert.Equal(t, trained.Checksum(), d.Model().Checksum())
		assert.True(t, strings.HasSuffix(d.WeightVersion(), "/iter-1"), d.WeightVersion())
		st := d.Stats()
		assert.Equal(t, 1, st.Requests["POST /pause"])
		assert.Equal(t, 1, st.Requests["POST /resume"])
	}
	rollouts, err := filepath.Glob(filepath.Join(dir, "data", "*", "iter-1", "rollout", "rollouts.jsonl"))
	require.NoError(t, err)
	assert.Len(t, rollouts, 1)
}
