package workflows

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"
)

var (
	hostA = GPUHost{TaskQueue: "rlflow-gpu/host-a/1001", Host: "host-a", Device: 0}
	hostB = GPUHost{TaskQueue: "rlflow-gpu/host-b/2002", Host: "host-b", Device: 1}
)

// gpuCall is one execution of a fake activity, as the activity saw it.
type gpuCall struct {
	Step       string
	Iteration  int
	TaskQueue  string
	ActivityID string
}

// fakeGPU stands in for GPU workers: gpu_acquire answers hosts in turn
// (repeating the last), and the GPU step types record which task queue
// they were scheduled on, failing as scripted per step id.
type fakeGPU struct {
	mu       sync.Mutex
	hosts    []GPUHost
	acqErrs  []error // returned by the first acquires, before any host
	acquires []GPUAcquireInput
	acqQueue []string
	calls    []gpuCall
	errs     map[string][]error // per step id, returned by successive calls
	groups   map[string]bool    // task queues that initialised a group
}

func newFakeGPU(hosts ...GPUHost) *fakeGPU {
	return &fakeGPU{hosts: hosts, errs: map[string][]error{}, groups: map[string]bool{}}
}

func (g *fakeGPU) acquire(ctx context.Context, in GPUAcquireInput) (GPUHost, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.acquires = append(g.acquires, in)
	g.acqQueue = append(g.acqQueue, activity.GetInfo(ctx).TaskQueue)
	if len(g.acqErrs) > 0 {
		err := g.acqErrs[0]
		g.acqErrs = g.acqErrs[1:]
		return GPUHost{}, err
	}
	h := g.hosts[0]
	if len(g.hosts) > 1 {
		g.hosts = g.hosts[1:]
	}
	return h, nil
}

func (g *fakeGPU) step(ctx context.Context, in map[string]any) (map[string]any, error) {
	sc := in[pipelines.ContextArg].(map[string]any)
	info := activity.GetInfo(ctx)
	call := gpuCall{Step: sc["step_id"].(string), Iteration: int(sc["iteration"].(float64)), TaskQueue: info.TaskQueue, ActivityID: info.ActivityID}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.calls = append(g.calls, call)
	if errs := g.errs[call.Step]; len(errs) > 0 {
		g.errs[call.Step] = errs[1:]
		return nil, errs[0]
	}
	// Like the real broadcast: a group is initialised once per worker.
	initialized := !g.groups[info.TaskQueue]
	g.groups[info.TaskQueue] = true
	return map[string]any{"initialized": initialized, pipelines.MetaAttempt: info.Attempt}, nil
}

func (g *fakeGPU) queuesOf(step string) []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	var qs []string
	for _, c := range g.calls {
		if c.Step == step {
			qs = append(qs, c.TaskQueue)
		}
	}
	return qs
}

func newGPUEnv(t *testing.T, f *fakeSteps, g *fakeGPU) *testsuite.TestWorkflowEnvironment {
	t.Helper()
	env := newEnv(t, f)
	env.RegisterActivityWithOptions(g.acquire, activity.RegisterOptions{Name: AcquireGPUActivity})
	// One function per name: the SDK's registry also keys activities by
	// function name, so one function under two names would collide.
	initTransfer := func(ctx context.Context, in map[string]any) (map[string]any, error) { return g.step(ctx, in) }
	broadcast := func(ctx context.Context, in map[string]any) (map[string]any, error) { return g.step(ctx, in) }
	env.RegisterActivityWithOptions(initTransfer, activity.RegisterOptions{Name: pipelines.StepInitTransfer})
	env.RegisterActivityWithOptions(broadcast, activity.RegisterOptions{Name: pipelines.StepBroadcast})
	return env
}

// ncclSpec: gen -> init (init_transfer) -> sync (broadcast) -> resume
// (always), the shape of a real RLHF iteration; gen and resume are
// control steps.
func ncclSpec() *pipelines.Pipeline {
	retry := &pipelines.RetryPolicy{MaxAttempts: 3, InitialInterval: pipelines.Duration(time.Millisecond)}
	resume := step("resume", "sync")
	resume.Always = true
	p := spec(
		step("gen"),
		pipelines.Step{ID: "init", Uses: pipelines.StepInitTransfer, Needs: []string{"gen"}, Retry: retry},
		pipelines.Step{ID: "sync", Uses: pipelines.StepBroadcast, Needs: []string{"init"}, Retry: retry,
			With: map[string]any{"checkpoint": "/ckpt/iter-${{ loop.iteration }}"}},
		resume,
	)
	p.WeightTransfer = &pipelines.WeightTransfer{Backend: pipelines.BackendNCCL}
	return p
}

func stepByID(res *IterationResult, id string) StepResult {
	for _, s := range res.Steps {
		if s.ID == id {
			return s
		}
	}
	return StepResult{}
}

func TestGPUStepsRunOnTheAcquiredQueue(t *testing.T) {
	for _, tc := range []struct {
		name      string
		override  string
		wantQueue string
	}{
		{"default GPU queue", "", pipelines.DefaultGPUTaskQueue},
		{"pipeline override", "trainer-a-gpu", "trainer-a-gpu"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, g := newFake(), newFakeGPU(hostA)
			p := ncclSpec()
			p.WeightTransfer.GPUTaskQueue = tc.override
			env := newGPUEnv(t, f, g)
			res, err := runIteration(t, env, p)
			require.NoError(t, err)
			assert.Equal(t, []string{tc.wantQueue}, g.acqQueue, "one acquire, on the shared GPU queue")
			assert.Equal(t, []string{hostA.TaskQueue}, g.queuesOf("init"))
			assert.Equal(t, []string{hostA.TaskQueue}, g.queuesOf("sync"))
			assert.Equal(t, []string{"init/attempt-1", "sync/attempt-1"}, []string{g.calls[0].ActivityID, g.calls[1].ActivityID})
			// Control steps stay on the workflow's queue.
			assert.Equal(t, []string{"gen", "resume"}, f.calls)
			assert.Equal(t, &hostA, stepByID(res, "sync").GPUHost)
			assert.Nil(t, stepByID(res, "gen").GPUHost)
			assert.Equal(t, 1, stepByID(res, "sync").Attempts)
			assert.Equal(t, &hostA, res.GPUHost, "handed to the next iteration")
		})
	}
}

func TestGPUActivityOptions(t *testing.T) {
	base := activityOptions(&pipelines.Pipeline{}, &pipelines.Step{ID: "sync", Retry: &pipelines.RetryPolicy{MaxAttempts: 4}})
	o := gpuActivityOptions(base, "sync", 2, hostB, 45*time.Second)
	assert.Equal(t, hostB.TaskQueue, o.TaskQueue)
	assert.Equal(t, 45*time.Second, o.ScheduleToStartTimeout, "a dead worker's queue is noticed, not waited on forever")
	assert.Equal(t, "sync/attempt-2", o.ActivityID)
	assert.Equal(t, int32(1), o.RetryPolicy.MaximumAttempts, "the interpreter retries, possibly elsewhere")
	assert.Equal(t, DefaultGPUHeartbeat, o.HeartbeatTimeout, "a worker dying mid-step is noticed")
	assert.Equal(t, pipelines.DefaultStepTimeout, o.StartToCloseTimeout)
	assert.Equal(t, int32(4), base.RetryPolicy.MaximumAttempts, "the base options are not modified")

	base.HeartbeatTimeout = 5 * time.Second
	assert.Equal(t, 5*time.Second, gpuActivityOptions(base, "sync", 1, hostA, time.Second).HeartbeatTimeout, "the step's own heartbeat wins")
	base.HeartbeatTimeout, base.StartToCloseTimeout = 0, 10*time.Second
	assert.Zero(t, gpuActivityOptions(base, "sync", 1, hostA, time.Second).HeartbeatTimeout, "no heartbeat longer than the attempt")
}

func TestGPUStartTimeoutFromPipeline(t *testing.T) {
	env := newEnv(t, newFake())
	p := ncclSpec()
	p.WeightTransfer.GPUStartTimeout = pipelines.Duration(90 * time.Second)
	var got *gpuRouting
	env.RegisterWorkflowWithOptions(func(ctx workflow.Context, in IterationInput) error {
		got = newGPURouting(ctx, in)
		return nil
	}, workflow.RegisterOptions{Name: "probe"})
	env.ExecuteWorkflow("probe", IterationInput{Spec: p, GPUHost: &hostB})
	require.NoError(t, env.GetWorkflowError())
	require.NotNil(t, got)
	assert.Equal(t, 90*time.Second, got.startTimeout)
	assert.Equal(t, pipelines.DefaultGPUTaskQueue, got.queue)
	assert.Equal(t, &hostB, got.host, "a host from the input is used, not re-acquired")
}

func TestGPUHostReusedAcrossIterations(t *testing.T) {
	f, g := newFake(), newFakeGPU(hostA, hostB)
	p := ncclSpec()
	p.Loop = pipelines.Loop{Iterations: 3, ContinueAsNewEvery: 2}
	env := newGPUEnv(t, f, g)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: p})
	var can *workflow.ContinueAsNewError
	require.True(t, errors.As(env.GetWorkflowError(), &can), "got %v", env.GetWorkflowError())
	assert.Len(t, g.acquires, 1, "iteration 2 reused iteration 1's worker")
	assert.Equal(t, []string{hostA.TaskQueue, hostA.TaskQueue}, g.queuesOf("sync"))
	var next PipelineInput
	require.NoError(t, decodeArg(can, &next))
	assert.Equal(t, &hostA, next.GPUHost, "carried across continue-as-new")

	// The continued run (iteration 3) starts on the same worker.
	g2 := newFakeGPU(hostB)
	g2.groups[hostA.TaskQueue] = true // the worker kept its group
	env2 := newGPUEnv(t, newFake(), g2)
	env2.SetContinuedExecutionRunID("run-1")
	env2.ExecuteWorkflow(PipelineWorkflow, next)
	require.NoError(t, env2.GetWorkflowError())
	assert.Empty(t, g2.acquires)
	assert.Equal(t, []string{hostA.TaskQueue}, g2.queuesOf("sync"))
	v, err := env2.QueryWorkflow(QueryProgress)
	require.NoError(t, err)
	var pr Progress
	require.NoError(t, v.Get(&pr))
	assert.Equal(t, &hostA, pr.GPUHost)
}

func TestGPUWorkerLostMovesToAnotherWorker(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"nobody polls the host queue", temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)},
		{"heartbeat timeout", temporal.NewHeartbeatTimeoutError()},
		{"activity reports its worker lost", temporal.NewApplicationError("communicator aborted: device lost", pipelines.ErrTypeGPUWorkerLost)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, g := newFake(), newFakeGPU(hostA, hostB)
			g.errs["sync"] = []error{tc.err}
			env := newGPUEnv(t, f, g)
			res, err := runIteration(t, env, ncclSpec())
			require.NoError(t, err, "the loss does not fail the iteration")
			assert.Equal(t, []string{hostA.TaskQueue, hostB.TaskQueue}, g.queuesOf("sync"))
			assert.Equal(t, []string{hostA.TaskQueue}, g.queuesOf("init"), "init is not redone: broadcast re-initialises")
			require.Len(t, g.acquires, 2)
			assert.Equal(t, GPUAcquireInput{RunID: "run", Lost: hostA.TaskQueue}, g.acquires[1])
			sync := stepByID(res, "sync")
			assert.Equal(t, StatusSucceeded, sync.Status)
			assert.Equal(t, 2, sync.Attempts, "the lost attempt counts")
			assert.Equal(t, true, sync.Outputs["initialized"], "the new worker initialised its own group")
			assert.Equal(t, &hostB, sync.GPUHost)
			assert.Equal(t, &hostB, res.GPUHost)
			assert.Equal(t, "sync/attempt-2", g.calls[len(g.calls)-1].ActivityID)
		})
	}
}

func TestGPUWorkerLostExhaustsAttempts(t *testing.T) {
	f, g := newFake(), newFakeGPU(hostA, hostB)
	lost := temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	g.errs["sync"] = []error{lost, lost, lost}
	p := ncclSpec()
	p.Steps[2].Retry.MaxAttempts = 2
	env := newGPUEnv(t, f, g)
	res, err := runIteration(t, env, p)
	require.Error(t, err)
	assert.Equal(t, []string{hostA.TaskQueue, hostB.TaskQueue}, g.queuesOf("sync"), "max_attempts 2 counts lost attempts")
	assert.Len(t, g.acquires, 2, "no acquire after the last attempt")
	assert.Contains(t, err.Error(), "step sync (broadcast) failed: GPU worker host-b (task queue rlflow-gpu/host-b/2002) lost (nobody polled its task queue) on attempt 2 of 2")
	r := res0(env, res)
	assert.Equal(t, StatusSucceeded, stepByID(r, "resume").Status, "always steps still run")
	assert.Equal(t, 2, stepByID(r, "sync").Attempts)
}

func TestGPUStepErrorsThatAreNotALoss(t *testing.T) {
	for _, tc := range []struct {
		name      string
		errs      []error
		wantErr   string
		wantCalls int
	}{
		{"bad input fails at once", []error{temporal.NewNonRetryableApplicationError("checkpoint missing", pipelines.ErrTypeBadInput, nil)}, "checkpoint missing", 1},
		{"policy non-retryable type", []error{temporal.NewApplicationError("nope", "Fatal")}, "nope", 1},
		{"retryable error retries on the same worker", []error{temporal.NewApplicationError("store hiccup", "IOError")}, "", 2},
		{"start-to-close timeout retries on the same worker", []error{temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)}, "", 2},
		{"retries exhausted", []error{
			temporal.NewApplicationError("e1", "IOError"), temporal.NewApplicationError("e2", "IOError"), temporal.NewApplicationError("e3", "IOError"),
		}, "e3", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, g := newFake(), newFakeGPU(hostA, hostB)
			g.errs["sync"] = tc.errs
			p := ncclSpec()
			p.Steps[2].Retry.NonRetryable = []string{"Fatal"}
			env := newGPUEnv(t, f, g)
			res, err := runIteration(t, env, p)
			if tc.wantErr == "" {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "step sync (broadcast) failed: "+tc.wantErr)
			}
			assert.Len(t, g.acquires, 1, "never re-acquired")
			assert.Equal(t, strings.Repeat(hostA.TaskQueue+",", tc.wantCalls), strings.Join(g.queuesOf("sync"), ",")+",")
			r := res0(env, res)
			assert.Equal(t, tc.wantCalls, stepByID(r, "sync").Attempts)
			assert.Equal(t, &hostA, stepByID(r, "sync").GPUHost)
		})
	}
}

func TestGPURoutingOffWithoutNCCL(t *testing.T) {
	for _, tc := range []struct {
		name string
		wt   *pipelines.WeightTransfer
	}{
		{"disk backend", &pipelines.WeightTransfer{Backend: "disk"}},
		{"no weight_transfer", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, g := newFake(), newFakeGPU(hostA)
			p := ncclSpec()
			p.WeightTransfer = tc.wt
			env := newGPUEnv(t, f, g)
			res, err := runIteration(t, env, p)
			require.NoError(t, err)
			assert.Empty(t, g.acquires)
			for _, c := range g.calls {
				assert.NotEqual(t, hostA.TaskQueue, c.TaskQueue)
				assert.Equal(t, c.Step, c.ActivityID, "the step's usual activity id")
			}
			assert.Len(t, g.calls, 2)
			assert.Nil(t, stepByID(res, "sync").GPUHost)
			assert.Nil(t, res.GPUHost)
		})
	}
}

func TestGPUAcquireWaitsForAWorker(t *testing.T) {
	noWorker := temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	t.Run("a worker comes up", func(t *testing.T) {
		g := newFakeGPU(hostA)
		g.acqErrs = []error{noWorker, noWorker}
		env := newGPUEnv(t, newFake(), g)
		res, err := runIteration(t, env, ncclSpec())
		require.NoError(t, err)
		assert.Len(t, g.acquires, 3)
		assert.Equal(t, &hostA, res.GPUHost)
	})
	t.Run("none does", func(t *testing.T) {
		g := newFakeGPU(hostA)
		for range GPUAcquireAttempts {
			g.acqErrs = append(g.acqErrs, noWorker)
		}
		env := newGPUEnv(t, newFake(), g)
		_, err := runIteration(t, env, ncclSpec())
		require.Error(t, err)
		assert.Contains(t, err.Error(), "step init (init_transfer) failed: no GPU worker polled task queue rlflow-gpu within 15m0s")
		assert.Len(t, g.acquires, GPUAcquireAttempts)
		assert.Empty(t, g.calls)
	})
	t.Run("acquire itself fails", func(t *testing.T) {
		g := newFakeGPU(hostA)
		g.acqErrs = []error{temporal.NewNonRetryableApplicationError("nvml: no devices", pipelines.ErrTypeBadInput, nil)}
		env := newGPUEnv(t, newFake(), g)
		_, err := runIteration(t, env, ncclSpec())
		require.Error(t, err)
		assert.Contains(t, err.Error(), "acquiring a GPU worker on task queue rlflow-gpu: nvml: no devices")
	})
}

func TestParallelGPUStepsShareOneAcquire(t *testing.T) {
	g := newFakeGPU(hostA, hostB)
	p := ncclSpec()
	p.Steps = []pipelines.Step{
		step("gen"),
		{ID: "sync1", Uses: pipelines.StepBroadcast, Needs: []string{"gen"}, With: map[string]any{"checkpoint": "/a"}},
		{ID: "sync2", Uses: pipelines.StepBroadcast, Needs: []string{"gen"}, With: map[string]any{"checkpoint": "/b"}},
	}
	env := newGPUEnv(t, newFake(), g)
	_, err := runIteration(t, env, p)
	require.NoError(t, err)
	assert.Len(t, g.acquires, 1)
	assert.Equal(t, []string{hostA.TaskQueue}, g.queuesOf("sync1"))
	assert.Equal(t, []string{hostA.TaskQueue}, g.queuesOf("sync2"))
}

func TestGPUProgressShowsHost(t *testing.T) {
	g := newFakeGPU(hostA, hostB)
	g.errs["sync"] = []error{temporal.NewHeartbeatTimeoutError()}
	env := newGPUEnv(t, newFake(), g)
	_, err := runIteration(t, env, ncclSpec())
	require.NoError(t, err)
	v, err := env.QueryWorkflow(QueryProgress)
	require.NoError(t, err)
	var pr Progress
	require.NoError(t, v.Get(&pr))
	got := map[string]*GPUHost{}
	for _, s := range pr.Steps {
		got[s.ID] = s.GPUHost
	}
	assert.Equal(t, map[string]*GPUHost{"gen": nil, "init": &hostA, "sync": &hostB, "resume": nil}, got)
	assert.Equal(t, &hostB, pr.GPUHost)
}

func TestBackoffFollowsTemporalRules(t *testing.T) {
	for _, tc := range []struct {
		rp      temporal.RetryPolicy
		attempt int
		want    time.Duration
	}{
		{temporal.RetryPolicy{}, 1, time.Second},
		{temporal.RetryPolicy{}, 3, 4 * time.Second},
		{temporal.RetryPolicy{}, 20, 100 * time.Second},
		{temporal.RetryPolicy{InitialInterval: 100 * time.Millisecond, BackoffCoefficient: 3}, 3, 900 * time.Millisecond},
		{temporal.RetryPolicy{InitialInterval: time.Second, BackoffCoefficient: 2, MaximumInterval: 5 * time.Second}, 4, 5 * time.Second},
	} {
		assert.Equal(t, tc.want, backoff(&tc.rp, tc.attempt), "%+v attempt %d", tc.rp, tc.attempt)
	}
}

func TestRoutedStepID(t *testing.T) {
	for id, want := range map[string]string{"sync/attempt-1": "sync", "sync/attempt-12": "sync", "sync": "", "sync/attempt-": "", "sync/attempt-x": ""} {
		got, ok := RoutedStepID(id)
		assert.Equal(t, want != "", ok, id)
		assert.Equal(t, want, got, id)
	}
	o := gpuActivityOptions(workflow.ActivityOptions{RetryPolicy: &temporal.RetryPolicy{}}, "sync", 3, hostA, time.Second)
	step, ok := RoutedStepID(o.ActivityID)
	assert.True(t, ok)
	assert.Equal(t, "sync", step)
}

func TestCancelWhileWaitingForAGPUWorker(t *testing.T) {
	f, g := newFake(), newFakeGPU(hostA)
	env := newEnv(t, f)
	// No GPU worker: the acquire waits on the queue until the run is cancelled.
	env.RegisterActivityWithOptions(func(ctx context.Context, in GPUAcquireInput) (GPUHost, error) {
		go env.CancelWorkflow()
		<-ctx.Done()
		return GPUHost{}, ctx.Err()
	}, activity.RegisterOptions{Name: AcquireGPUActivity})
	broadcast := func(ctx context.Context, in map[string]any) (map[string]any, error) { return g.step(ctx, in) }
	env.RegisterActivityWithOptions(broadcast, activity.RegisterOptions{Name: pipelines.StepBroadcast})
	p := ncclSpec()
	p.Steps = slices.Delete(p.Steps, 1, 2) // gen -> sync -> resume (always)
	p.Steps[1].Needs = []string{"gen"}
	env.ExecuteWorkflow(IterationWorkflow, IterationInput{Spec: p, Iteration: 1, RunID: "run"})
	err := env.GetWorkflowError()
	require.Error(t, err)
	assert.True(t, temporal.IsCanceledError(err), "got %v", err)
	assert.Empty(t, g.calls, "sync never ran")
	assert.Equal(t, []string{"gen", "resume"}, f.calls, "the always step ran")
	r := res0(env, &IterationResult{})
	assert.Equal(t, StatusCancelled, stepByID(r, "sync").Status)
}

func TestGPUWorkerLostErrorNamesTheCause(t *testing.T) {
	g := newFakeGPU(hostA, hostB)
	g.errs["sync"] = []error{temporal.NewApplicationError("communicator aborted: device lost", pipelines.ErrTypeGPUWorkerLost)}
	p := ncclSpec()
	p.Steps[2].Retry.MaxAttempts = 1
	env := newGPUEnv(t, newFake(), g)
	_, err := runIteration(t, env, p)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "GPU worker host-a (task queue rlflow-gpu/host-a/1001) lost (the activity reported it) on attempt 1 of 1: communicator aborted: device lost")
	assert.Len(t, g.acquires, 1)
}

// The interpreter's own retries (GPU steps) honour retry.non_retryable as
// Temporal does, the timeout names included.
func TestRetryableAppliesNonRetryableNames(t *testing.T) {
	startToClose := temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)
	heartbeat := temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_HEARTBEAT, nil)
	scheduleToStart := temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	nccl := temporal.NewApplicationError("lost", pipelines.ErrTypeNCCL)
	for _, tc := range []struct {
		name         string
		err          error
		nonRetryable []string
		want         bool
	}{
		{"start-to-close", startToClose, nil, true},
		{"start-to-close named", startToClose, []string{pipelines.ErrTypeStartToCloseTimeout}, false},
		{"heartbeat", heartbeat, []string{pipelines.ErrTypeStartToCloseTimeout}, true},
		{"heartbeat named", heartbeat, []string{pipelines.ErrTypeHeartbeatTimeout}, false},
		{"schedule-to-start", scheduleToStart, nil, false},
		{"application", nccl, nil, true},
		{"application named", nccl, []string{pipelines.ErrTypeNCCL}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, retryable(tc.err, &temporal.RetryPolicy{NonRetryableErrorTypes: tc.nonRetryable}))
		})
	}
}
