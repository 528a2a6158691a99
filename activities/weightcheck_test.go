package activities

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// restartable is a double a test can restart as vLLM restarts: a new
// process on the same address, with the weights it starts with.
type restartable struct {
	t   *testing.T
	cfg double.Config
	URL string

	mu  sync.Mutex
	srv *double.Server
	run *double.Running
}

func newRestartable(t *testing.T, cfg double.Config) *restartable {
	t.Helper()
	srv, err := double.New(cfg)
	require.NoError(t, err)
	run, err := srv.Start("127.0.0.1:0")
	require.NoError(t, err)
	r := &restartable{t: t, cfg: cfg, URL: run.URL(), srv: srv, run: run}
	t.Cleanup(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.run.Kill()
		r.srv.Close()
	})
	return r
}

func (r *restartable) server() *double.Server {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.srv
}

// restart kills the serving double and starts a new one on its address;
// the new one is built first, so the address answers again at once.
func (r *restartable) restart() {
	r.t.Helper()
	srv, err := double.New(r.cfg)
	require.NoError(r.t, err)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.run.Kill()
	r.srv.Close()
	r.srv = srv
	r.run, err = srv.Start(r.run.Addr())
	require.NoError(r.t, err)
}

// writeCheckpoint writes a bigram checkpoint directory of other weights
// than any double starts with.
func writeCheckpoint(t *testing.T) string {
	dir := t.TempDir()
	require.NoError(t, bigram.Random(4242).Save(filepath.Join(dir, "model.safetensors")))
	return dir
}

// loadWeights loads a checkpoint into the server at url (disk backend) and
// labels it version, as a broadcast does.
func loadWeights(t *testing.T, url, ckpt, version string) {
	t.Helper()
	ctx := context.Background()
	c, err := vllm.New(url, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true}))
	require.NoError(t, c.StartWeightUpdate(ctx))
	require.NoError(t, c.UpdateWeights(ctx, vllm.UpdateInfo{Path: ckpt}))
	require.NoError(t, c.FinishWeightUpdate(ctx, version))
}

// staleServers returns a StaleWeights error's second detail.
func staleServers(t *testing.T, err error) pipelines.StaleServers {
	t.Helper()
	var app *temporal.ApplicationError
	require.True(t, errors.As(err, &app), "%v", err)
	require.Equal(t, pipelines.ErrTypeStaleWeights, app.Type(), "%v", err)
	var attempt pipelines.AttemptDetail
	var ss pipelines.StaleServers
	require.NoError(t, app.Details(&attempt, &ss))
	return ss
}

// keptRows returns the confirmed rows of a step's partial file, by sample.
func keptRows(t *testing.T, a *Activities, in GenerateInput) map[int]Rollout {
	t.Helper()
	g := mustGenRun(t, a, in)
	pw, err := openResume(t, g.output+".partial", g)
	require.NoError(t, err)
	defer pw.f.Close()
	out := map[int]Rollout{}
	for key, loc := range pw.rows {
		if !pw.isValid(key) {
			continue
		}
		buf := make([]byte, loc.size)
		_, err := pw.f.ReadAt(buf, loc.off)
		require.NoError(t, err)
		var rec struct{ Row Rollout }
		require.NoError(t, json.Unmarshal(buf, &rec))
		out[key] = rec.Row
	}
	return out
}

// completions counts the samples the doubles answered.
func completions(ds ...*restartable) int {
	n := 0
	for _, d := range ds {
		n += d.server().Stats().Completions
	}
	return n
}

// A server restarted in the middle of a generate step (Close and a new
// double on its address: the weights it starts with, no version) fails the
// step with StaleWeights naming it; the samples it answered since its last
// good check are not kept; once its weights are loaded again, the step run
// again (a new activity, as the interpreter runs it after the re-sync)
// regenerates exactly the samples not kept, and every row is from the
// run's weights.
func TestGenerateServerRestartedMidStepIsStale(t *testing.T) {
	const prompts = 200
	cfg := double.Config{DevMode: true, Latency: 10 * time.Millisecond, MaxConcurrent: 4, Seed: 1}
	d0, d1 := newRestartable(t, cfg), newRestartable(t, cfg)
	ckpt := writeCheckpoint(t)
	for _, d := range []*restartable{d0, d1} {
		loadWeights(t, d.URL, ckpt, "v1")
	}
	a := newActivities(t)
	// No periodic check: the end check finds the restart, after the
	// restarted server answered its share (TestGenerateStartTimeCheck
	// has the periodic one find it).
	a.HeartbeatEvery = time.Hour
	sc := pipelines.StepContext{RunID: "run-1", Iteration: 2, StepID: "rollout", BaseDir: t.TempDir(),
		Servers: []pipelines.Server{{URL: d0.URL}, {URL: d1.URL}}, Weights: &pipelines.ExpectedWeights{Version: "v1", Checkpoint: ckpt}}
	seed := 3
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "prompts.jsonl", promptLines(prompts)...), MaxTokens: 8, Seed: &seed, Concurrency: 8}

	errc := make(chan error, 1)
	go func() {
		_, err := a.Generate(context.Background(), in)
		errc <- err
	}()
	waitUntil(t, "30% of the samples", func() bool { return completions(d0, d1) >= prompts*3/10 })
	old := d1.server()
	d1.restart()
	err := <-errc
	require.Error(t, err)
	assert.Equal(t, pipelines.ErrTypeStaleWeights, errType(t, err))
	assert.ErrorContains(t, err, "generate: stale weights on 1 of 2 servers: servers[1] "+d1.URL+" ")
	assert.ErrorContains(t, err, `serves no weight version, so the weights it started with, on GET /weight_info; the run expects weight version "v1" (its last sync, `+ckpt+")")
	assert.Equal(t, pipelines.StaleServers{Indexes: []int{1}, URLs: []string{d1.URL}}, staleServers(t, err))

	// Every sample the restarted server answered, and every one d1 answered
	// since its last good check (the start), is out of the partial file;
	// what is kept is the run's weights' (d0's samples, confirmed by the
	// end check: the retry asks for none of them).
	kept := keptRows(t, a, in)
	fresh := d1.server().Stats()
	require.Positive(t, fresh.Completions, "the restarted server answered before it was found")
	for key := range prompts {
		if fresh.Prompts[fmt.Sprintf("prompt number %d: ", key)] > 0 {
			assert.NotContains(t, kept, key, "p%d, answered by the restarted server, is kept", key)
		}
	}
	for _, r := range kept {
		assert.Equal(t, "v1", r.WeightVersion)
		assert.Equal(t, d0.URL, r.Server)
	}
	t.Logf("stale after %d samples: %d kept, %d answered by the restarted server", old.Stats().Completions+d0.server().Stats().Completions+fresh.Completions, len(kept), fresh.Completions)

	// The re-sync, then the step again as the interpreter runs it: a new
	// activity (attempt 1) with Rerun set, which resumes the partial file.
	loadWeights(t, d1.URL, ckpt, "v1")
	before := completions(d0, d1)
	rereqBefore := d0.server().Stats().Rerequested
	in.Context.Rerun = 1
	out, err := a.Generate(context.Background(), in)
	require.NoError(t, err)
	assert.Equal(t, len(kept), out.Resumed)
	assert.Equal(t, prompts-len(kept), completions(d0, d1)-before, "the retry generates exactly the samples not kept")
	assert.Equal(t, rereqBefore, d0.server().Stats().Rerequested, "d0's answered samples are not requested again")
	assert.Equal(t, "v1", out.WeightVersion)
	assert.Equal(t, WeightCheckVersion, out.WeightCheck)
	rows := readRollouts(t, out.Path)
	require.Len(t, rows, prompts)

	// Every row is the run's weights': the same texts as a run on servers
	// that never restarted (seeded samples are reproducible).
	ref := in
	ref.Output, ref.Context.Rerun = "ref.jsonl", 0
	refOut, err := a.Generate(context.Background(), ref)
	require.NoError(t, err)
	for i, r := range readRollouts(t, refOut.Path) {
		assert.Equal(t, "v1", rows[i].WeightVersion, "row %d", i)
		assert.Equal(t, r.Text, rows[i].Text, "row %d (%s) is not from the run's weights", i, rows[i].Server)
	}
}

// Generation B servers have no weight versions: their process start time
// (GET /metrics) is the check. A restart with a sync expected is stale; a
// restart of a run without one is the weights it started with before and
// after, so the step goes on.
func TestGenerateStartTimeCheck(t *testing.T) {
	for _, c := range []struct {
		name string
		want *pipelines.ExpectedWeights
	}{
		{"after a sync", &pipelines.ExpectedWeights{Version: "1", Checkpoint: "/ckpt/1"}},
		{"before the first sync", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			const prompts = 120
			cfg := double.Config{DevMode: true, Generation: double.GenB, Latency: 10 * time.Millisecond, MaxConcurrent: 4}
			d0, d1 := newRestartable(t, cfg), newRestartable(t, cfg)
			a := newActivities(t)
			sc := pipelines.StepContext{RunID: "run-1", StepID: "rollout", BaseDir: t.TempDir(),
				Servers: []pipelines.Server{{URL: d0.URL}, {URL: d1.URL}}, Weights: c.want}
			seed := 5
			in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "prompts.jsonl", promptLines(prompts)...), MaxTokens: 4, Seed: &seed, Concurrency: 8}
			errc := make(chan error, 1)
			var out *GenerateOutput
			go func() {
				var err error
				out, err = a.Generate(context.Background(), in)
				errc <- err
			}()
			waitUntil(t, "30% of the samples", func() bool { return completions(d0, d1) >= prompts*3/10 })
			started := d1.server().StartTime()
			d1.restart()
			err := <-errc
			if c.want == nil {
				require.NoError(t, err)
				assert.Equal(t, WeightCheckStartTime, out.WeightCheck)
				assert.Equal(t, "", out.WeightVersion)
				assert.Len(t, readRollouts(t, out.Path), prompts)
				return
			}
			assert.Equal(t, pipelines.ErrTypeStaleWeights, errType(t, err))
			assert.ErrorContains(t, err, fmt.Sprintf("servers[1] %s restarted (process_start_time_seconds on GET /metrics went from %s to %s): a restarted server serves the weights it started with; the run expects weight version \"1\" (its last sync, /ckpt/1)",
				d1.URL, startTime(float64(started.UnixNano())/1e9), startTime(float64(d1.server().StartTime().UnixNano())/1e9)))
			assert.Equal(t, []int{1}, staleServers(t, err).Indexes)
			fresh := d1.server().Stats()
			kept := keptRows(t, a, in)
			for key := range prompts {
				if fresh.Prompts[fmt.Sprintf("prompt number %d: ", key)] > 0 {
					assert.NotContains(t, kept, key, "p%d, answered by the restarted server, is kept", key)
				}
			}
		})
	}
}

// A server on other weights than the run expects fails the step before
// any sample is requested.
func TestGenerateStaleAtTheStart(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	c, err := vllm.New(d.URL, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c.UpdateWeightVersion(context.Background(), "v0"))
	sc := stepContext(t, "g", d)
	sc.Weights = &pipelines.ExpectedWeights{Version: "v1"}
	_, err = newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(3)...)})
	assert.Equal(t, pipelines.ErrTypeStaleWeights, errType(t, err))
	assert.ErrorContains(t, err, `generate: stale weights on 1 of 1 servers: servers[0] `+d.URL+` serves weight version "v0" on GET /weight_info; the run expects weight version "v1" (type: StaleWeights, retryable: true)`)
	assert.Zero(t, d.Stats().Requests["POST /v1/completions"])
}

// Evaluate goes through the same path: a restart mid-step voids the
// restarted server's score rows, and the step run again after the re-sync
// scores every sample on the run's weights.
func TestEvaluateServerRestartedMidStepIsStale(t *testing.T) {
	const prompts = 150
	cfg := double.Config{DevMode: true, Latency: 10 * time.Millisecond, MaxConcurrent: 4, Seed: 1}
	d0, d1 := newRestartable(t, cfg), newRestartable(t, cfg)
	ckpt := writeCheckpoint(t)
	for _, d := range []*restartable{d0, d1} {
		loadWeights(t, d.URL, ckpt, "v1")
	}
	a := newActivities(t)
	sc := pipelines.StepContext{RunID: "run-1", StepID: "eval", BaseDir: t.TempDir(),
		Servers: []pipelines.Server{{URL: d0.URL}, {URL: d1.URL}}, Weights: &pipelines.ExpectedWeights{Version: "v1", Checkpoint: ckpt}}
	lines := make([]string, prompts)
	for i := range lines {
		lines[i] = fmt.Sprintf(`{"id": "p%d", "prompt": "prompt number %d: ", "answer": "x"}`, i, i)
	}
	seed := 9
	in := EvaluateInput{GenerateInput: GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "eval.jsonl", lines...), MaxTokens: 4, Seed: &seed, Concurrency: 8},
		Scorer: json.RawMessage(`{"type": "contains"}`)}
	errc := make(chan error, 1)
	go func() {
		_, err := a.Evaluate(context.Background(), in)
		errc <- err
	}()
	waitUntil(t, "30% of the samples", func() bool { return completions(d0, d1) >= prompts*3/10 })
	d1.restart()
	err := <-errc
	assert.Equal(t, pipelines.ErrTypeStaleWeights, errType(t, err))
	assert.ErrorContains(t, err, "evaluate: stale weights on 1 of 2 servers: servers[1] "+d1.URL+" ")
	partial := filepath.Join(a.DataDir, "run-1", "iter-0", "eval", "scores.jsonl.partial")
	_, statErr := os.Stat(partial)
	require.NoError(t, statErr, "the partial file stays for the retry")

	loadWeights(t, d1.URL, ckpt, "v1")
	in.Context.Rerun = 1
	out, err := a.Evaluate(context.Background(), in)
	require.NoError(t, err)
	assert.Positive(t, out.Resumed)
	assert.Equal(t, "v1", out.WeightVersion)
	assert.Equal(t, WeightCheckVersion, out.WeightCheck)
	rows := readRollouts(t, out.Path)
	require.Len(t, rows, prompts)
	for i, r := range rows {
		assert.Equal(t, "v1", r.WeightVersion, "row %d", i)
		assert.NotNil(t, r.Score, "row %d", i)
	}
}

// What judge says about a server seen at its last good check (was; nil:
// the attempt's start) and now.
func TestGenerateJudgeMessages(t *testing.T) {
	v := func(version string, start float64) *serverState {
		return &serverState{Version: version, HasVersion: true, StartTime: start, HasStart: start > 0}
	}
	startOnly := func(start float64) *serverState { return &serverState{StartTime: start, HasStart: true} }
	want := &pipelines.ExpectedWeights{Version: "v1", Checkpoint: "/ckpt/1"}
	cases := []struct {
		name     string
		was, now *serverState
		want     *pipelines.ExpectedWeights
		msg      string
	}{
		{"start: expected version", nil, v("v1", 10), want, ""},
		{"start: other version", nil, v("v0", 10), want, `serves weight version "v0" on GET /weight_info; the run expects weight version "v1" (its last sync, /ckpt/1)`},
		{"start: no version yet", nil, v("", 10), want, `serves no weight version, so the weights it started with, on GET /weight_info; the run expects weight version "v1" (its last sync, /ckpt/1)`},
		{"start: no versions at all", nil, startOnly(10), want, ""},
		{"start: no sync yet", nil, v("anything", 10), nil, ""},
		{"unchanged", v("v1", 10), v("v1", 10), want, ""},
		{"restarted", v("v1", 10), v("", 12.5), want, `restarted (process_start_time_seconds on GET /metrics went from 10 to 12.5) and serves no weight version, so the weights it started with, on GET /weight_info; the run expects weight version "v1" (its last sync, /ckpt/1)`},
		{"restarted and re-synced", v("v1", 10), v("v1", 12.5), want, `restarted (process_start_time_seconds on GET /metrics went from 10 to 12.5): a restarted server serves the weights it started with; the run expects weight version "v1" (its last sync, /ckpt/1)`},
		{"restarted, start time only", startOnly(10), startOnly(11), want, `restarted (process_start_time_seconds on GET /metrics went from 10 to 11): a restarted server serves the weights it started with; the run expects weight version "v1" (its last sync, /ckpt/1)`},
		{"no sync: restarted on its start weights", v("", 10), v("", 11), nil, ""},
		{"no sync: restarted, start time only", startOnly(10), startOnly(11), nil, ""},
		{"no sync: version changed", v("", 10), v("v5", 10), nil, `served no weight version, so the weights it started with, at its last good check and weight version "v5" now on GET /weight_info: the weights changed under the step`},
		{"no sync: restarted and version changed", v("v4", 10), v("", 11), nil, `restarted (process_start_time_seconds on GET /metrics went from 10 to 11): it served weight version "v4" at its last good check and no weight version, so the weights it started with, now on GET /weight_info: the weights changed under the step`},
		{"no sync: restarted, same label", v("v4", 10), v("v4", 11), nil, `restarted (process_start_time_seconds on GET /metrics went from 10 to 11) and serves weight version "v4" again: its samples since its last good check may come from the weights it started with`},
		{"version route gone", v("v1", 10), startOnly(10), want, "no longer reports a weight version on GET /weight_info: another server answers at its address"},
		{"metrics gone", v("v1", 10), v("v1", 0), want, "no longer exports process_start_time_seconds on GET /metrics: another server answers at its address"},
		{"no signal", &serverState{}, &serverState{}, want, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.msg, judge(c.was, *c.now, c.want))
		})
	}
}
