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
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// generateKillPipeline: one generate step against the double at %s, whose
// worker is SIGKILLed midway; the heartbeat timeout retries it on another
// worker process, which resumes from the partial file under the shared
// --data-dir. Seeded, so that the double can tell a sample requested again.
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
    with: {prompts: prompts.jsonl, n: %d, max_tokens: 4, concurrency: %d, seed: 7}
`

// Issue 3's acceptance, end to end: a generate attempt whose worker process
// is SIGKILLed at about 40% of its samples is retried (attempt 2) on a new
// worker process, which resumes from the partial file: the run succeeds,
// every sample is in the output exactly once, and no sample whose answer
// the double sent is requested again (the double counts them).
//
// "quiet" kills while the double holds the requests in flight (pause, mode
// keep) and once the partial file holds every answer sent, so that
// "answered" is exact and the count must be zero. "anywhere" kills
// without warning: an answer the double sent in the microseconds before
// the kill and the worker never wrote is lost, at most one per request
// slot plus the writer's queue (partialFile.writeAll's bound).
func TestGenerateWorkerSIGKILLResumes(t *testing.T) {
	cases := []struct {
		name           string
		prompts, n     int
		latency        time.Duration
		concurrency    int
		quiet          bool
		maxRerequested int
	}{
		{name: "1000 prompts, quiet", prompts: 1000, n: 1, latency: 20 * time.Millisecond, concurrency: 16, quiet: true},
		{name: "8 prompts x 4 samples, quiet", prompts: 8, n: 4, latency: 200 * time.Millisecond, concurrency: 4, quiet: true},
		{name: "1000 prompts, anywhere", prompts: 1000, n: 1, latency: 20 * time.Millisecond, concurrency: 16, maxRerequested: 2 * 16},
	}
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			generateKill(t, srv.Address, bin, tc.prompts, tc.n, tc.latency, tc.concurrency, tc.quiet, tc.maxRerequested)
		})
	}
}

func generateKill(t *testing.T, address, bin string, prompts, n int, latency time.Duration, concurrency int, quiet bool, maxRerequested int) {
	total := prompts * n
	d, err := double.New(double.Config{DevMode: true, Latency: latency, MaxConcurrent: concurrency})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dctx, dcancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { _ = d.Serve(dctx, ln); close(served) }()
	url := "http://" + ln.Addr().String()
	ctl, err := vllm.New(url, vllm.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ctl.Resume(context.Background()); dcancel(); <-served; d.Close() })

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
	require.NoError(t, os.WriteFile(file, fmt.Appendf(nil, generateKillPipeline, url, n, concurrency), 0o644))
	spec, err := pipelines.LoadFile(file)
	require.NoError(t, err)
	params, err := spec.ResolveParams(nil)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "generate-kill-" + strings.NewReplacer(" ", "-", ",", "").Replace(t.Name()[strings.LastIndex(t.Name(), "/")+1:])
	w1 := startWorker(t, bin, address, queue, logDir, "--data-dir", dataDir)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	testutil.Eventually(t, time.Minute, "the double to serve 40% of the samples", func() bool {
		return d.Stats().Completions >= total*4/10
	})
	written := -1
	if quiet {
		require.NoError(t, ctl.Pause(ctx, vllm.PauseKeep))
		testutil.Eventually(t, 30*time.Second, "every answer sent, and in the partial file", func() bool {
			st := d.Stats()
			written = partialRows(t, dataDir)
			return st.Unsent == 0 && written == st.Delivered
		})
	}
	require.NoError(t, syscall.Kill(-w1.Process.Pid, syscall.SIGKILL))
	_, _ = w1.Process.Wait()
	atKill := d.Stats()
	if written < 0 {
		written = partialRows(t, dataDir)
	}
	if quiet {
		require.NoError(t, ctl.Resume(ctx))
	}
	t.Logf("worker 1 (pid %d) SIGKILLed: %d samples answered (%d answers sent), %d in the partial file, of %d", w1.Process.Pid, atKill.Completions, atKill.Delivered, written, total)
	require.Less(t, atKill.Completions, total, "attempt 1 finished before the kill: nothing to resume")
	startWorker(t, bin, address, queue, logDir, "--data-dir", dataDir)

	// The run's own deadline: heartbeat timeout (2s), retry, the remaining
	// ~60%; 2 minutes is ample on a loaded machine.
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
	assert.Equal(t, float64(total), out["samples"])
	assert.Equal(t, activities.WeightCheckVersion, out["weight_check"])
	resumed, _ := out["resumed"].(float64)
	assert.GreaterOrEqual(t, resumed, float64(total*3/10), "attempt 2 resumed too few of attempt 1's samples")
	assert.LessOrEqual(t, resumed, float64(atKill.Delivered), "resumed more samples than were answered before the kill")
	if quiet {
		assert.Equal(t, float64(written), resumed, "every answer in the partial file is kept")
	}

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
	require.Len(t, rows, total)
	seen := map[string]int{}
	for i, r := range rows {
		require.Equal(t, fmt.Sprintf("p%04d", i/n), r.PromptID, "row %d", i)
		require.Equal(t, i%n, r.Sample, "row %d", i)
		assert.NotEqual(t, "abort", r.FinishReason, "row %d", i)
		assert.NotEmpty(t, r.FinishReason, "row %d", i)
		seen[r.PromptID]++
	}
	assert.Len(t, seen, prompts)

	// The double's counts: every sample asked for; the only requests
	// beyond one per sample are those in flight at the kill, never
	// answered, or (anywhere) answered in the kill's instant.
	final := d.Stats()
	assert.Zero(t, final.PromptsUntracked)
	assert.Len(t, final.Prompts, prompts)
	sent := 0
	for _, text := range texts {
		k := final.Prompts[text]
		assert.GreaterOrEqual(t, k, n, "prompt %q was never asked for", text)
		sent += k
	}
	t.Logf("requests: %d for %d samples (%d extra); answered samples requested again: %d; answers sent: %d", sent, total, sent-total, final.Rerequested, final.Delivered)
	assert.LessOrEqual(t, final.Rerequested, maxRerequested, "answered samples requested again")
	assert.LessOrEqual(t, sent-total, concurrency+maxRerequested, "requests beyond those in flight at the kill")
	assert.Equal(t, total+final.Rerequested, final.Delivered, "every sample answered once, and again only if requested again")
}

// partialRows counts the sample rows in the partial files under dir.
func partialRows(t *testing.T, dir string) int {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*", "iter-*", "*", "*.partial"))
	require.NoError(t, err)
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for line := range bytes.Lines(b) {
			if bytes.HasPrefix(line, []byte(`{"epoch":`)) && bytes.HasSuffix(line, []byte("\n")) {
				n++
			}
		}
	}
	return n
}
