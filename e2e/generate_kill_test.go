package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// generateKillPipeline: one generate step against the double at %s, whose
// worker is SIGKILLed midway; the heartbeat timeout retries it on another
// worker process, which resumes from the partial file under the shared
// --data-dir.
const generateKillPipeline = `version: 1
name: generate-kill
servers:
  - {url: %q}
defaults:
  timeout: 2m
  heartbeat: 2s
  retry: {max_attempts: 3, initial_interval: 100ms}
steps:
  - id: rollout
    uses: generate
    with: {prompts: prompts.jsonl, n: %d, max_tokens: 4, concurrency: 16}
`

// Issue 3's acceptance, end to end: a generate attempt whose worker process
// is SIGKILLed at about 40% of its prompts is retried (attempt 2) on a new
// worker process, which resumes from the partial file: the run succeeds,
// every prompt is in the output exactly once, and the double saw at most 5%
// more requests than there are prompts × samples.
func TestGenerateWorkerSIGKILLResumes(t *testing.T) {
	const (
		prompts     = 1000
		n           = 1
		concurrency = 16
	)
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)

	d, err := double.New(double.Config{DevMode: true, Latency: 20 * time.Millisecond, MaxConcurrent: concurrency})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dctx, dcancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { _ = d.Serve(dctx, ln); close(served) }()
	t.Cleanup(func() { dcancel(); <-served; d.Close() })
	url := "http://" + ln.Addr().String()

	dir := t.TempDir()
	dataDir, logDir := filepath.Join(dir, "data"), filepath.Join(dir, "logs")
	var lines bytes.Buffer
	texts := map[string]string{} // prompt id -> text
	for i := range prompts {
		id, text := fmt.Sprintf("p%04d", i), fmt.Sprintf("distinct prompt %d: ", i)
		texts[id] = text
		fmt.Fprintf(&lines, "{\"id\": %q, \"prompt\": %q}\n", id, text)
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "prompts.jsonl"), lines.Bytes(), 0o644))
	file := filepath.Join(dir, "generate-kill.yaml")
	require.NoError(t, os.WriteFile(file, fmt.Appendf(nil, generateKillPipeline, url, n), 0o644))
	spec, err := pipelines.LoadFile(file)
	require.NoError(t, err)
	params, err := spec.ResolveParams(nil)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "generate-kill"
	w1 := startWorker(t, bin, srv.Address, queue, logDir, "--data-dir", dataDir)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	testutil.Eventually(t, time.Minute, "the double to serve 40% of the prompts", func() bool {
		return d.Stats().Completions >= prompts*n*4/10
	})
	require.NoError(t, syscall.Kill(-w1.Process.Pid, syscall.SIGKILL))
	_, _ = w1.Process.Wait()
	atKill := d.Stats()
	sentAtKill := 0
	for _, k := range atKill.Prompts {
		sentAtKill += k
	}
	t.Logf("worker 1 (pid %d) SIGKILLed: %d samples served, %d requests sent, of %d", w1.Process.Pid, atKill.Completions, sentAtKill, prompts*n)
	require.Less(t, atKill.Completions, prompts*n, "attempt 1 finished before the kill: nothing to resume")
	startWorker(t, bin, srv.Address, queue, logDir, "--data-dir", dataDir)

	// The run's own deadline: heartbeat timeout (2s), retry, the remaining
	// ~60% at ~800 prompts/s; 2 minutes is ample on a loaded machine.
	rctx, rcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer rcancel()
	var res workflows.PipelineResult
	require.NoError(t, run.Get(rctx, &res))
	require.Equal(t, 1, res.Iterations)
	require.Len(t, res.Recent, 1)
	it := res.Recent[0]
	require.Equal(t, workflows.StatusSucceeded, it.Status)
	out := it.Outputs["rollout"]
	require.NotNil(t, out, "rollout outputs: %v", it.Outputs)
	t.Logf("rollout outputs: %v", out)
	assert.Equal(t, float64(prompts), out["prompts"])
	assert.Equal(t, float64(prompts*n), out["samples"])
	resumed, _ := out["resumed"].(float64)
	assert.Greater(t, resumed, 0.0, "attempt 2 resumed nothing")
	assert.GreaterOrEqual(t, resumed, float64(prompts*3/10), "attempt 2 resumed too few of attempt 1's prompts")
	assert.LessOrEqual(t, resumed, float64(atKill.Completions/n), "resumed more prompts than were served before the kill")

	st, err := runs.GetStatus(ctx, c, run.GetID(), "")
	require.NoError(t, err)
	assert.Equal(t, "Completed", st.Execution)
	require.Len(t, st.Steps, 1, "status: %+v", st)
	assert.Equal(t, "rollout", st.Steps[0].ID)
	assert.Equal(t, 2, st.Steps[0].Attempts, "the step's final result is attempt 2's")

	// The output: complete, valid JSONL, every prompt once with its n
	// samples in prompt order, none aborted; the partial file is gone.
	path, _ := out["path"].(string)
	require.True(t, strings.HasPrefix(path, dataDir+string(filepath.Separator)), "output %q is not under the worker's data dir %q", path, dataDir)
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	require.True(t, bytes.HasSuffix(raw, []byte("\n")), "the output ends mid-line")
	_, err = os.Stat(path + ".partial")
	assert.True(t, os.IsNotExist(err), "the partial file is left behind: %v", err)
	var rows []activities.Rollout
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var r activities.Rollout
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), "line %d: %s", len(rows)+1, sc.Text())
		rows = append(rows, r)
	}
	require.NoError(t, sc.Err())
	require.Len(t, rows, prompts*n)
	seen := map[string]int{}
	for i, r := range rows {
		require.Equal(t, fmt.Sprintf("p%04d", i/n), r.PromptID, "row %d", i)
		require.Equal(t, i%n, r.Sample, "row %d", i)
		assert.NotEqual(t, "abort", r.FinishReason, "row %d", i)
		assert.NotEmpty(t, r.FinishReason, "row %d", i)
		seen[r.PromptID]++
	}
	assert.Len(t, seen, prompts)

	// The double's count of requests per prompt: every prompt asked for,
	// and the kill cost at most 5% extra.
	final := d.Stats()
	assert.Zero(t, final.PromptsUntracked)
	assert.Len(t, final.Prompts, prompts)
	sent := 0
	for _, text := range texts {
		k := final.Prompts[text]
		assert.GreaterOrEqual(t, k, n, "prompt %q was never asked for", text)
		sent += k
	}
	extra := sent - prompts*n
	pct := 100 * float64(extra) / float64(prompts*n)
	t.Logf("requests: %d for %d prompts x %d samples: %d extra (%.1f%%); attempt 2 resumed %d prompts", sent, prompts, n, extra, pct, int(resumed))
	assert.LessOrEqual(t, sent, prompts*n*105/100, "the kill cost more than 5%% extra requests")
}
