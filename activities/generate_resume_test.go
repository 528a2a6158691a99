package activities

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/testsuite"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
)

// waitUntil polls cond every 5 ms for up to 10 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestGenerateResumesAfterCancel runs attempt 1 until about 40% of the
// prompts are done, cancels it, and runs attempt 2 with the heartbeat
// details Temporal would hand it: attempt 2 must skip the finished prompts.
func TestGenerateResumesAfterCancel(t *testing.T) {
	const prompts = 1000
	d := newDouble(t, double.Config{DevMode: true, Latency: 5 * time.Millisecond})
	a := newActivities(t)
	sc := stepContext(t, "rollout", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "prompts.jsonl", promptLines(prompts)...), MaxTokens: 4, Concurrency: 10}

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := a.Generate(ctx, in)
		errc <- err
	}()
	waitUntil(t, "40% of the prompts", func() bool { return d.Stats().Completions >= prompts*4/10 })
	cancel()
	err := <-errc
	require.ErrorIs(t, err, context.Canceled)
	partial := a.DataDir + "/run-1/iter-2/rollout/rollouts.jsonl.partial"
	pw, done, err := openResume(t, partial, mustGenRun(t, a, in), 1)
	require.NoError(t, err)
	pw.f.Close()
	require.Greater(t, done, prompts*3/10, "attempt 1 kept its finished prompts")

	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.RegisterActivity(a.Generate)
	env.SetHeartbeatDetails(GenerateProgress{Partial: partial, Done: done, Total: prompts})
	var mu sync.Mutex
	var beats []GenerateProgress
	env.SetOnActivityHeartbeatListener(func(_ *activity.Info, details converter.EncodedValues) {
		var p GenerateProgress
		if details.Get(&p) == nil {
			mu.Lock()
			beats = append(beats, p)
			mu.Unlock()
		}
	})
	val, err := env.ExecuteActivity(a.Generate, in)
	require.NoError(t, err)
	var out GenerateOutput
	require.NoError(t, val.Get(&out))
	assert.Equal(t, done, out.Resumed)
	assert.Equal(t, prompts, out.Samples)
	rows := readRollouts(t, out.Path)
	require.Len(t, rows, prompts)
	for i, r := range rows {
		require.Equal(t, fmt.Sprintf("p%d", i), r.PromptID)
	}
	twice := 0
	for _, n := range d.Stats().Prompts {
		if n > 1 {
			twice++
		}
	}
	assert.LessOrEqual(t, twice, prompts*5/100, "prompts requested twice")
	t.Logf("resumed %d of %d prompts; %d requested twice", done, prompts, twice)
	mu.Lock()
	defer mu.Unlock()
	// The SDK throttles heartbeats, so not every one arrives; those that do
	// carry the partial file and a count that never goes back.
	require.NotEmpty(t, beats)
	for i, b := range beats {
		assert.Equal(t, partial, b.Partial)
		assert.Equal(t, prompts, b.Total)
		assert.GreaterOrEqual(t, b.Done, done)
		if i > 0 {
			assert.GreaterOrEqual(t, b.Done, beats[i-1].Done)
		}
	}
}

func openResume(t *testing.T, path string, g *genRun, n int) (*partialFile, int, error) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	pw, done, err := resumePartial(f, path, g.fingerprint, g.set, n)
	if err != nil {
		f.Close()
	}
	return pw, done, err
}

// mustGenRun prepares the run Generate would for in, defaults resolved.
func mustGenRun(t *testing.T, a *Activities, in GenerateInput) *genRun {
	t.Helper()
	require.NoError(t, resolveArgs(context.Background(), pipelines.StepGenerate, &in))
	g, err := a.newGenRun(context.Background(), pipelines.StepGenerate, &in, "rollouts.jsonl", false, nil)
	require.NoError(t, err)
	return g
}

func TestResumePartialCutsTornAndForeignTails(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	a := newActivities(t)
	sc := stepContext(t, "g", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(3)...), N: 2}
	g := mustGenRun(t, a, in)
	path := sc.BaseDir + "/x.partial"
	row := func(id string, k int) string {
		return fmt.Sprintf(`{"prompt_id":%q,"sample":%d,"text":"t"}`+"\n", id, k)
	}
	header := fmt.Sprintf(`{"rlflow_partial":1,"fingerprint":%q}`+"\n", g.fingerprint)
	cases := []struct {
		name, body string
		done       int
	}{
		{"complete blocks", header + row("p1", 0) + row("p1", 1) + row("p0", 0) + row("p0", 1), 2},
		{"half a block", header + row("p1", 0) + row("p1", 1) + row("p0", 0), 1},
		{"torn line", header + row("p1", 0) + row("p1", 1) + `{"prompt_id":"p0","sam`, 1},
		{"unknown id", header + row("zz", 0) + row("zz", 1) + row("p0", 0) + row("p0", 1), 0},
		{"mixed block", header + row("p1", 0) + row("p0", 1), 0},
		{"repeated prompt", header + row("p1", 0) + row("p1", 1) + row("p1", 0) + row("p1", 1), 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.NoError(t, os.WriteFile(path, []byte(c.body), 0o644))
			pw, done, err := openResume(t, path, g, 2)
			require.NoError(t, err)
			defer pw.f.Close()
			assert.Equal(t, c.done, done)
			st, err := os.Stat(path)
			require.NoError(t, err)
			assert.Equal(t, pw.off, st.Size(), "cut after the last complete block")
		})
	}
	require.NoError(t, os.WriteFile(path, []byte(`{"rlflow_partial":1,"fingerprint":"other"}`+"\n"+row("p0", 0)), 0o644))
	_, _, err := openResume(t, path, g, 2)
	assert.ErrorContains(t, err, "made from other inputs")
	require.NoError(t, os.WriteFile(path, []byte(row("p0", 0)), 0o644))
	_, _, err = openResume(t, path, g, 2)
	assert.ErrorContains(t, err, "no partial-file header")
}

// TestGenerateRetriesAbortedSamples pauses the server (mode abort) while
// every request is in flight, resumes it later: the aborted samples are
// generated again, none is written with finish reason "abort".
func TestGenerateRetriesAbortedSamples(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true, Latency: 300 * time.Millisecond})
	a := newActivities(t)
	sc := stepContext(t, "g", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(4)...), N: 2, MaxTokens: 8}
	c, err := vllm.New(d.URL, vllm.Options{})
	require.NoError(t, err)
	// Registered after newDouble's cleanup, so they run before it: a failed
	// assertion below must not leave requests held by the paused double,
	// which would block the test server's Close forever.
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { _ = c.Resume(context.Background()) })
	t.Cleanup(cancel)
	type result struct {
		out *GenerateOutput
		err error
	}
	res := make(chan result, 1)
	go func() {
		out, err := a.Generate(ctx, in)
		res <- result{out, err}
	}()
	waitUntil(t, "all 8 sequences in flight", func() bool { return d.Stats().Requests["POST /v1/completions"] >= 8 })
	require.NoError(t, c.Pause(context.Background(), vllm.PauseAbort))
	// At least 8: on a loaded machine a retry may be aborted again before
	// this poll sees the count at exactly 8.
	waitUntil(t, "aborts", func() bool { return d.Stats().Aborted >= 8 })
	require.NoError(t, c.UpdateWeightVersion(context.Background(), "after-pause"))
	time.Sleep(150 * time.Millisecond) // the retries wait on the paused server
	select {
	case r := <-res:
		t.Fatalf("generate finished while paused: %+v %v", r.out, r.err)
	default:
	}
	require.NoError(t, c.Resume(context.Background()))
	r := <-res
	require.NoError(t, r.err)
	for _, row := range readRollouts(t, r.out.Path) {
		assert.NotEqual(t, "abort", row.FinishReason)
		assert.Equal(t, "after-pause", row.WeightVersion, "the version is read again after an abort")
	}
	assert.Equal(t, "after-pause", r.out.WeightVersion)
	assert.Equal(t, 8, d.Stats().Completions)
	for p, n := range d.Stats().Prompts {
		assert.Equal(t, 4, n, "prompt %q: 2 samples, each sent twice", p)
	}
}

// A partial file is only resumed by a retry of the same step with the same
// inputs: a first attempt starts over, and so does a retry whose sampling
// parameters changed.
func TestGenerateResumesOnlyItsOwnPartial(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	a := newActivities(t)
	sc := stepContext(t, "rollout", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(4)...), MaxTokens: 4}
	g := mustGenRun(t, a, in)
	partial := g.output + ".partial"
	require.NoError(t, os.MkdirAll(filepath.Dir(partial), 0o755))
	full := fmt.Sprintf(`{"rlflow_partial":1,"fingerprint":%q}`+"\n", g.fingerprint)
	for i := range 4 {
		full += fmt.Sprintf(`{"prompt_id":"p%d","sample":0,"text":"from the partial","completion_tokens":1}`+"\n", i)
	}
	run := func(in GenerateInput, heartbeat bool) *GenerateOutput {
		require.NoError(t, os.WriteFile(partial, []byte(full), 0o644))
		var s testsuite.WorkflowTestSuite
		env := s.NewTestActivityEnvironment()
		env.RegisterActivity(a.Generate)
		if heartbeat {
			env.SetHeartbeatDetails(GenerateProgress{Partial: partial, Done: 4, Total: 4})
		}
		val, err := env.ExecuteActivity(a.Generate, in)
		require.NoError(t, err)
		var out GenerateOutput
		require.NoError(t, val.Get(&out))
		return &out
	}

	out := run(in, true)
	assert.Equal(t, 4, out.Resumed, "a retry resumes its own partial")
	assert.Zero(t, d.Stats().Completions)
	assert.Equal(t, "from the partial", readRollouts(t, out.Path)[0].Text)

	out = run(in, false)
	assert.Zero(t, out.Resumed, "a first attempt never trusts a partial left behind")
	assert.Equal(t, 4, d.Stats().Completions)

	greedy := in
	greedy.Temperature = new(float64)
	out = run(greedy, true)
	assert.Zero(t, out.Resumed, "other sampling parameters: start over")
	assert.Equal(t, 8, d.Stats().Completions)
	assert.NotEqual(t, "from the partial", readRollouts(t, out.Path)[0].Text)
}

// A retry that starts while an earlier attempt still holds the partial file
// fails (retryably) instead of writing into it too.
func TestGeneratePartialFileIsLocked(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	a := newActivities(t)
	sc := stepContext(t, "rollout", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(2)...), MaxTokens: 2}
	partial := mustGenRun(t, a, in).output + ".partial"
	require.NoError(t, os.MkdirAll(filepath.Dir(partial), 0o755))
	held, err := os.Create(partial)
	require.NoError(t, err)
	require.NoError(t, syscall.Flock(int(held.Fd()), syscall.LOCK_EX))
	_, err = a.Generate(context.Background(), in)
	assert.Equal(t, pipelines.ErrTypeIO, errType(t, err))
	assert.ErrorContains(t, err, "is locked by another attempt of this step")
	held.Close()
	out, err := a.Generate(context.Background(), in)
	require.NoError(t, err)
	assert.Equal(t, 2, out.Samples)
}

// writeHeader reports every failure to start a partial file: a partial
// without its header can never be resumed. (It once ignored them: the
// error of Truncate and WriteAt was a shadowed variable.)
func TestWriteHeaderReportsFailures(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.partial")
	require.NoError(t, os.WriteFile(path, []byte("old contents\n"), 0o644))
	ro, err := os.Open(path) // read-only: truncating and writing fail
	require.NoError(t, err)
	defer ro.Close()
	assert.Error(t, writeHeader(ro, []byte("{}\n")))

	rw, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer rw.Close()
	require.NoError(t, writeHeader(rw, []byte("{}\n")))
	got, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "{}\n", string(got))
	off, err := rw.Seek(0, io.SeekCurrent)
	require.NoError(t, err)
	assert.Equal(t, int64(3), off)
}
