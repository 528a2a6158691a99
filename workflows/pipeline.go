package workflows

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/rlflow/rlflow/pipelines"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// RecentIterations bounds how many iteration summaries a run carries (and
// returns): enough to read a trend, small enough for any payload limit.
const RecentIterations = 10

// RunPipeline runs a pipeline's loop: one RunIteration child workflow per
// iteration, `until` checked after each, continue-as-new every
// Loop.ContinueAsNewEvery iterations.
//
// Its input is a PipelineInput as JSON, taken raw so that RunPipeline, not
// the SDK, decodes it: strictly, with errors that name the field
// (validatedInput). Whoever starts the run (rlflow run, the Temporal UI, a
// schedule) and after every continue-as-new, the spec is validated on the
// worker by the loader of `rlflow validate` before anything runs, and the
// pipeline that loader returns is the one the run uses.
func RunPipeline(ctx workflow.Context, raw json.RawMessage) (*PipelineResult, error) {
	logger := workflow.GetLogger(ctx)
	var in PipelineInput
	var err error
	if workflow.GetVersion(ctx, inputValidationChange, workflow.DefaultVersion, 1) == workflow.DefaultVersion {
		in, err = trustedInput(ctx, raw)
	} else {
		in, err = validatedInput(ctx, raw)
	}
	if err != nil {
		return nil, err
	}
	spec := in.Spec
	params, err := spec.ResolveParamValues(in.Params)
	if err != nil {
		return nil, temporal.NewNonRetryableApplicationError("params: "+err.Error(), pipelines.ErrTypeBadInput, nil)
	}
	in.Params = params
	if _, err := spec.ServersFor(params); err != nil {
		// Fail at launch, not in the first step that calls a server.
		return nil, temporal.NewNonRetryableApplicationError("params: "+err.Error(), pipelines.ErrTypeBadInput, nil)
	}

	every := spec.Loop.ContinueAsNewEvery
	if every <= 0 {
		every = pipelines.DefaultContinueAsNewEvery
	}
	limit := spec.Loop.Iterations
	stoppedBy := "iterations"
	if spec.Loop.Until != "" {
		limit, stoppedBy = spec.Loop.MaxIterations, "max_iterations"
	}
	if limit <= 0 {
		limit = 1
	}

	r := &pipelineRun{in: in, status: StatusRunning, limit: limit, iteration: max(in.NextIteration, 1)}
	if err := workflow.SetQueryHandler(ctx, QueryProgress, r.progress); err != nil {
		return nil, err
	}
	pauseCh := workflow.GetSignalChannel(ctx, SignalPause)
	resumeCh := workflow.GetSignalChannel(ctx, SignalResume)
	if workflow.GetVersion(ctx, visibilityChange, workflow.DefaultVersion, 1) >= 1 {
		r.visible = true
		r.registered = registeredSearchAttributes(ctx)
		for _, sum := range r.in.Recent {
			r.noteHeadline(sum)
		}
	}
	r.upsert(ctx)
	ranHere := 0
	for iter := max(in.NextIteration, 1); iter <= limit; iter++ {
		if ranHere >= every {
			r.in.NextIteration = iter
			r.drainSignals(pauseCh, resumeCh)
			if r.visible {
				r.continuing = true
				r.publish(ctx)
			}
			logger.Info("continuing as new", "next_iteration", iter)
			return nil, workflow.NewContinueAsNewError(ctx, PipelineWorkflow, r.in)
		}
		r.drainSignals(pauseCh, resumeCh)
		if r.in.Paused {
			r.status = "paused"
			r.upsert(ctx)
			if err := r.waitResume(ctx, pauseCh, resumeCh); err != nil {
				return nil, err
			}
			r.status = StatusRunning
		}
		r.iteration = iter
		r.upsert(ctx)
		sum, err := r.runIteration(ctx, iter, pauseCh, resumeCh)
		ranHere++
		r.record(sum)
		if r.visible && err == nil {
			// The headline of this iteration, before the next one starts
			// (or the run ends).
			r.noteHeadline(sum)
			r.publish(ctx)
		}
		if err != nil {
			r.lastError = err.Error()
			if temporal.IsCanceledError(err) || ctx.Err() != nil {
				r.status = StatusCancelled
				r.upsertDisconnected(ctx)
				return nil, temporal.NewCanceledError(fmt.Sprintf("cancelled during iteration %d", iter))
			}
			r.status = StatusFailed
			r.upsert(ctx)
			return nil, err
		}
		if spec.Loop.Until != "" {
			done, err := pipelines.EvalCondition(spec.Loop.Until, r.untilEnv(sum))
			if err != nil {
				r.status = StatusFailed
				r.upsert(ctx)
				return nil, temporal.NewNonRetryableApplicationError(fmt.Sprintf("iteration %d: loop.until: %v", iter, err), pipelines.ErrTypeBadInput, nil)
			}
			if done {
				stoppedBy = "until"
				break
			}
		}
	}
	r.status = StatusSucceeded
	r.upsert(ctx)
	return &PipelineResult{Pipeline: spec.Name, Iterations: r.done, StoppedBy: stoppedBy, Recent: r.in.Recent, VLLM: r.in.VLLM}, nil
}

type pipelineRun struct {
	in        PipelineInput
	iteration int
	limit     int
	done      int
	status    string
	child     string
	lastError string

	// visible: the run keeps the UI's view of it true (visibilityChange);
	// the rest is what it shows.
	visible    bool
	registered map[string]bool // search attributes the namespace has
	continuing bool            // continuing as new
	headline   *float64        // latest metrics.headline value
	lastSteps  []StepResult    // of the last iteration that finished
	stepsOf    int             // the iteration lastSteps belong to
}

func (r *pipelineRun) progress() (Progress, error) {
	return Progress{
		Pipeline: r.in.Spec.Name, Iteration: r.iteration, IterationsDone: r.done,
		Paused: r.in.Paused, Status: r.status, Child: r.child, LastError: r.lastError, GPUHost: r.in.GPUHost,
	}, nil
}

func (r *pipelineRun) record(sum IterationSummary) {
	if sum.Status == StatusSucceeded {
		r.done = sum.Iteration
	}
	r.in.Recent = append(r.in.Recent, sum)
	if len(r.in.Recent) > RecentIterations {
		r.in.Recent = r.in.Recent[len(r.in.Recent)-RecentIterations:]
	}
}

// untilEnv exposes the finished iteration's steps to loop.until.
func (r *pipelineRun) untilEnv(sum IterationSummary) pipelines.Env {
	steps := map[string]pipelines.StepState{}
	// Map to map: the order of the loop never shows.
	//workflowcheck:ignore
	for id, outs := range sum.Outputs {
		steps[id] = pipelines.StepState{Status: StatusSucceeded, Outputs: outs}
	}
	return pipelines.Env{Params: r.in.Params, Steps: steps, Iteration: sum.Iteration}
}

func (r *pipelineRun) drainSignals(pauseCh, resumeCh workflow.ReceiveChannel) {
	for {
		switch {
		case pauseCh.ReceiveAsync(nil):
			r.in.Paused = true
		case resumeCh.ReceiveAsync(nil):
			r.in.Paused = false
		default:
			return
		}
	}
}

func (r *pipelineRun) waitResume(ctx workflow.Context, pauseCh, resumeCh workflow.ReceiveChannel) error {
	for r.in.Paused {
		sel := workflow.NewSelector(ctx)
		sel.AddReceive(pauseCh, func(c workflow.ReceiveChannel, _ bool) { c.Receive(ctx, nil) })
		sel.AddReceive(resumeCh, func(c workflow.ReceiveChannel, _ bool) { c.Receive(ctx, nil); r.in.Paused = false })
		sel.AddReceive(ctx.Done(), func(workflow.ReceiveChannel, bool) {})
		sel.Select(ctx)
		if ctx.Err() != nil {
			r.status = StatusCancelled
			r.upsertDisconnected(ctx)
			return temporal.NewCanceledError("cancelled while paused")
		}
	}
	return nil
}

// runIteration runs one child workflow, forwarding pause/resume to it.
func (r *pipelineRun) runIteration(ctx workflow.Context, iter int, pauseCh, resumeCh workflow.ReceiveChannel) (IterationSummary, error) {
	info := workflow.GetInfo(ctx)
	id := IterationWorkflowID(info.WorkflowExecution.ID, iter)
	r.child = id
	cctx := workflow.WithChildOptions(ctx, workflow.ChildWorkflowOptions{
		WorkflowID: id,
		TaskQueue:  info.TaskQueueName,
		// Cancelling the parent (or terminating it) asks the child to cancel,
		// so its `always` steps still run.
		WaitForCancellation: true,
		ParentClosePolicy:   enumspb.PARENT_CLOSE_POLICY_REQUEST_CANCEL,
		StaticSummary:       iterationSummary(r.in.Spec.Name, iter),
	})
	fut := workflow.ExecuteChildWorkflow(cctx, IterationWorkflow, IterationInput{
		Spec: r.in.Spec, Params: r.in.Params, Iteration: iter, RunID: info.WorkflowExecution.ID, Paused: r.in.Paused,
		GPUHost: r.in.GPUHost, Weights: r.in.Weights,
	})
	var res IterationResult
	var err error
	for done := false; !done; {
		sel := workflow.NewSelector(ctx)
		sel.AddFuture(fut, func(f workflow.Future) { err = f.Get(ctx, &res); done = true })
		sel.AddReceive(pauseCh, func(c workflow.ReceiveChannel, _ bool) {
			c.Receive(ctx, nil)
			r.in.Paused = true
			fut.SignalChildWorkflow(ctx, SignalPause, nil)
			if r.visible {
				r.publish(ctx)
			}
		})
		sel.AddReceive(resumeCh, func(c workflow.ReceiveChannel, _ bool) {
			c.Receive(ctx, nil)
			r.in.Paused = false
			fut.SignalChildWorkflow(ctx, SignalResume, nil)
			if r.visible {
				r.publish(ctx)
			}
		})
		sel.Select(ctx)
	}
	if err == nil {
		r.lastSteps, r.stepsOf = res.Steps, iter
		// The next iteration (and the next run, after continue-as-new)
		// reuses this worker and its transfer group.
		r.in.GPUHost = res.GPUHost
		r.in.Weights = res.Weights
	}
	r.in.VLLM = mergeVLLM(r.in.VLLM, res.VLLM)
	sum := IterationSummary{Iteration: iter, WorkflowID: id, Status: StatusSucceeded, Outputs: map[string]map[string]any{}}
	for _, s := range res.Steps {
		if s.Status == StatusSucceeded && len(s.Outputs) > 0 {
			sum.Outputs[s.ID] = s.Outputs
		}
	}
	if err != nil {
		sum.Status = StatusFailed
		if temporal.IsCanceledError(err) {
			sum.Status = StatusCancelled
		}
		var cerr *temporal.ChildWorkflowExecutionError
		if errors.As(err, &cerr) {
			if cause := errors.Unwrap(cerr); cause != nil {
				if temporal.IsCanceledError(cause) {
					return sum, cause
				}
				return sum, temporal.NewNonRetryableApplicationError(cause.Error(), pipelines.ErrTypeIterationFailed, nil)
			}
		}
	}
	return sum, err
}

func (r *pipelineRun) searchUpdates() []temporal.SearchAttributeUpdate {
	return []temporal.SearchAttributeUpdate{
		SearchPipeline.ValueSet(r.in.Spec.Name),
		SearchIteration.ValueSet(int64(r.iteration)),
		SearchStatus.ValueSet(r.status),
	}
}

// upsert publishes the run's state: all of it for a visible run, else
// (a run started before visibilityChange) the search attributes the
// starter asked for, as that run always did.
func (r *pipelineRun) upsert(ctx workflow.Context) {
	if r.visible {
		r.publish(ctx)
		return
	}
	if !r.in.SearchAttributes {
		return
	}
	if err := workflow.UpsertTypedSearchAttributes(ctx, r.searchUpdates()...); err != nil {
		workflow.GetLogger(ctx).Warn("upserting search attributes", "error", err)
	}
}

// upsertDisconnected records the final status even though ctx is cancelled.
func (r *pipelineRun) upsertDisconnected(ctx workflow.Context) {
	dctx, cancel := workflow.NewDisconnectedContext(ctx)
	defer cancel()
	r.upsert(dctx)
}

// IterationWorkflowID is the workflow id of a pipeline run's iteration.
func IterationWorkflowID(runID string, iteration int) string {
	return fmt.Sprintf("%s/iter-%d", runID, iteration)
}

// runStatus is RlflowStatus: Temporal's name for the run's state, or Paused.
func (r *pipelineRun) runStatus() string {
	switch {
	case r.status == StatusSucceeded:
		return RunCompleted
	case r.status == StatusFailed:
		return RunFailed
	case r.status == StatusCancelled:
		return RunCanceled
	case r.continuing:
		return RunContinuedAsNew
	case r.in.Paused:
		return RunPaused
	}
	return RunRunning
}

// noteHeadline keeps a finished iteration's headline value, if it has one.
func (r *pipelineRun) noteHeadline(sum IterationSummary) {
	if v, ok := headlineOf(r.in.Spec, sum.Outputs); ok {
		r.headline = &v
	}
}

// publish sets the run's current details and upserts its search
// attributes (those the namespace has).
func (r *pipelineRun) publish(ctx workflow.Context) {
	status := r.runStatus()
	workflow.SetCurrentDetails(ctx, pipelineDetails(r.in.Spec, status, r.iteration, r.limit, r.headline, r.in.Recent, r.lastSteps, r.stepsOf, r.in.VLLM))
	var updates []temporal.SearchAttributeUpdate
	add := func(name string, u temporal.SearchAttributeUpdate) {
		if r.registered[name] {
			updates = append(updates, u)
		}
	}
	add(SearchPipeline.GetName(), SearchPipeline.ValueSet(r.in.Spec.Name))
	add(SearchIteration.GetName(), SearchIteration.ValueSet(int64(r.iteration)))
	add(SearchStatus.GetName(), SearchStatus.ValueSet(status))
	if r.headline != nil {
		add(SearchHeadline.GetName(), SearchHeadline.ValueSet(*r.headline))
	}
	if len(updates) == 0 {
		return
	}
	if err := workflow.UpsertTypedSearchAttributes(ctx, updates...); err != nil {
		workflow.GetLogger(ctx).Warn("upserting search attributes", "error", err)
	}
}
