package workflows

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// checksWeights are the step types that check the servers' weights and fail
// with StaleWeights when a server is not on what the run expects.
var checksWeights = []string{pipelines.StepGenerate, pipelines.StepEvaluate, pipelines.StepBroadcast, pipelines.StepPublish}

// syncs are the step types that load weights into the servers.
var syncs = []string{pipelines.StepBroadcast, pipelines.StepPublish}

// maxResyncs bounds the re-syncs one step can cause: a server that loses its
// weights again at once is failing, not restarting.
const maxResyncs = 3

// stepContext is what every step's activity gets under "context".
func (it *interpreter) stepContext(s *pipelines.Step, servers []pipelines.Server) pipelines.StepContext {
	spec := it.in.Spec
	sc := pipelines.StepContext{
		Pipeline: spec.Name, RunID: it.in.RunID, Iteration: it.in.Iteration, StepID: s.ID,
		BaseDir: spec.BaseDir, Outputs: s.Outputs, Servers: servers, WeightTransfer: spec.WeightTransfer,
	}
	switch s.Uses {
	case pipelines.StepGenerate, pipelines.StepEvaluate:
		sc.Weights = it.weights
	case pipelines.StepBroadcast, pipelines.StepPublish:
		sc.FleetPaused = it.fleetPaused
	}
	if slices.Contains(pipelines.TrainerStepTypes, s.Uses) {
		sc.Trainer = spec.Trainer
	}
	return sc
}

// track records what a succeeded step did to the servers' state: the
// weights a broadcast loaded, and whether the run holds them paused.
func (it *interpreter) track(r *stepRun) {
	switch r.step.Uses {
	case pipelines.StepBroadcast:
		v, _ := r.result.Outputs["version"].(string)
		ckpt, _ := r.result.Outputs["checkpoint"].(string)
		if v != "" && ckpt != "" {
			it.weights = &pipelines.ExpectedWeights{Version: v, Checkpoint: ckpt}
		}
	case pipelines.StepPublish:
		v, _ := r.result.Outputs["version"].(string)
		if n, ok := number(r.result.Outputs["iteration"]); ok && n >= 1 && v != "" {
			it.weights = &pipelines.ExpectedWeights{Version: v, TrainerIteration: int(n)}
		}
	case pipelines.StepPause:
		it.fleetPaused = true
	case pipelines.StepResume:
		it.fleetPaused = false
	}
}

// recoverStale takes over a step that failed with StaleWeights: it re-syncs
// the servers the error names (generate, evaluate: pause, broadcast the
// run's last checkpoint, resume; broadcast: pause the servers it found
// unpaused) and runs the step again, reporting false when it cannot (not
// StaleWeights, no checkpoint to restore, or maxResyncs reached), so the
// step fails with the error as it is.
func (it *interpreter) recoverStale(ctx workflow.Context, r *stepRun, err error) bool {
	var app *temporal.ApplicationError
	if !errors.As(err, &app) || app.Type() != pipelines.ErrTypeStaleWeights || r.actCtx == nil || r.resyncs >= maxResyncs {
		return false
	}
	if !slices.Contains(syncs, r.step.Uses) && it.weights == nil {
		return false // nothing to restore: the run has not synced yet
	}
	var attempt pipelines.AttemptDetail
	var stale pipelines.StaleServers
	if app.Details(&attempt, &stale) != nil || len(stale.Indexes) == 0 {
		return false
	}
	for _, i := range stale.Indexes {
		if i < 0 || i >= len(it.servers) {
			return false
		}
	}
	r.resyncs++
	r.result.Resyncs = r.resyncs
	workflow.GetLogger(ctx).Warn("servers on stale weights: re-syncing them, then running the step again",
		"step", r.step.ID, "servers", strings.Join(stale.URLs, ", "), "resync", r.resyncs, "error", app.Error())
	cctx, cancel := workflow.WithCancel(r.actCtx)
	fut, set := workflow.NewFuture(cctx)
	r.future, r.cancel = fut, cancel
	r.result.Status = StatusRunning
	it.running++
	workflow.Go(cctx, func(g workflow.Context) {
		out, err := it.resyncAndRerun(g, r, stale.Indexes)
		set.Set(out, err)
	})
	return true
}

func (it *interpreter) resyncAndRerun(ctx workflow.Context, r *stepRun, stale []int) (map[string]any, error) {
	prefix := fmt.Sprintf("%s/resync-%d", r.step.ID, r.resyncs)
	targets := make([]pipelines.Server, len(stale))
	for k, i := range stale {
		targets[k] = it.servers[i]
	}
	if slices.Contains(syncs, r.step.Uses) {
		// Found unpaused (restarted, or resumed behind the run's back):
		// pause them again and broadcast again.
		if err := it.control(ctx, prefix+"/pause", pipelines.StepPause, targets, map[string]any{"mode": vllm.PauseKeep}); err != nil {
			return nil, fmt.Errorf("re-pausing %s before broadcasting again: %w", serverURLs(targets), err)
		}
	} else if err := it.resync(ctx, prefix, targets); err != nil {
		return nil, fmt.Errorf("re-syncing %s to %s: %w", serverURLs(targets), it.weights.Version, err)
	}
	args := maps.Clone(r.args)
	sc := it.stepContext(r.step, it.servers)
	if slices.Contains(syncs, r.step.Uses) {
		sc.FleetPaused = true
	}
	sc.Rerun = r.resyncs
	args[pipelines.ContextArg] = sc
	opts := r.opts
	if r.gpu {
		return it.runGPU(ctx, r, args, opts)
	}
	opts.ActivityID = fmt.Sprintf("%s/rerun-%d", r.step.ID, r.resyncs)
	var out map[string]any
	err := workflow.ExecuteActivity(workflow.WithActivityOptions(ctx, opts), r.step.Uses, args).Get(ctx, &out)
	return out, err
}

// resync loads the run's last weights into the stale servers: pause (keep),
// broadcast, and resume unless the run holds the fleet paused. The nccl
// backend broadcasts to one group of every server, so it pauses and loads
// them all; the disk backend reaches the stale ones alone.
func (it *interpreter) resync(ctx workflow.Context, prefix string, stale []pipelines.Server) error {
	servers := stale
	if it.in.Spec.WeightTransfer != nil && it.in.Spec.WeightTransfer.Backend == pipelines.BackendNCCL {
		servers = it.servers
	}
	if err := it.control(ctx, prefix+"/pause", pipelines.StepPause, servers, map[string]any{"mode": vllm.PauseKeep}); err != nil {
		return err
	}
	err := it.broadcastLast(ctx, prefix+"/broadcast", servers)
	if !it.fleetPaused {
		// Resume even when the broadcast failed or the run is cancelled:
		// never leave a server paused.
		dctx, _ := workflow.NewDisconnectedContext(ctx)
		if rerr := it.control(dctx, prefix+"/resume", pipelines.StepResume, servers, nil); rerr != nil {
			err = errors.Join(err, fmt.Errorf("resuming: %w", rerr))
		}
	}
	return err
}

// broadcastLast broadcasts the run's last checkpoint and version to
// servers, verifying the version, routed as the pipeline's own broadcasts.
// Weights the resident trainer published are published again, under the
// expectation (sc.Weights) that the trainer is still at the iteration it
// published them from: the publish refuses a trainer that trained since.
func (it *interpreter) broadcastLast(ctx workflow.Context, id string, servers []pipelines.Server) error {
	s := &pipelines.Step{ID: id, Uses: pipelines.StepBroadcast}
	if it.weights.TrainerIteration > 0 {
		s.Uses = pipelines.StepPublish
	}
	sc := it.stepContext(s, servers)
	sc.FleetPaused = true
	args := map[string]any{pipelines.ContextArg: sc, "version": it.weights.Version, "verify": true}
	if s.Uses == pipelines.StepPublish {
		sc.Weights = it.weights
		args[pipelines.ContextArg] = sc
	} else {
		args["checkpoint"] = it.weights.Checkpoint
	}
	opts := activityOptions(it.in.Spec, s)
	if it.isGPUStep(s) {
		_, err := it.runGPU(ctx, &stepRun{step: s}, args, opts)
		return err
	}
	return workflow.ExecuteActivity(workflow.WithActivityOptions(ctx, opts), s.Uses, args).Get(ctx, nil)
}

// control runs a pause or resume on servers with the pipeline's defaults.
func (it *interpreter) control(ctx workflow.Context, id, uses string, servers []pipelines.Server, with map[string]any) error {
	s := &pipelines.Step{ID: id, Uses: uses}
	args := maps.Clone(with)
	if args == nil {
		args = map[string]any{}
	}
	args[pipelines.ContextArg] = it.stepContext(s, servers)
	opts := activityOptions(it.in.Spec, s)
	return workflow.ExecuteActivity(workflow.WithActivityOptions(ctx, opts), uses, args).Get(ctx, nil)
}

func serverURLs(servers []pipelines.Server) string {
	urls := make([]string, len(servers))
	for i, s := range servers {
		urls[i] = s.URL
	}
	return strings.Join(urls, ", ")
}
