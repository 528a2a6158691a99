package activities

import (
	"bytes"
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

// TestGenerateResumesAfterCancel stops attempt 1 at about 40% of the
// samples and runs attempt 2 with the heartbeat details Temporal would hand
// it: attempt 2 requests exactly the samples attempt 1 was not answered,
// none twice (the double counts a seeded sample requested again after its
// answer was sent). The stop lands while the double holds the requests in
// flight (pause, mode keep) and once the partial file holds every answer
// sent, so that "answered" is exact: an answer sent in the microseconds
// before a kill and never read by the worker is the loss no design avoids
// (see partialFile.writeAll for the bound).
func TestGenerateResumesAfterCancel(t *testing.T) {
	cases := []struct {
		name               string
		prompts, n         int
		latency            time.Duration
		slots, concurrency int
	}{
		{"1000 prompts", 1000, 1, 5 * time.Millisecond, 0, 10},
		{"8 prompts x 4 samples", 8, 4, 100 * time.Millisecond, 4, 4},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			total := c.prompts * c.n
			d := newDouble(t, double.Config{DevMode: true, Latency: c.latency, MaxConcurrent: c.slots})
			ctl, err := vllm.New(d.URL, vllm.Options{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = ctl.Resume(context.Background()) })
			a := newActivities(t)
			sc := stepContext(t, "rollout", d)
			seed := 11
			in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "prompts.jsonl", promptLines(c.prompts)...),
				N: c.n, MaxTokens: 4, Concurrency: c.concurrency, Seed: &seed}
			partial := a.DataDir + "/run-1/iter-2/rollout/rollouts.jsonl.partial"

			ctx, cancel := context.WithCancel(context.Background())
			errc := make(chan error, 1)
			go func() {
				_, err := a.Generate(ctx, in)
				errc <- err
			}()
			waitUntil(t, "40% of the samples", func() bool { return d.Stats().Completions >= total*4/10 })
			require.NoError(t, ctl.Pause(context.Background(), vllm.PauseKeep))
			waitUntil(t, "every answer sent, and in the partial file", func() bool {
				st := d.Stats()
				return st.Unsent == 0 && partialRows(t, partial) == st.Delivered
			})
			cancel()
			require.ErrorIs(t, <-errc, context.Canceled)
			// The server notices the cancelled requests' connections close
			// on its own time; resumed before that, it would answer a
			// frozen one into a connection nobody reads.
			waitUntil(t, "the server to see every request of attempt 1 end", func() bool { return d.Stats().Open == 0 })
			require.NoError(t, ctl.Resume(context.Background()))
			atStop := d.Stats()
			written := partialRows(t, partial)
			require.Less(t, written, total, "attempt 1 finished before the stop: nothing to resume")

			var s testsuite.WorkflowTestSuite
			env := s.NewTestActivityEnvironment()
			env.RegisterActivity(a.Generate)
			env.SetHeartbeatDetails(GenerateProgress{Partial: partial, Done: written, Total: total})
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
			assert.Equal(t, written, out.Resumed, "every sample answered before the stop is kept")
			assert.Equal(t, total, out.Samples)
			assert.Equal(t, WeightCheckVersion, out.WeightCheck)
			rows := readRollouts(t, out.Path)
			require.Len(t, rows, total)
			for i, r := range rows {
				require.Equal(t, fmt.Sprintf("p%d", i/c.n), r.PromptID)
				require.Equal(t, i%c.n, r.Sample)
			}
			final := d.Stats()
			t.Logf("stopped at %d of %d samples answered (%d sent, %d in the partial file); attempt 2 resumed %d: %d answered samples requested again, %d delivered in all",
				atStop.Completions, total, atStop.Delivered, written, out.Resumed, final.Rerequested, final.Delivered)
			assert.Zero(t, final.Rerequested, "answered samples requested again")
			assert.Equal(t, total, final.Delivered, "every sample answered once")
			mu.Lock()
			defer mu.Unlock()
			// The SDK throttles heartbeats, so not every one arrives; those
			// that do carry the partial file and a count that never goes back.
			require.NotEmpty(t, beats)
			for i, b := range beats {
				assert.Equal(t, partial, b.Partial)
				assert.Equal(t, total, b.Total)
				assert.GreaterOrEqual(t, b.Done, written)
				if i > 0 {
					assert.GreaterOrEqual(t, b.Done, beats[i-1].Done)
				}
			}
		})
	}
}

// partialRows counts the sample rows in a partial file (0 before it exists).
func partialRows(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return 0
	}
	require.NoError(t, err)
	n := 0
	for line := range bytes.Lines(b) {
		if bytes.HasPrefix(line, []byte(`{"epoch":`)) && bytes.HasSuffix(line, []byte("\n")) {
			n++
		}
	}
	return n
}

func openResume(t *testing.T, path string, g *genRun) (*partialFile, error) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	pw, err := resumePartial(f, path, g.fingerprint, g.set, g.in.N)
	if err != nil {
		f.Close()
	}
	return pw, err
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
	header := fmt.Sprintf(`{"rlflow_partial":2,"fingerprint":%q}`+"\n", g.fingerprint)
	check := func(epoch int) string {
		return fmt.Sprintf(`{"check":{"epoch":%d,"server":0,"url":"http://a","version":"v1","has_version":true,"has_start_time":false}}`+"\n", epoch)
	}
	row := func(epoch, seq int, id string, k int) string {
		return fmt.Sprintf(`{"epoch":%d,"seq":%d,"row":{"prompt_id":%q,"sample":%d,"text":"t"}}`+"\n", epoch, seq, id, k)
	}
	confirm := func(epoch, upto int) string {
		return fmt.Sprintf(`{"confirm":{"epoch":%d,"upto":%d}}`+"\n", epoch, upto)
	}
	void := func(epoch, from int) string {
		return fmt.Sprintf(`{"void":{"epoch":%d,"from":%d,"reason":"r"}}`+"\n", epoch, from)
	}
	cases := []struct {
		name, body     string
		valid, pending int
		cut            bool // the file is cut before its end
	}{
		{name: "confirmed rows", body: header + check(1) + row(1, 0, "p1", 1) + row(1, 1, "p0", 0) + confirm(1, 2), valid: 2},
		{name: "confirm covers a prefix", body: header + check(1) + row(1, 0, "p1", 1) + confirm(1, 1) + row(1, 1, "p0", 0), valid: 1, pending: 1},
		{name: "confirm before its rows", body: header + check(1) + confirm(1, 2) + row(1, 1, "p0", 0) + row(1, 0, "p2", 1), valid: 2},
		{name: "void from the last confirm", body: header + check(1) + row(1, 0, "p1", 1) + confirm(1, 1) + row(1, 1, "p0", 0) + void(1, 1), valid: 1},
		{name: "voided then answered again", body: header + check(1) + row(1, 0, "p0", 0) + void(1, 0) + check(2) + row(2, 0, "p0", 0) + confirm(2, 1), valid: 1},
		{name: "two epochs", body: header + check(1) + check(2) + row(1, 0, "p0", 0) + row(2, 0, "p0", 1) + confirm(2, 1), valid: 1, pending: 1},
		{name: "torn line", body: header + check(1) + row(1, 0, "p1", 0) + confirm(1, 1) + `{"epoch":1,"seq":1,"row":{"prompt_id":"p0","sam`, valid: 1, cut: true},
		{name: "unknown id", body: header + check(1) + row(1, 0, "zz", 0) + row(1, 1, "p0", 0) + confirm(1, 2), cut: true},
		{name: "sample out of range", body: header + check(1) + row(1, 0, "p0", 2) + confirm(1, 1), cut: true},
		{name: "row of an unknown epoch", body: header + check(1) + row(1, 0, "p0", 0) + confirm(1, 1) + row(7, 0, "p1", 0), valid: 1, cut: true},
		{name: "a second check of one epoch", body: header + check(1) + row(1, 0, "p0", 0) + confirm(1, 1) + check(1), valid: 1, cut: true},
		{name: "two kinds in one record", body: header + check(1) + `{"confirm":{"epoch":1,"upto":1},"void":{"epoch":1,"from":0}}` + "\n", cut: true},
		{name: "a repeated sample", body: header + check(1) + row(1, 0, "p1", 0) + row(1, 1, "p1", 0) + confirm(1, 2), valid: 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.NoError(t, os.WriteFile(path, []byte(c.body), 0o644))
			pw, err := openResume(t, path, g)
			require.NoError(t, err)
			defer pw.f.Close()
			assert.Equal(t, c.valid, pw.valid)
			pending := 0
			for _, e := range pw.epochs {
				pending += len(e.pending)
			}
			assert.Equal(t, c.pending, pending, "rows neither confirmed nor void")
			st, err := os.Stat(path)
			require.NoError(t, err)
			assert.Equal(t, pw.off, st.Size(), "the file ends where the index does")
			assert.Equal(t, c.cut, st.Size() < int64(len(c.body)), "cut")
		})
	}
	for body, want := range map[string]string{
		`{"rlflow_partial":2,"fingerprint":"other"}` + "\n" + check(1):                      "made from other inputs",
		fmt.Sprintf(`{"rlflow_partial":1,"fingerprint":%q}`+"\n", g.fingerprint) + check(1): "is in partial-file format 1, this worker writes 2",
		row(1, 0, "p0", 0): "no partial-file header",
	} {
		require.NoError(t, os.WriteFile(path, []byte(body), 0o644))
		_, err := openResume(t, path, g)
		assert.ErrorContains(t, err, want)
	}
}

// TestGenerateRetriesAbortedSamples pauses the server (mode abort) while
// every request is in flight and resumes it later: the aborted samples are
// generated again, none is written with finish reason "abort", and the
// server is checked after the abort: a new weight version loaded while it
// was paused fails the step with StaleWeights (the weights changed under
// it), and its samples since its last good check are void.
func TestGenerateRetriesAbortedSamples(t *testing.T) {
	for _, newVersion := range []string{"", "after-pause"} {
		t.Run("version "+newVersion, func(t *testing.T) {
			// Long enough that the pause below lands while every sequence is
			// still generating, even on a machine busy with other tests.
			d := newDouble(t, double.Config{DevMode: true, Latency: 2 * time.Second})
			a := newActivities(t)
			a.HeartbeatEvery = time.Hour // no periodic check: the one after the abort finds it
			sc := stepContext(t, "g", d)
			in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(4)...), N: 2, MaxTokens: 8}
			c, err := vllm.New(d.URL, vllm.Options{})
			require.NoError(t, err)
			require.NoError(t, c.UpdateWeightVersion(context.Background(), "before"))
			// Registered after newDouble's cleanup, so they run before it: a
			// failed assertion below must not leave requests held by the
			// paused double, which would block the test server's Close.
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
			// At least 8: on a loaded machine a retry may be aborted again
			// before this poll sees the count at exactly 8.
			waitUntil(t, "aborts", func() bool { return d.Stats().Aborted >= 8 })
			if newVersion != "" {
				require.NoError(t, c.UpdateWeightVersion(context.Background(), newVersion))
			}
			time.Sleep(150 * time.Millisecond) // the retries wait on the paused server
			select {
			case r := <-res:
				t.Fatalf("generate finished while paused: %+v %v", r.out, r.err)
			default:
			}
			require.NoError(t, c.Resume(context.Background()))
			r := <-res
			if newVersion != "" {
				assert.Equal(t, pipelines.ErrTypeStaleWeights, errType(t, r.err))
				assert.ErrorContains(t, r.err, `servers[0] `+d.URL+` served weight version "before" at its last good check and weight version "after-pause" now on GET /weight_info: the weights changed under the step`)
				g := mustGenRun(t, a, in)
				pw, err := openResume(t, g.output+".partial", g)
				require.NoError(t, err)
				defer pw.f.Close()
				assert.Zero(t, pw.valid, "no sample of the changed weights is kept")
				return
			}
			require.NoError(t, r.err)
			for _, row := range readRollouts(t, r.out.Path) {
				assert.NotEqual(t, "abort", row.FinishReason)
				assert.Equal(t, "before", row.WeightVersion)
			}
			assert.Equal(t, "before", r.out.WeightVersion)
			assert.Equal(t, 8, d.Stats().Completions)
			for p, n := range d.Stats().Prompts {
				assert.Equal(t, 4, n, "prompt %q: 2 samples, each sent twice", p)
			}
		})
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
	full := fmt.Sprintf(`{"rlflow_partial":2,"fingerprint":%q}`+"\n", g.fingerprint)
	full += fmt.Sprintf(`{"check":{"epoch":1,"server":0,"url":%q,"version":"","has_version":true,"has_start_time":false}}`+"\n", d.URL)
	for i := range 4 {
		full += fmt.Sprintf(`{"epoch":1,"seq":%d,"row":{"prompt_id":"p%d","sample":0,"text":"from the partial","completion_tokens":1}}`+"\n", i, i)
	}
	full += `{"confirm":{"epoch":1,"upto":4}}` + "\n"
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

	// The interpreter's run of the step after a re-sync is a new activity
	// (attempt 1, no heartbeat) that says so: it resumes.
	in.Context.Rerun = 1
	out = run(in, false)
	assert.Equal(t, 4, out.Resumed, "a re-run after a re-sync resumes")
	assert.Equal(t, 8, d.Stats().Completions)
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
