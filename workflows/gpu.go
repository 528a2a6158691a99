package workflows

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// gpuRoutingChange is the workflow.GetVersion change id of the GPU routing:
// iterations recorded before it ran nccl transfer steps on the control
// queue, and replay must keep doing so for them.
const gpuRoutingChange = "gpu-routing"

// gpuRouting is an iteration's view of its GPU worker. All of it runs on
// the workflow's goroutines, which Temporal runs one at a time, so it needs
// no locking; concurrent GPU steps share one acquire through acquiring.
type gpuRouting struct {
	queue        string        // shared GPU queue, for gpu_acquire
	startTimeout time.Duration // ScheduleToStart on a host queue
	host         *GPUHost      // current worker; nil = acquire first
	lost         string        // host queue most recently lost
	acquiring    workflow.Future
}

// routesGPU reports whether the pipeline's transfer steps need a GPU
// worker: a backend that runs there (nccl, ipc) and at least one GPU step.
func routesGPU(p *pipelines.Pipeline) bool {
	if !p.WeightTransfer.OnGPUWorker() {
		return false
	}
	for _, s := range p.Steps {
		if slices.Contains(pipelines.GPUStepTypes, s.Uses) {
			return true
		}
	}
	return false
}

// newGPURouting decides, once per iteration and before any command, whether
// GPU steps are routed. The version marker is only recorded for pipelines
// that route, so histories of other pipelines are untouched.
func newGPURouting(ctx workflow.Context, in IterationInput) *gpuRouting {
	if !routesGPU(in.Spec) {
		return nil
	}
	if workflow.GetVersion(ctx, gpuRoutingChange, workflow.DefaultVersion, 1) == workflow.DefaultVersion {
		return nil
	}
	wt := in.Spec.WeightTransfer
	g := &gpuRouting{queue: wt.GPUTaskQueue, startTimeout: wt.GPUStartTimeout.D()}
	if g.queue == "" {
		g.queue = pipelines.DefaultGPUTaskQueue
	}
	if g.startTimeout == 0 {
		g.startTimeout = pipelines.DefaultGPUStartTimeout
	}
	if in.GPUHost != nil && in.GPUHost.TaskQueue != "" {
		h := *in.GPUHost
		g.host = &h
	}
	return g
}

func (it *interpreter) isGPUStep(s *pipelines.Step) bool {
	return it.gpu != nil && slices.Contains(pipelines.GPUStepTypes, s.Uses)
}

// startGPU runs a GPU step on a workflow goroutine that acquires a worker,
// runs the step on that worker's queue, and moves to another worker when
// this one is lost; r.future resolves with the step's final result.
func (it *interpreter) startGPU(actCtx workflow.Context, r *stepRun, args map[string]any, opts workflow.ActivityOptions) {
	cctx, cancel := workflow.WithCancel(actCtx)
	fut, set := workflow.NewFuture(cctx)
	r.future, r.cancel, r.gpu = fut, cancel, true
	workflow.Go(cctx, func(gctx workflow.Context) {
		out, err := it.runGPU(gctx, r, args, opts)
		set.Set(out, err)
	})
}

// runGPU is one GPU step, all attempts. Temporal's own retries are off
// (MaximumAttempts 1 per execution) because a retry must be able to move
// to another queue; the step's retry policy is applied here instead, and
// an attempt lost with its worker counts against max_attempts like any
// other. Errors a retry cannot fix end the step as they would elsewhere.
func (it *interpreter) runGPU(ctx workflow.Context, r *stepRun, args map[string]any, base workflow.ActivityOptions) (map[string]any, error) {
	logger := workflow.GetLogger(ctx)
	rp := base.RetryPolicy
	for attempt := 1; ; attempt++ {
		host, err := it.acquireGPU(ctx)
		if err != nil {
			return nil, err
		}
		h := host
		r.result.GPUHost, r.attempts = &h, attempt
		opts := gpuActivityOptions(base, r.step.ID, attempt, host, it.gpu.startTimeout)
		var out map[string]any
		err = workflow.ExecuteActivity(workflow.WithActivityOptions(ctx, opts), r.step.Uses, args).Get(ctx, &out)
		if err == nil {
			return out, nil
		}
		if temporal.IsCanceledError(err) || ctx.Err() != nil {
			return nil, err
		}
		lost, why := gpuWorkerLost(err)
		last := rp.MaximumAttempts > 0 && attempt >= int(rp.MaximumAttempts)
		if lost {
			it.loseGPU(host)
			logger.Warn("GPU worker lost", "step", r.step.ID, "attempt", attempt, "host", host.Host, "task_queue", host.TaskQueue, "why", why)
			if last {
				return nil, fmt.Errorf("GPU worker %s (task queue %s) lost (%s) on attempt %d of %d: %w",
					host.Host, host.TaskQueue, why, attempt, rp.MaximumAttempts, activityCause(err))
			}
			continue // to another worker at once: the loss took a timeout already
		}
		if last || !retryable(err, rp) {
			return nil, err
		}
		if err := workflow.Sleep(ctx, backoff(rp, attempt)); err != nil {
			return nil, err
		}
	}
}

// routedAttemptSep joins a routed step's id and attempt into its activity id.
const routedAttemptSep = "/attempt-"

// RoutedStepID returns the step id of a routed step's activity id
// ("sync/attempt-2" -> "sync"), for tools that read pending activities.
func RoutedStepID(activityID string) (string, bool) {
	step, n, ok := strings.Cut(activityID, routedAttemptSep)
	if !ok || n == "" || strings.Trim(n, "0123456789") != "" {
		return "", false
	}
	return step, true
}

// gpuActivityOptions places one attempt of a GPU step on host's queue.
// The ScheduleToStart timeout is what notices a dead worker (nobody polls
// its queue); the default heartbeat notices one dying mid-step. Activity
// ids are per attempt because each attempt is its own activity.
func gpuActivityOptions(base workflow.ActivityOptions, stepID string, attempt int, host GPUHost, startTimeout time.Duration) workflow.ActivityOptions {
	opts := base
	opts.ActivityID = fmt.Sprintf("%s%s%d", stepID, routedAttemptSep, attempt)
	opts.TaskQueue = host.TaskQueue
	opts.ScheduleToStartTimeout = startTimeout
	opts.RetryPolicy = &temporal.RetryPolicy{MaximumAttempts: 1}
	if opts.HeartbeatTimeout == 0 && opts.StartToCloseTimeout > DefaultGPUHeartbeat {
		opts.HeartbeatTimeout = DefaultGPUHeartbeat
	}
	return opts
}

// acquireGPU returns the current GPU worker, acquiring one if there is
// none. Concurrent callers share one acquire.
func (it *interpreter) acquireGPU(ctx workflow.Context) (GPUHost, error) {
	g := it.gpu
	for {
		if g.host != nil {
			return *g.host, nil
		}
		if g.acquiring != nil {
			var h GPUHost
			err := g.acquiring.Get(ctx, &h)
			if err == nil {
				return h, nil
			}
			// The acquiring step was cancelled (fail-fast), not this one: try again.
			if temporal.IsCanceledError(err) && ctx.Err() == nil {
				continue
			}
			return GPUHost{}, err
		}
		fut, set := workflow.NewFuture(ctx)
		g.acquiring = fut
		h, err := it.acquireOnce(ctx)
		g.acquiring = nil
		if err == nil {
			g.host = &h
		}
		set.Set(h, err)
		return h, err
	}
}

// acquireOnce asks the shared GPU queue for a worker, waiting up to
// GPUAcquireAttempts × GPUAcquireWait for one to poll it.
func (it *interpreter) acquireOnce(ctx workflow.Context) (GPUHost, error) {
	g := it.gpu
	actx := workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		TaskQueue:              g.queue,
		Summary:                "acquire a GPU worker",
		ScheduleToStartTimeout: GPUAcquireWait,
		StartToCloseTimeout:    GPUAcquireRunTimeout,
		RetryPolicy:            &temporal.RetryPolicy{InitialInterval: time.Second, MaximumAttempts: 3},
	})
	in := GPUAcquireInput{RunID: it.in.RunID, Lost: g.lost}
	for i := 1; i <= GPUAcquireAttempts; i++ {
		var h GPUHost
		err := workflow.ExecuteActivity(actx, AcquireGPUActivity, in).Get(ctx, &h)
		switch {
		case err == nil && h.TaskQueue == "":
			return GPUHost{}, temporal.NewNonRetryableApplicationError(
				fmt.Sprintf("%s on task queue %s answered without a task queue (host %q)", AcquireGPUActivity, g.queue, h.Host), pipelines.ErrTypeGPUUnavailable, nil)
		case err == nil:
			workflow.GetLogger(ctx).Info("GPU worker acquired", "host", h.Host, "device", h.Device, "task_queue", h.TaskQueue)
			return h, nil
		case temporal.IsCanceledError(err) || ctx.Err() != nil:
			return GPUHost{}, err
		case isTimeout(err, enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START):
			workflow.GetLogger(ctx).Warn("no GPU worker is polling; still waiting", "task_queue", g.queue, "waited", time.Duration(i)*GPUAcquireWait)
		default:
			return GPUHost{}, temporal.NewNonRetryableApplicationError(
				fmt.Sprintf("acquiring a GPU worker on task queue %s: %v", g.queue, activityCause(err)), pipelines.ErrTypeGPUUnavailable, nil)
		}
	}
	return GPUHost{}, temporal.NewNonRetryableApplicationError(
		fmt.Sprintf("no GPU worker polled task queue %s within %s: start one (rlflow worker --gpu)", g.queue, GPUAcquireAttempts*GPUAcquireWait),
		pipelines.ErrTypeGPUUnavailable, nil)
}

// loseGPU forgets host unless another step already replaced it.
func (it *interpreter) loseGPU(host GPUHost) {
	g := it.gpu
	if g.host != nil && g.host.TaskQueue == host.TaskQueue {
		g.host = nil
	}
	g.lost = host.TaskQueue
}

// gpuWorkerLost reports whether err says the worker behind a host queue is
// gone: nobody picked the task up (ScheduleToStart), the worker stopped
// heartbeating, or the activity said so itself. A StartToClose timeout is
// not proof (a live worker may be slow) and is retried on the same worker;
// if that worker is in fact dead, the retry's ScheduleToStart says so.
func gpuWorkerLost(err error) (bool, string) {
	switch {
	case isTimeout(err, enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START):
		return true, "nobody polled its task queue"
	case isTimeout(err, enumspb.TIMEOUT_TYPE_HEARTBEAT):
		return true, "heartbeat timeout"
	}
	var app *temporal.ApplicationError
	if errors.As(err, &app) && app.Type() == pipelines.ErrTypeGPUWorkerLost {
		return true, "the activity reported it" // its message follows in the error
	}
	return false, ""
}

// isTimeout reports whether err is (or wraps) a timeout of type tt. Only
// the outermost timeout counts: a ScheduleToStart timeout may carry the
// previous attempt's heartbeat timeout as its cause.
func isTimeout(err error, tt enumspb.TimeoutType) bool {
	var te *temporal.TimeoutError
	return errors.As(err, &te) && te.TimeoutType() == tt
}

// retryable applies a retry policy's error rules as Temporal would.
func retryable(err error, rp *temporal.RetryPolicy) bool {
	var app *temporal.ApplicationError
	if errors.As(err, &app) {
		return !app.NonRetryable() && !slices.Contains(rp.NonRetryableErrorTypes, app.Type())
	}
	var te *temporal.TimeoutError
	if errors.As(err, &te) {
		switch te.TimeoutType() {
		case enumspb.TIMEOUT_TYPE_START_TO_CLOSE:
			return !slices.Contains(rp.NonRetryableErrorTypes, pipelines.ErrTypeStartToCloseTimeout)
		case enumspb.TIMEOUT_TYPE_HEARTBEAT:
			return !slices.Contains(rp.NonRetryableErrorTypes, pipelines.ErrTypeHeartbeatTimeout)
		}
		return false
	}
	var term *temporal.TerminatedError
	return !errors.As(err, &term)
}

// backoff is the wait before attempt+1 under Temporal's retry rules and
// defaults (1s initial, 2.0 coefficient, 100× initial cap).
func backoff(rp *temporal.RetryPolicy, attempt int) time.Duration {
	initial := rp.InitialInterval
	if initial <= 0 {
		initial = time.Second
	}
	coef := rp.BackoffCoefficient
	if coef < 1 {
		coef = 2
	}
	maxI := rp.MaximumInterval
	if maxI <= 0 {
		maxI = 100 * initial
	}
	d := float64(initial) * math.Pow(coef, float64(attempt-1))
	if d > float64(maxI) {
		return maxI
	}
	return time.Duration(d)
}

// activityCause is the failure inside an ActivityError (whose own message
// is mostly ids), or err itself.
func activityCause(err error) error {
	var ae *temporal.ActivityError
	if errors.As(err, &ae) {
		if c := errors.Unwrap(ae); c != nil {
			return c
		}
	}
	return err
}
