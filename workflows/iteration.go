package workflows

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// stepRun is the interpreter's state for one step.
type stepRun struct {
	step   *pipelines.Step
	result StepResult
	future workflow.Future
	cancel workflow.CancelFunc
	// gpu marks a step routed to a GPU worker; attempts is then the
	// interpreter's own attempt count (see runGPU).
	gpu      bool
	attempts int
	// What the step was started with, for a re-run after a re-sync.
	args   map[string]any
	opts   workflow.ActivityOptions
	actCtx workflow.Context
	// resyncs counts the re-syncs this step's StaleWeights errors caused.
	resyncs int
	// started is when the step started (workflow time), for its duration.
	started time.Time
}

// RunIteration runs one pass over the pipeline's DAG. It fails with the first
// real step error (naming the step) once every started step and every
// `always` step has finished. Cancellation cancels running steps, still runs
// `always` steps, and ends the workflow cancelled.
func RunIteration(ctx workflow.Context, in IterationInput) (*IterationResult, error) {
	// Its spec is trusted because rlflow.Pipeline validated it; started
	// any other way (the UI, a client), it would run an unchecked one.
	if workflow.GetInfo(ctx).ParentWorkflowExecution == nil {
		return nil, temporal.NewNonRetryableApplicationError(IterationWorkflow+" runs only as a child of "+PipelineWorkflow+"; start "+PipelineWorkflow, pipelines.ErrTypeBadInput, nil)
	}
	if in.Spec == nil {
		return nil, temporal.NewNonRetryableApplicationError("iteration input has no spec", pipelines.ErrTypeBadInput, nil)
	}
	// The params arrive through JSON, an int as a float64: expressions
	// must see each in its declared type (`x % params.n` takes an int).
	in.Params = in.Spec.TypedParams(in.Params)
	servers, err := in.Spec.ServersFor(in.Params)
	if err != nil {
		return nil, temporal.NewNonRetryableApplicationError(err.Error(), pipelines.ErrTypeBadInput, nil)
	}
	it := &interpreter{in: in, paused: in.Paused, servers: servers, gpu: newGPURouting(ctx, in), weights: in.Weights}
	for i := range in.Spec.Steps {
		s := &in.Spec.Steps[i]
		it.order = append(it.order, s.ID)
		it.runs = append(it.runs, &stepRun{step: s, result: StepResult{ID: s.ID, Uses: s.Uses, Status: StatusPending}})
	}
	if err := workflow.SetQueryHandler(ctx, QueryProgress, it.progress); err != nil {
		return nil, err
	}
	return it.run(ctx)
}

type interpreter struct {
	in        IterationInput
	order     []string
	runs      []*stepRun
	paused    bool
	failed    error // first real step failure
	cancelled bool
	running   int
	gpu       *gpuRouting        // nil: no GPU routing (disk backend, or recorded before it)
	servers   []pipelines.Server // URLs rendered from the params
	// weights are what the servers should serve: the last successful
	// broadcast's (this iteration's or an earlier one's); nil before any.
	weights *pipelines.ExpectedWeights
	// fleetPaused: a pause step succeeded and no resume step since.
	fleetPaused bool
	// vllm is what the steps learned of the servers (MetaVLLM).
	vllm []pipelines.VLLMServer
}

func (it *interpreter) byID(id string) *stepRun {
	for _, r := range it.runs {
		if r.step.ID == id {
			return r
		}
	}
	return nil
}

func (it *interpreter) progress() (Progress, error) {
	p := Progress{Pipeline: it.in.Spec.Name, Iteration: it.in.Iteration, Paused: it.paused, Status: StatusRunning}
	for _, r := range it.runs {
		p.Steps = append(p.Steps, r.result)
	}
	if it.failed != nil {
		p.LastError = it.failed.Error()
	}
	p.GPUHost = it.gpuHost()
	return p, nil
}

func terminal(status string) bool {
	switch status {
	case StatusSucceeded, StatusFailed, StatusSkipped, StatusCancelled:
		return true
	}
	return false
}

func (it *interpreter) env() pipelines.Env {
	steps := make(map[string]pipelines.StepState, len(it.runs))
	for _, r := range it.runs {
		if terminal(r.result.Status) {
			steps[r.step.ID] = pipelines.StepState{Status: r.result.Status, Outputs: r.result.Outputs}
		}
	}
	return pipelines.Env{Params: it.in.Params, Steps: steps, Iteration: it.in.Iteration}
}

func (it *interpreter) run(ctx workflow.Context) (*IterationResult, error) {
	pauseCh := workflow.GetSignalChannel(ctx, SignalPause)
	resumeCh := workflow.GetSignalChannel(ctx, SignalResume)
	// Steps run in a context we cancel ourselves on fail-fast; `always` steps
	// run in a disconnected one so that neither fail-fast nor workflow
	// cancellation stops them (they resume vLLM, clean up).
	stepsCtx, cancelSteps := workflow.WithCancel(ctx)
	defer cancelSteps()
	alwaysCtx, cancelAlways := workflow.NewDisconnectedContext(ctx)
	defer cancelAlways()

	for {
		if !it.cancelled && ctx.Err() != nil {
			it.cancelled = true
			cancelSteps()
		}
		it.schedule(ctx, stepsCtx, alwaysCtx)
		if it.running == 0 {
			break
		}
		it.publish(ctx, "")
		sel := workflow.NewSelector(ctx)
		for _, r := range it.runs {
			if r.future == nil || r.result.Status != StatusRunning {
				continue
			}
			r := r
			sel.AddFuture(r.future, func(f workflow.Future) { it.finish(ctx, r, f) })
		}
		sel.AddReceive(pauseCh, func(c workflow.ReceiveChannel, _ bool) { c.Receive(ctx, nil); it.paused = true })
		sel.AddReceive(resumeCh, func(c workflow.ReceiveChannel, _ bool) { c.Receive(ctx, nil); it.paused = false })
		if !it.cancelled {
			sel.AddReceive(ctx.Done(), func(workflow.ReceiveChannel, bool) {})
		}
		sel.Select(ctx)
		if it.failed != nil {
			cancelSteps() // fail-fast: running siblings are cancelled
		}
		if it.running == 0 && it.paused && !it.cancelled && it.failed == nil && it.pendingCount() > 0 {
			// Paused between steps: wait for resume or cancellation.
			it.publish(ctx, "")
			it.waitWhilePaused(ctx, pauseCh, resumeCh)
		}
	}
	res := &IterationResult{Iteration: it.in.Iteration, GPUHost: it.gpuHost(), Weights: it.weights, VLLM: it.vllm}
	for _, r := range it.runs {
		res.Steps = append(res.Steps, r.result)
	}
	if it.cancelled {
		it.publish(ctx, RunCanceled)
		return res, temporal.NewCanceledError("iteration cancelled")
	}
	if it.failed != nil {
		it.publish(ctx, RunFailed)
		return res, it.failed
	}
	it.publish(ctx, RunCompleted)
	return res, nil
}

// publish sets the iteration's current details; status "" is its live
// state, Running or Paused.
func (it *interpreter) publish(ctx workflow.Context, status string) {
	if status == "" {
		status = RunRunning
		if it.paused {
			status = RunPaused
		}
	}
	workflow.SetCurrentDetails(ctx, iterationDetails(it.in.Spec, it.in.Iteration, status, it.runs, it.vllm))
}

func (it *interpreter) pendingCount() int {
	n := 0
	for _, r := range it.runs {
		if r.result.Status == StatusPending {
			n++
		}
	}
	return n
}

func (it *interpreter) waitWhilePaused(ctx workflow.Context, pauseCh, resumeCh workflow.ReceiveChannel) {
	for it.paused && ctx.Err() == nil {
		sel := workflow.NewSelector(ctx)
		sel.AddReceive(pauseCh, func(c workflow.ReceiveChannel, _ bool) { c.Receive(ctx, nil) })
		sel.AddReceive(resumeCh, func(c workflow.ReceiveChannel, _ bool) { c.Receive(ctx, nil); it.paused = false })
		sel.AddReceive(ctx.Done(), func(workflow.ReceiveChannel, bool) {})
		sel.Select(ctx)
	}
	if ctx.Err() != nil {
		it.cancelled = true
	}
}

// schedule starts every step that is ready, in file order, within
// max_parallel, and settles steps that can never run.
func (it *interpreter) schedule(ctx, stepsCtx, alwaysCtx workflow.Context) {
	stopping := it.failed != nil || it.cancelled
	for changed := true; changed; {
		changed = false
		for _, r := range it.runs {
			if r.result.Status != StatusPending {
				continue
			}
			ready, allOK, why := it.needsState(r.step)
			if !ready {
				continue
			}
			if stopping && !r.step.Always {
				r.result.Status, r.result.Reason = StatusSkipped, stopReason(it)
				changed = true
				continue
			}
			if !allOK && !r.step.Always {
				r.result.Status, r.result.Reason = StatusSkipped, why
				changed = true
				continue
			}
			if it.paused && !stopping {
				continue
			}
			if max := it.in.Spec.MaxParallel; max > 0 && it.running >= max {
				continue
			}
			env := it.env()
			if r.step.When != "" {
				ok, err := pipelines.EvalCondition(r.step.When, env)
				if err != nil {
					it.fail(r, fmt.Errorf("when: %w", err))
					changed, stopping = true, true
					continue
				}
				if !ok {
					r.result.Status, r.result.Reason = StatusSkipped, "when is false"
					changed = true
					continue
				}
			}
			actCtx := stepsCtx
			if r.step.Always {
				actCtx = alwaysCtx
			}
			if err := it.start(ctx, actCtx, r, env); err != nil {
				it.fail(r, err)
				changed, stopping = true, true
				continue
			}
			changed = true
		}
	}
}

func stopReason(it *interpreter) string {
	if it.cancelled {
		return "run cancelled"
	}
	return "an earlier step failed"
}

// needsState reports whether every need is terminal, whether all of them
// succeeded, and if not, why.
func (it *interpreter) needsState(s *pipelines.Step) (ready, allOK bool, why string) {
	allOK = true
	for _, n := range s.Needs {
		r := it.byID(n)
		if r == nil {
			return false, false, "" // Load rejects this; never start such a step
		}
		if !terminal(r.result.Status) {
			return false, false, ""
		}
		if r.result.Status != StatusSucceeded && allOK {
			allOK, why = false, fmt.Sprintf("needs %s, which %s", n, r.result.Status)
		}
	}
	return true, allOK, why
}

func (it *interpreter) fail(r *stepRun, err error) {
	r.result.Status = StatusFailed
	r.result.Error = err.Error()
	if it.failed == nil {
		it.failed = temporal.NewNonRetryableApplicationError(
			fmt.Sprintf("iteration %d: step %s (%s) failed: %s", it.in.Iteration, r.step.ID, r.step.Uses, err.Error()),
			pipelines.ErrTypeStepFailed, nil)
	}
}

func (it *interpreter) start(ctx, actCtx workflow.Context, r *stepRun, env pipelines.Env) error {
	s := r.step
	args := map[string]any{}
	if len(s.With) > 0 {
		rendered, err := pipelines.Render(s.With, env)
		if err != nil {
			return fmt.Errorf("with: %w", err)
		}
		args = rendered.(map[string]any)
		pipelines.CoerceArgs(s.Uses, args)
	}
	spec := it.in.Spec
	args[pipelines.ContextArg] = it.stepContext(s, it.servers)
	opts := activityOptions(spec, s)
	r.args, r.opts, r.actCtx = args, opts, actCtx
	r.started = workflow.Now(ctx)
	if it.isGPUStep(s) {
		it.startGPU(actCtx, r, args, opts)
		r.result.Status = StatusRunning
		it.running++
		return nil
	}
	cctx, cancel := workflow.WithCancel(actCtx)
	cctx = workflow.WithActivityOptions(cctx, opts)
	r.future = workflow.ExecuteActivity(cctx, s.Uses, args)
	r.cancel = cancel
	r.result.Status = StatusRunning
	it.running++
	return nil
}

func (it *interpreter) finish(ctx workflow.Context, r *stepRun, f workflow.Future) {
	it.running--
	r.cancel()
	r.result.Seconds = workflow.Now(ctx).Sub(r.started).Seconds()
	var out map[string]any
	err := f.Get(ctx, &out)
	if r.gpu {
		// Each execution of a routed step is a first attempt to Temporal.
		defer func() { r.result.Attempts = r.attempts }()
	}
	if err == nil {
		r.result.Status = StatusSucceeded
		it.vllm = mergeVLLM(it.vllm, vllmMeta(out))
		r.result.Outputs, r.result.Attempts = splitMeta(out)
		it.track(r)
		return
	}
	if it.recoverStale(ctx, r, err) {
		return
	}
	r.result.Attempts = attemptOf(err)
	if temporal.IsCanceledError(err) {
		r.result.Status = StatusCancelled
		r.result.Error = "cancelled"
		return
	}
	// An ActivityError's cause carries the activity's own message; a GPU
	// step's own errors (runGPU) already say what happened.
	cause := err
	if ae, ok := err.(*temporal.ActivityError); ok {
		if c := errors.Unwrap(ae); c != nil {
			cause = c
		}
	}
	it.fail(r, cause)
}

// splitMeta separates the reserved "_"-prefixed keys (metadata such as the
// attempt number) from a step's outputs.
func splitMeta(out map[string]any) (map[string]any, int) {
	attempt := 0
	if v, ok := out[pipelines.MetaAttempt].(float64); ok {
		attempt = int(v)
	}
	keys := make([]string, 0, len(out))
	//workflowcheck:ignore
	for k := range out {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	clean := make(map[string]any, len(out))
	for _, k := range keys {
		if !strings.HasPrefix(k, "_") {
			clean[k] = out[k]
		}
	}
	return clean, attempt
}

func attemptOf(err error) int {
	var app *temporal.ApplicationError
	if errors.As(err, &app) && app.HasDetails() {
		var d pipelines.AttemptDetail
		if app.Details(&d) == nil {
			return d.Attempt
		}
	}
	return 0
}

// activityOptions turns a step's YAML settings (falling back to the
// pipeline defaults) into Temporal activity options.
func activityOptions(p *pipelines.Pipeline, s *pipelines.Step) workflow.ActivityOptions {
	timeout := s.Timeout.D()
	if timeout == 0 {
		timeout = p.Defaults.Timeout.D()
	}
	if timeout == 0 {
		timeout = pipelines.DefaultStepTimeout
	}
	heartbeat := s.Heartbeat.D()
	if heartbeat == 0 {
		heartbeat = p.Defaults.Heartbeat.D()
	}
	queue := s.TaskQueue
	if queue == "" {
		queue = p.Defaults.TaskQueue
	}
	retry := s.Retry
	if retry == nil {
		retry = p.Defaults.Retry
	}
	rp := &temporal.RetryPolicy{MaximumAttempts: pipelines.DefaultMaxAttempts}
	if retry != nil {
		rp = &temporal.RetryPolicy{
			InitialInterval:        retry.InitialInterval.D(),
			BackoffCoefficient:     retry.Backoff,
			MaximumInterval:        retry.MaxInterval.D(),
			MaximumAttempts:        int32(retry.MaxAttempts),
			NonRetryableErrorTypes: retry.NonRetryable,
		}
	}
	if slices.Contains(checksWeights, s.Uses) {
		// The interpreter re-syncs the server before the retry (recoverStale):
		// a plain retry would find it stale again.
		rp.NonRetryableErrorTypes = append(slices.Clip(rp.NonRetryableErrorTypes), pipelines.ErrTypeStaleWeights)
	}
	return workflow.ActivityOptions{
		ActivityID:          s.ID,
		Summary:             activitySummary(s),
		TaskQueue:           queue,
		StartToCloseTimeout: timeout,
		HeartbeatTimeout:    heartbeat,
		RetryPolicy:         rp,
		// Wait for the activity to acknowledge cancellation, so an `always`
		// step (resume vLLM) never starts while a cancelled one still runs.
		WaitForCancellation: true,
	}
}

// gpuHost is a copy of the iteration's current GPU worker, if any.
func (it *interpreter) gpuHost() *GPUHost {
	if it.gpu == nil || it.gpu.host == nil {
		return nil
	}
	h := *it.gpu.host
	return &h
}
