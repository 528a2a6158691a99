package workflows

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// weightSteps is a test double for the steps that touch the servers'
// weights: it records each call's step id, servers and arguments, and the
// script makes a step fail with StaleWeights naming servers.
type weightSteps struct {
	mu    sync.Mutex
	calls []weightCall
	// stale[stepID] lists, per run of that step, the servers it reports
	// stale (nil: it succeeds).
	stale map[string][][]int
	runs  map[string]int
}

type weightCall struct {
	ID      string
	Uses    string
	Servers []string
	Context pipelines.StepContext
	Args    map[string]any
}

func (w *weightSteps) activity(uses string) func(context.Context, map[string]any) (map[string]any, error) {
	return func(ctx context.Context, in map[string]any) (map[string]any, error) {
		b, _ := json.Marshal(in[pipelines.ContextArg])
		var sc pipelines.StepContext
		if err := json.Unmarshal(b, &sc); err != nil {
			return nil, err
		}
		urls := make([]string, len(sc.Servers))
		for i, s := range sc.Servers {
			urls[i] = s.URL
		}
		w.mu.Lock()
		w.calls = append(w.calls, weightCall{ID: sc.StepID, Uses: uses, Servers: urls, Context: sc, Args: in})
		n := w.runs[sc.StepID]
		w.runs[sc.StepID]++
		var stale []int
		if script := w.stale[sc.StepID]; n < len(script) {
			stale = script[n]
		}
		w.mu.Unlock()
		if stale != nil {
			s := pipelines.StaleServers{Indexes: stale}
			for _, i := range stale {
				s.URLs = append(s.URLs, sc.Servers[i].URL)
			}
			return nil, temporal.NewApplicationErrorWithOptions("server on stale weights", pipelines.ErrTypeStaleWeights,
				temporal.ApplicationErrorOptions{Details: []any{pipelines.AttemptDetail{Attempt: 1}, s}})
		}
		out := map[string]any{pipelines.MetaAttempt: 1}
		if uses == pipelines.StepBroadcast {
			out["version"], out["checkpoint"] = in["version"], in["checkpoint"]
			if out["version"] == nil {
				out["version"] = "run/iter-1"
			}
		}
		return out, nil
	}
}

func (w *weightSteps) ids() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var ids []string
	for _, c := range w.calls {
		ids = append(ids, c.ID)
	}
	return ids
}

func (w *weightSteps) call(id string, nth int) weightCall {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.calls {
		if c.ID == id {
			if nth == 0 {
				return c
			}
			nth--
		}
	}
	return weightCall{}
}

func weightsPipeline(backend string, steps ...pipelines.Step) *pipelines.Pipeline {
	p := spec(steps...)
	p.Servers = []pipelines.Server{{URL: "http://a:8000"}, {URL: "http://b:8000"}}
	p.WeightTransfer = &pipelines.WeightTransfer{Backend: backend}
	return p
}

func uses(id, stepType string, needs ...string) pipelines.Step {
	s := step(id, needs...)
	s.Uses = stepType
	return s
}

func runWeights(t *testing.T, w *weightSteps, in IterationInput) (*IterationResult, error) {
	t.Helper()
	var s suite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterWorkflowWithOptions(RunIteration, workflow.RegisterOptions{Name: IterationWorkflow})
	for _, u := range []string{pipelines.StepGenerate, pipelines.StepEvaluate, pipelines.StepPause, pipelines.StepResume, pipelines.StepBroadcast} {
		env.RegisterActivityWithOptions(w.activity(u), activity.RegisterOptions{Name: u})
	}
	useStartDoubles(env)
	env.SetTestTimeout(30 * time.Second)
	if in.Iteration == 0 {
		in.Iteration = 1
	}
	in.RunID = "run"
	env.ExecuteWorkflow(IterationWorkflow, in)
	require.True(t, env.IsWorkflowCompleted())
	if err := env.GetWorkflowError(); err != nil {
		return nil, err
	}
	var res IterationResult
	require.NoError(t, env.GetWorkflowResult(&res))
	return &res, nil
}

// A generate step that finds a server on stale weights (restarted during
// the step) gets that server re-synced from the run's last broadcast, then
// runs again, resuming: the disk backend reaches the stale server alone.
func TestStaleServerIsResyncedBeforeTheStepRunsAgain(t *testing.T) {
	w := &weightSteps{stale: map[string][][]int{"gen": {{1}}}, runs: map[string]int{}}
	sync := uses("sync", pipelines.StepBroadcast, "pause")
	sync.With = map[string]any{"checkpoint": "/ck/iter-1"}
	p := weightsPipeline(pipelines.BackendDisk,
		uses("pause", pipelines.StepPause), sync, uses("resume", pipelines.StepResume, "sync"), uses("gen", pipelines.StepGenerate, "resume"))
	res, err := runWeights(t, w, IterationInput{Spec: p})
	require.NoError(t, err)
	assert.Equal(t, []string{"pause", "sync", "resume", "gen", "gen/resync-1/pause", "gen/resync-1/broadcast", "gen/resync-1/resume", "gen"}, w.ids())
	assert.True(t, w.call("sync", 0).Context.FleetPaused, "the pipeline's broadcast knows the run paused the fleet")
	want := &pipelines.ExpectedWeights{Version: "run/iter-1", Checkpoint: "/ck/iter-1"}
	assert.Equal(t, want, w.call("gen", 0).Context.Weights)
	b := w.call("gen/resync-1/broadcast", 0)
	assert.Equal(t, []string{"http://b:8000"}, b.Servers, "disk: only the stale server")
	assert.Equal(t, "/ck/iter-1", b.Args["checkpoint"])
	assert.Equal(t, "run/iter-1", b.Args["version"])
	assert.Equal(t, true, b.Args["verify"])
	assert.True(t, b.Context.FleetPaused)
	assert.Equal(t, []string{"http://b:8000"}, w.call("gen/resync-1/resume", 0).Servers)
	rerun := w.call("gen", 1)
	assert.Equal(t, 1, rerun.Context.Rerun, "the re-run resumes the step's partial work")
	assert.Equal(t, []string{"http://a:8000", "http://b:8000"}, rerun.Servers)
	assert.Equal(t, want, res.Weights, "the next iteration expects the same weights")
	for _, s := range res.Steps {
		if s.ID == "gen" {
			assert.Equal(t, StatusSucceeded, s.Status)
			assert.Equal(t, 1, s.Resyncs)
		}
	}
}

// nccl: one group of every server, so a re-sync pauses, loads and resumes
// them all; the expected weights come from an earlier iteration.
func TestResyncWithNCCLReachesTheWholeGroup(t *testing.T) {
	w := &weightSteps{stale: map[string][][]int{"eval": {{0}}}, runs: map[string]int{}}
	p := weightsPipeline(pipelines.BackendNCCL, uses("eval", pipelines.StepEvaluate))
	weights := &pipelines.ExpectedWeights{Version: "run/iter-3", Checkpoint: "/ck/iter-3"}
	_, err := runWeights(t, w, IterationInput{Spec: p, Iteration: 4, Weights: weights})
	require.NoError(t, err)
	assert.Equal(t, []string{"eval", "eval/resync-1/pause", "eval/resync-1/broadcast", "eval/resync-1/resume", "eval"}, w.ids())
	assert.Equal(t, weights, w.call("eval", 0).Context.Weights)
	assert.Len(t, w.call("eval/resync-1/broadcast", 0).Servers, 2)
	assert.Equal(t, "/ck/iter-3", w.call("eval/resync-1/broadcast", 0).Args["checkpoint"])
}

// A broadcast that finds a server unpaused (restarted after the pause)
// gets that server paused again and broadcasts again; the pipeline's own
// resume step follows.
func TestBroadcastToAnUnpausedServerPausesItAndBroadcastsAgain(t *testing.T) {
	w := &weightSteps{stale: map[string][][]int{"sync": {{0}}}, runs: map[string]int{}}
	sync := uses("sync", pipelines.StepBroadcast, "pause")
	sync.With = map[string]any{"checkpoint": "/ck/iter-1"}
	p := weightsPipeline(pipelines.BackendDisk, uses("pause", pipelines.StepPause), sync, uses("resume", pipelines.StepResume, "sync"))
	res, err := runWeights(t, w, IterationInput{Spec: p})
	require.NoError(t, err)
	assert.Equal(t, []string{"pause", "sync", "sync/resync-1/pause", "sync", "resume"}, w.ids())
	assert.Equal(t, []string{"http://a:8000"}, w.call("sync/resync-1/pause", 0).Servers)
	assert.Equal(t, &pipelines.ExpectedWeights{Version: "run/iter-1", Checkpoint: "/ck/iter-1"}, res.Weights)
}

// Without a sync there is nothing to restore, and a server that loses its
// weights at every re-sync is failing: both fail the step, naming it.
func TestStaleWeightsFailWhenNoResyncCanHelp(t *testing.T) {
	t.Run("no sync yet", func(t *testing.T) {
		w := &weightSteps{stale: map[string][][]int{"gen": {{1}}}, runs: map[string]int{}}
		_, err := runWeights(t, w, IterationInput{Spec: weightsPipeline(pipelines.BackendDisk, uses("gen", pipelines.StepGenerate))})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "server on stale weights")
		assert.Equal(t, []string{"gen"}, w.ids(), "StaleWeights is not retried blindly")
	})
	t.Run("stale again after every resync", func(t *testing.T) {
		w := &weightSteps{stale: map[string][][]int{"gen": {{1}, {1}, {1}, {1}, {1}}}, runs: map[string]int{}}
		weights := &pipelines.ExpectedWeights{Version: "v", Checkpoint: "/ck"}
		_, err := runWeights(t, w, IterationInput{Spec: weightsPipeline(pipelines.BackendDisk, uses("gen", pipelines.StepGenerate)), Weights: weights})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "step gen (generate) failed")
		assert.Equal(t, 1+maxResyncs, w.runs["gen"])
	})
}
