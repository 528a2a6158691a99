// Package worker wires rlflow's workflows and activities into Temporal
// workers: the control worker (any host), which runs the interpreter and
// every activity but the NCCL transfer, and the registration tables the GPU
// worker (worker/gpuworker) shares.
//
// Invariants: activity registration names equal the step type names in the
// pipelines registry, so `uses: exec` reaches Activities.Exec; nothing the
// control worker runs depends on NCCL.
package worker

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/interceptor"
	sdkworker "go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"
)

// Options configure a control worker.
type Options struct {
	TaskQueue string
	Deps      activities.Deps
	// MaxConcurrentActivities bounds steps run at once on this worker (0 = SDK default).
	MaxConcurrentActivities int
	// OnFatalError is called when the SDK worker stops for good (its
	// namespace was deleted, its credentials refused): it no longer polls,
	// so the process should exit rather than look alive.
	OnFatalError func(error)
	// Metrics observe every step this worker runs (nil: none).
	Metrics *metrics.Metrics
	// Reports keeps each step's result until the server acknowledged it
	// and reports the ones an outage swallowed (activities.Reports); its
	// Watch must be on c's connection (runs.DialOptions.GRPCInterceptors).
	// Nil: none.
	Reports *activities.Reports
}

// RegisterWorkflows registers the interpreter's workflows.
func RegisterWorkflows(r sdkworker.WorkflowRegistry) {
	r.RegisterWorkflowWithOptions(workflows.RunPipeline, workflow.RegisterOptions{Name: workflows.PipelineWorkflow})
	r.RegisterWorkflowWithOptions(workflows.RunIteration, workflow.RegisterOptions{Name: workflows.IterationWorkflow})
}

// RegisterControlActivities registers every control-worker activity under
// its step type name.
func RegisterControlActivities(r sdkworker.ActivityRegistry, a *activities.Activities) {
	r.RegisterActivityWithOptions(a.Exec, activity.RegisterOptions{Name: pipelines.StepExec})
	r.RegisterActivityWithOptions(a.Noop, activity.RegisterOptions{Name: pipelines.StepNoop})
	r.RegisterActivityWithOptions(a.Generate, activity.RegisterOptions{Name: pipelines.StepGenerate})
	r.RegisterActivityWithOptions(a.Evaluate, activity.RegisterOptions{Name: pipelines.StepEvaluate})
	r.RegisterActivityWithOptions(a.Pause, activity.RegisterOptions{Name: pipelines.StepPause})
	r.RegisterActivityWithOptions(a.Resume, activity.RegisterOptions{Name: pipelines.StepResume})
	r.RegisterActivityWithOptions(a.IsPaused, activity.RegisterOptions{Name: pipelines.StepIsPaused})
	r.RegisterActivityWithOptions(a.WorldSize, activity.RegisterOptions{Name: pipelines.StepWorldSize})
	// The disk backend's transfer steps run here; nccl ones are routed to a
	// GPU worker, and reaching this one fails them with NoGPUWorker.
	RegisterTransferActivities(r, a)
	r.RegisterActivityWithOptions(a.LoadPipeline, activity.RegisterOptions{Name: workflows.LoadPipelineActivity})
	r.RegisterActivityWithOptions(a.ValidateSpec, activity.RegisterOptions{Name: workflows.ValidateSpecActivity})
}

// TransferSteps are the activities of the steps a GPU worker runs: the
// weight transfer's and the resident trainer's. A control worker registers
// them too: the disk backend's run there, and the others fail at once with
// NoGPUWorker instead of waiting for a worker that has them.
type TransferSteps interface {
	InitTransfer(ctx context.Context, in activities.InitTransferInput) (*activities.InitTransferOutput, error)
	Broadcast(ctx context.Context, in activities.BroadcastInput) (*activities.BroadcastOutput, error)
	Train(ctx context.Context, in activities.TrainInput) (*activities.TrainOutput, error)
	Publish(ctx context.Context, in activities.PublishInput) (*activities.PublishOutput, error)
	SaveCheckpoint(ctx context.Context, in activities.SaveCheckpointInput) (*activities.SaveCheckpointOutput, error)
}

// RegisterTransferActivities registers the transfer steps and the resident
// trainer's steps under their step type names.
func RegisterTransferActivities(r sdkworker.ActivityRegistry, s TransferSteps) {
	r.RegisterActivityWithOptions(s.InitTransfer, activity.RegisterOptions{Name: pipelines.StepInitTransfer})
	r.RegisterActivityWithOptions(s.Broadcast, activity.RegisterOptions{Name: pipelines.StepBroadcast})
	r.RegisterActivityWithOptions(s.Train, activity.RegisterOptions{Name: pipelines.StepTrain})
	r.RegisterActivityWithOptions(s.Publish, activity.RegisterOptions{Name: pipelines.StepPublish})
	r.RegisterActivityWithOptions(s.SaveCheckpoint, activity.RegisterOptions{Name: pipelines.StepSaveCheckpoint})
}

// NewControl builds (but does not start) a control worker.
func NewControl(c client.Client, opts Options) (sdkworker.Worker, error) {
	if opts.TaskQueue == "" {
		opts.TaskQueue = workflows.DefaultTaskQueue
	}
	if opts.Deps.LogDir == "" {
		return nil, fmt.Errorf("worker: Deps.LogDir is required")
	}
	if opts.Deps.DataDir == "" {
		// Next to the logs (.rlflow/logs -> .rlflow/data) until the CLI
		// has a flag of its own for it.
		opts.Deps.DataDir = filepath.Join(filepath.Dir(opts.Deps.LogDir), "data")
	}
	acts := activities.New(opts.Deps)
	// The activities' secrets are masked in all they report; the metrics
	// see each step inside the masking; kept results are the masked ones.
	interceptors := []interceptor.WorkerInterceptor{acts.Interceptor(), opts.Metrics.Interceptor()}
	if opts.Reports != nil {
		opts.Reports.Bind(c, acts, LogKept)
		interceptors = append([]interceptor.WorkerInterceptor{opts.Reports.Interceptor()}, interceptors...)
	}
	w := sdkworker.New(c, opts.TaskQueue, sdkworker.Options{
		MaxConcurrentActivityExecutionSize: opts.MaxConcurrentActivities,
		Interceptors:                       interceptors,
		// More pollers than the SDK's 2, so a wide fan-out of steps is
		// dispatched at once instead of two at a time (see bench/).
		MaxConcurrentActivityTaskPollers: 32,
		// A fan-out's steps all start eagerly, in the reply to the
		// workflow task that schedules them, instead of 3 eagerly (the
		// SDK's default) and the rest through matching, each of which then
		// costs the server one more transaction to record its start (see
		// bench/RESULTS.md). Free activity slots still bound it.
		MaxEagerActivityReservationsPerWorkflowTask: &eagerStartsPerWorkflowTask,
		MaxConcurrentWorkflowTaskPollers:            4,
		OnFatalError:                                opts.OnFatalError,
	})
	if err := sweepAttempts(acts); err != nil {
		return nil, err
	}
	if opts.Reports != nil {
		if err := opts.Reports.ResumeKept(); err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
	}
	RegisterWorkflows(w)
	RegisterControlActivities(w, acts)
	// A local activity of the pipeline workflow, so it lives with the
	// workflows, on the worker's own client.
	w.RegisterActivityWithOptions(searchAttributeCheck{c}.Registered, activity.RegisterOptions{Name: workflows.SearchAttributesActivity})
	return w, nil
}

// eagerStartsPerWorkflowTask is how many of the steps one workflow task
// schedules may start in its reply; past it, steps go through matching.
var eagerStartsPerWorkflowTask = 256

// LogKept logs what a worker's kept results did (activities.Reports).
func LogKept(e activities.KeptEvent) {
	attrs := []any{"step", e.Step}
	if e.Error != nil {
		attrs = append(attrs, "reason", e.Error)
	}
	switch e.What {
	case "kept":
		slog.Warn("rlflow worker: a step's result did not reach Temporal; kept, and reported as soon as the server answers", attrs...)
	case "dropped", "unreadable", "not written to disk (kept in memory only)":
		slog.Warn("rlflow worker: kept result "+e.What, attrs...)
	default:
		slog.Info("rlflow worker: kept result "+e.What, attrs...)
	}
}

// sweepAttempts kills what exec attempts of dead workers left running on
// this host (a SIGKILLed worker's trainer and its descendants) before this
// worker takes steps, so a retry never runs next to them.
func sweepAttempts(acts *activities.Activities) error {
	swept, err := acts.SweepAttempts(context.Background())
	if err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	for _, s := range swept {
		attrs := []any{"run", s.RunID, "iteration", s.Iteration, "step", s.StepID, "attempt", s.Attempt,
			"dead_worker_pid", s.Worker, "killed", len(s.Killed)}
		if s.Err != nil {
			slog.Warn("rlflow worker: could not end a dead worker's exec attempt; the step's next attempt on this host tries again",
				append(attrs, "err", s.Err)...)
			continue
		}
		slog.Info("rlflow worker: ended a dead worker's exec attempt", attrs...)
	}
	return nil
}
