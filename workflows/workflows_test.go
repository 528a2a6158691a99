package workflows

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"
)

// behaviour scripts what the fake step activity does for one step id.
type behaviour struct {
	failTimes int    // fail this many attempts first
	failType  string // error type of those failures
	outputs   func(iteration int) map[string]any
	// block makes the step wait until the barrier is released or its
	// context ends (cancellation).
	block *barrier
	// onStart runs when the step starts (e.g. to cancel the run mid-step).
	onStart func()
}

type barrier struct {
	wg sync.WaitGroup
}

// fakeSteps is a test double for every step type: it records calls and
// behaves as scripted per step id.
type fakeSteps struct {
	mu     sync.Mutex
	script map[string]*behaviour
	calls  []string // step ids, one per attempt, in start order
	seen   map[string]map[string]any
	ended  map[string]string // step id -> "ok", "failed", "cancelled"
}

func newFake() *fakeSteps {
	return &fakeSteps{script: map[string]*behaviour{}, seen: map[string]map[string]any{}, ended: map[string]string{}}
}

func (f *fakeSteps) run(ctx context.Context, in map[string]any) (map[string]any, error) {
	sc := in[pipelines.ContextArg].(map[string]any)
	id := sc["step_id"].(string)
	iter := int(sc["iteration"].(float64))
	f.mu.Lock()
	f.calls = append(f.calls, id)
	f.seen[id] = in
	attempt := 0
	for _, c := range f.calls {
		if c == id {
			attempt++
		}
	}
	b := f.script[id]
	f.mu.Unlock()
	end := func(s string) {
		f.mu.Lock()
		f.ended[id] = s
		f.mu.Unlock()
	}
	if b == nil {
		end("ok")
		return map[string]any{"id": id}, nil
	}
	if b.onStart != nil {
		go b.onStart()
	}
	if b.block != nil {
		b.block.wg.Done()
		waited := make(chan struct{})
		go func() { b.block.wg.Wait(); close(waited) }()
		select {
		case <-waited:
		case <-ctx.Done():
			end("cancelled")
			return nil, ctx.Err()
		}
	}
	if attempt <= b.failTimes {
		end("failed")
		return nil, temporal.NewApplicationErrorWithOptions("scripted failure", b.failType, temporal.ApplicationErrorOptions{
			NonRetryable: b.failType == pipelines.ErrTypeBadInput,
			Details:      []any{pipelines.AttemptDetail{Attempt: attempt}},
		})
	}
	end("ok")
	out := map[string]any{pipelines.MetaAttempt: attempt}
	if b.outputs != nil {
		for k, v := range b.outputs(iter) {
			out[k] = v
		}
	}
	return out, nil
}

func (f *fakeSteps) count(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if c == id {
			n++
		}
	}
	return n
}

type suite struct {
	testsuite.WorkflowTestSuite
}

func newEnv(t *testing.T, f *fakeSteps) *testsuite.TestWorkflowEnvironment {
	t.Helper()
	var s suite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterWorkflowWithOptions(RunPipeline, workflow.RegisterOptions{Name: PipelineWorkflow})
	env.RegisterWorkflowWithOptions(RunIteration, workflow.RegisterOptions{Name: IterationWorkflow})
	env.RegisterActivityWithOptions(f.run, activity.RegisterOptions{Name: "step"})
	useStartDoubles(env)
	env.SetTestTimeout(30 * time.Second)
	return env
}

func step(id string, needs ...string) pipelines.Step {
	return pipelines.Step{ID: id, Uses: "step", Needs: needs,
		Retry: &pipelines.RetryPolicy{MaxAttempts: 3, InitialInterval: pipelines.Duration(time.Millisecond)}}
}

func spec(steps ...pipelines.Step) *pipelines.Pipeline {
	return &pipelines.Pipeline{Version: 1, Name: "t", Loop: pipelines.Loop{Iterations: 1}, Steps: steps}
}

func runIteration(t *testing.T, env *testsuite.TestWorkflowEnvironment, p *pipelines.Pipeline) (*IterationResult, error) {
	t.Helper()
	env.ExecuteWorkflow(IterationWorkflow, IterationInput{Spec: p, Iteration: 1, RunID: "run"})
	require.True(t, env.IsWorkflowCompleted())
	var res IterationResult
	err := env.GetWorkflowError()
	if err == nil {
		require.NoError(t, env.GetWorkflowResult(&res))
	}
	return &res, err
}

func statuses(res *IterationResult) map[string]string {
	m := map[string]string{}
	for _, s := range res.Steps {
		m[s.ID] = s.Status
	}
	return m
}

func TestParallelBranchesRunTogether(t *testing.T) {
	f := newFake()
	b := &barrier{}
	b.wg.Add(2) // b and c each wait for the other: a sequential run would deadlock
	f.script["b"] = &behaviour{block: b}
	f.script["c"] = &behaviour{block: b}
	env := newEnv(t, f)
	res, err := runIteration(t, env, spec(step("a"), step("b", "a"), step("c", "a"), step("d", "b", "c")))
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"a": "succeeded", "b": "succeeded", "c": "succeeded", "d": "succeeded"}, statuses(res))
	assert.Equal(t, "a", f.calls[0])
	assert.Equal(t, "d", f.calls[3])
}

func TestMaxParallelBoundsConcurrency(t *testing.T) {
	f := newFake()
	p := spec(step("a"), step("b"), step("c"))
	p.MaxParallel = 1
	env := newEnv(t, f)
	_, err := runIteration(t, env, p)
	require.NoError(t, err)
	assert.Equal(t, []string{"a", "b", "c"}, f.calls, "ties start in file order, one at a time")
}

func TestFailFastCancelsSiblingsAndRunsAlways(t *testing.T) {
	f := newFake()
	never := &barrier{}
	never.wg.Add(2) // released by nobody: c runs until cancelled
	f.script["b"] = &behaviour{failTimes: 9, failType: pipelines.ErrTypeBadInput}
	f.script["c"] = &behaviour{block: never}
	cleanup := step("cleanup", "b", "c")
	cleanup.Always = true
	env := newEnv(t, f)
	res, err := runIteration(t, env, spec(step("a"), step("b", "a"), step("c", "a"), step("d", "b"), cleanup))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "step b (step) failed")
	assert.Contains(t, err.Error(), "scripted failure")
	assert.Equal(t, map[string]string{"a": "succeeded", "b": "failed", "c": "cancelled", "d": "skipped", "cleanup": "succeeded"}, statuses(res0(env, res)))
	assert.Equal(t, 1, f.count("b"), "a non-retryable error is not retried")
	assert.Equal(t, 1, f.count("cleanup"))
}

// res0 fetches the partial result a failed iteration cannot return through
// GetWorkflowResult: from the progress query.
func res0(env *testsuite.TestWorkflowEnvironment, res *IterationResult) *IterationResult {
	if len(res.Steps) > 0 {
		return res
	}
	v, err := env.QueryWorkflow(QueryProgress)
	if err != nil {
		return res
	}
	var p Progress
	if v.Get(&p) != nil {
		return res
	}
	return &IterationResult{Steps: p.Steps}
}

func TestRetriesUntilSuccess(t *testing.T) {
	f := newFake()
	f.script["flaky"] = &behaviour{failTimes: 2, failType: "ExitError"}
	env := newEnv(t, f)
	res, err := runIteration(t, env, spec(step("flaky")))
	require.NoError(t, err)
	assert.Equal(t, 3, f.count("flaky"))
	assert.Equal(t, 3, res.Steps[0].Attempts)
}

func TestRetriesExhausted(t *testing.T) {
	f := newFake()
	f.script["flaky"] = &behaviour{failTimes: 5, failType: "ExitError"}
	env := newEnv(t, f)
	res, err := runIteration(t, env, spec(step("flaky"), step("after", "flaky")))
	require.Error(t, err)
	assert.Equal(t, 3, f.count("flaky"), "max_attempts 3")
	assert.Equal(t, "skipped", statuses(res0(env, res))["after"])
	assert.Equal(t, 3, res0(env, res).Steps[0].Attempts)
}

func TestNonRetryableFromPolicy(t *testing.T) {
	f := newFake()
	f.script["s"] = &behaviour{failTimes: 5, failType: "Fatal"}
	s := step("s")
	s.Retry.NonRetryable = []string{"Fatal"}
	env := newEnv(t, f)
	_, err := runIteration(t, env, spec(s))
	require.Error(t, err)
	assert.Equal(t, 1, f.count("s"))
}

func TestWhenSkipsAndPropagates(t *testing.T) {
	f := newFake()
	f.script["a"] = &behaviour{outputs: func(int) map[string]any { return map[string]any{"score": 0.4} }}
	hi := step("hi", "a")
	hi.When = "${{ steps.a.outputs.score > 0.5 }}"
	lo := step("lo", "a")
	lo.When = "steps.a.outputs.score <= 0.5 && loop.iteration == 1"
	env := newEnv(t, f)
	res, err := runIteration(t, env, spec(step("a"), hi, lo, step("after_hi", "hi")))
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"a": "succeeded", "hi": "skipped", "lo": "succeeded", "after_hi": "skipped"}, statuses(res))
	assert.Equal(t, 0, f.count("hi"))
}

func TestWithIsRenderedFromUpstreamOutputs(t *testing.T) {
	f := newFake()
	f.script["train"] = &behaviour{outputs: func(i int) map[string]any { return map[string]any{"checkpoint": "/ckpt/iter-1"} }}
	sync := step("sync", "train")
	sync.With = map[string]any{"checkpoint": "${{ steps.train.outputs.checkpoint }}", "n": "${{ params.n }}", "label": "it-${{ loop.iteration }}-${{ params.n }}"}
	p := spec(step("train"), sync)
	env := newEnv(t, f)
	env.ExecuteWorkflow(IterationWorkflow, IterationInput{Spec: p, Params: map[string]any{"n": 4}, Iteration: 1, RunID: "run"})
	require.NoError(t, env.GetWorkflowError())
	got := f.seen["sync"]
	assert.Equal(t, "/ckpt/iter-1", got["checkpoint"])
	assert.Equal(t, float64(4), got["n"], "a whole-string expression keeps its type")
	assert.Equal(t, "it-1-4", got["label"])
}

func TestPipelineIterationsAndUntil(t *testing.T) {
	f := newFake()
	f.script["score"] = &behaviour{outputs: func(i int) map[string]any { return map[string]any{"v": i} }}
	p := spec(step("score"))
	p.Loop = pipelines.Loop{Until: "steps.score.outputs.v >= 3", MaxIterations: 10}
	env := newEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p})
	require.NoError(t, env.GetWorkflowError())
	var res PipelineResult
	require.NoError(t, env.GetWorkflowResult(&res))
	assert.Equal(t, 3, res.Iterations)
	assert.Equal(t, "until", res.StoppedBy)
	assert.Equal(t, 3, f.count("score"))
}

func TestPipelineMaxIterations(t *testing.T) {
	f := newFake()
	f.script["score"] = &behaviour{outputs: func(i int) map[string]any { return map[string]any{"v": 0} }}
	p := spec(step("score"))
	p.Loop = pipelines.Loop{Until: "${{ steps.score.outputs.v >= 3 }}", MaxIterations: 4}
	env := newEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p})
	require.NoError(t, env.GetWorkflowError())
	var res PipelineResult
	require.NoError(t, env.GetWorkflowResult(&res))
	assert.Equal(t, PipelineResult{Pipeline: "t", Iterations: 4, StoppedBy: "max_iterations", Recent: res.Recent}, res)
}

func TestPipelineContinuesAsNew(t *testing.T) {
	f := newFake()
	p := spec(step("a"))
	p.Loop = pipelines.Loop{Iterations: 5, ContinueAsNewEvery: 2}
	env := newEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p})
	err := env.GetWorkflowError()
	var can *workflow.ContinueAsNewError
	require.True(t, errors.As(err, &can), "got %v", err)
	assert.Equal(t, PipelineWorkflow, can.WorkflowType.Name)
	assert.Equal(t, 2, f.count("a"))
	var next PipelineInput
	require.NoError(t, decodeArg(can, &next))
	assert.Equal(t, 3, next.NextIteration)
	assert.Len(t, next.Recent, 2)

	// The continued run picks up at iteration 3 and finishes at 5.
	f2 := newFake()
	env2 := newEnv(t, f2)
	env2.SetContinuedExecutionRunID("run-1")
	env2.ExecuteWorkflow(PipelineWorkflow, next)
	err = env2.GetWorkflowError()
	require.True(t, errors.As(err, &can), "iterations 3-4 then continue again: %v", err)
	require.NoError(t, decodeArg(can, &next))
	assert.Equal(t, 5, next.NextIteration)
	env3 := newEnv(t, newFake())
	env3.SetContinuedExecutionRunID("run-2")
	env3.ExecuteWorkflow(PipelineWorkflow, next)
	require.NoError(t, env3.GetWorkflowError())
	var res PipelineResult
	require.NoError(t, env3.GetWorkflowResult(&res))
	assert.Equal(t, 5, res.Iterations)
}

func decodeArg(can *workflow.ContinueAsNewError, out any) error {
	return defaultConverter().FromPayloads(can.Input, out)
}

func TestPipelineFailureNamesStep(t *testing.T) {
	f := newFake()
	f.script["train"] = &behaviour{failTimes: 9, failType: pipelines.ErrTypeBadInput}
	env := newEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: spec(step("gen"), step("train", "gen"))})
	err := env.GetWorkflowError()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "iteration 1: step train (step) failed")
}

func TestIterationPauseResume(t *testing.T) {
	f := newFake()
	env := newEnv(t, f)
	var duringPause int
	env.RegisterDelayedCallback(func() { env.SignalWorkflow(SignalPause, nil) }, 0)
	env.RegisterDelayedCallback(func() {
		duringPause = len(f.calls)
		env.SignalWorkflow(SignalResume, nil)
	}, time.Hour)
	res, err := runIteration(t, env, spec(step("a"), step("b", "a"), step("c", "b")))
	require.NoError(t, err)
	assert.Equal(t, 1, duringPause, "only the step running when the pause arrived ran while paused")
	assert.Equal(t, "succeeded", statuses(res)["c"])
}

func TestPipelinePauseForwardsAndResumes(t *testing.T) {
	f := newFake()
	p := spec(step("a"), step("b", "a"))
	p.Loop.Iterations = 2
	env := newEnv(t, f)
	var duringPause int
	env.RegisterDelayedCallback(func() { env.SignalWorkflow(SignalPause, nil) }, 0)
	env.RegisterDelayedCallback(func() {
		duringPause = len(f.calls)
		v, err := env.QueryWorkflow(QueryProgress)
		require.NoError(t, err)
		var pr Progress
		require.NoError(t, v.Get(&pr))
		assert.True(t, pr.Paused)
		env.SignalWorkflow(SignalResume, nil)
	}, time.Hour)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p})
	require.NoError(t, env.GetWorkflowError())
	assert.Less(t, duringPause, 4, "the pause held the run")
	assert.Equal(t, 4, len(f.calls))
}

func TestCancelRunsAlwaysSteps(t *testing.T) {
	f := newFake()
	never := &barrier{}
	never.wg.Add(2)
	resume := step("resume", "train")
	resume.Always = true
	p := spec(step("pause"), step("train", "pause"), step("eval", "train"), resume)
	env := newEnv(t, f)
	f.script["train"] = &behaviour{block: never, onStart: func() { env.CancelWorkflow() }}
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p})
	err := env.GetWorkflowError()
	require.Error(t, err)
	assert.True(t, temporal.IsCanceledError(err), "got %v", err)
	assert.Equal(t, 1, f.count("resume"), "the always step ran despite cancellation")
	assert.Equal(t, 0, f.count("eval"))
}

func TestActivityOptionsFromYAML(t *testing.T) {
	p := &pipelines.Pipeline{Defaults: pipelines.StepDefaults{
		Timeout: pipelines.Duration(time.Minute), Heartbeat: pipelines.Duration(10 * time.Second), TaskQueue: "q",
		Retry: &pipelines.RetryPolicy{MaxAttempts: 5, InitialInterval: pipelines.Duration(time.Second), Backoff: 2, MaxInterval: pipelines.Duration(time.Minute)},
	}}
	s := &pipelines.Step{ID: "x", Timeout: pipelines.Duration(time.Hour), Retry: &pipelines.RetryPolicy{MaxAttempts: 1, NonRetryable: []string{"E"}}}
	o := activityOptions(p, s)
	assert.Equal(t, time.Hour, o.StartToCloseTimeout)
	assert.Equal(t, 10*time.Second, o.HeartbeatTimeout)
	assert.Equal(t, "q", o.TaskQueue)
	assert.Equal(t, int32(1), o.RetryPolicy.MaximumAttempts)
	assert.Equal(t, []string{"E"}, o.RetryPolicy.NonRetryableErrorTypes)
	o = activityOptions(p, &pipelines.Step{ID: "y"})
	assert.Equal(t, time.Minute, o.StartToCloseTimeout)
	assert.Equal(t, int32(5), o.RetryPolicy.MaximumAttempts)
	assert.Equal(t, 2.0, o.RetryPolicy.BackoffCoefficient)
	o = activityOptions(&pipelines.Pipeline{}, &pipelines.Step{ID: "z"})
	assert.Equal(t, pipelines.DefaultStepTimeout, o.StartToCloseTimeout)
	assert.Equal(t, int32(pipelines.DefaultMaxAttempts), o.RetryPolicy.MaximumAttempts)
}

func defaultConverter() converter.DataConverter { return converter.GetDefaultDataConverter() }

func TestServerURLsRenderedFromParams(t *testing.T) {
	p := spec(step("gen"))
	p.Params = []pipelines.Param{{Name: "vllm", Type: pipelines.ParamString, Default: "http://localhost:8000"}}
	p.Servers = []pipelines.Server{{URL: "${{ params.vllm }}", API: "C"}, {URL: "http://fixed:9000"}}

	f := newFake()
	env := newEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p, Params: map[string]any{"vllm": "http://gpu-node-3:8000"}})
	require.NoError(t, env.GetWorkflowError())
	servers := f.seen["gen"][pipelines.ContextArg].(map[string]any)["servers"].([]any)
	assert.Equal(t, "http://gpu-node-3:8000", servers[0].(map[string]any)["url"])
	assert.Equal(t, "C", servers[0].(map[string]any)["api"])
	assert.Equal(t, "http://fixed:9000", servers[1].(map[string]any)["url"])

	env = newEnv(t, newFake())
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p, Params: map[string]any{"vllm": "gpu-node-3:8000"}})
	err := env.GetWorkflowError()
	require.Error(t, err)
	assert.Contains(t, err.Error(), `params: servers[0].url: URL "gpu-node-3:8000" must start with http:// or https://`)
}
