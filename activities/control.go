package activities

import (
	"context"
	"sync"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/activity"
)

// PauseInput is the `with` of a pause step.
type PauseInput struct {
	Context pipelines.StepContext `json:"context"`
	Mode    string                `json:"mode,omitempty"`
	// Timeout bounds each server's pause (default: vllm's control timeout,
	// or its generate timeout for mode wait, which lasts as long as the
	// longest request in flight).
	Timeout pipelines.Duration `json:"timeout,omitempty"`
}

// ServersOutput is the outputs of pause and resume: how many servers the
// call reached (all of them, or the step fails).
type ServersOutput struct {
	Servers int `json:"servers"`
	Attempt int `json:"_attempt"`
}

// ControlInput is the `with` of resume, is_paused and world_size.
type ControlInput struct {
	Context pipelines.StepContext `json:"context"`
	// Timeout bounds each server's call (default vllm.DefaultControlTimeout).
	Timeout pipelines.Duration `json:"timeout,omitempty"`
}

// IsPausedOutput is an is_paused step's outputs. Paused is true when any
// server is paused, so `when: ${{ steps.x.outputs.paused }}` can guard a
// resume that repairs a half-paused fleet.
type IsPausedOutput struct {
	Paused        bool `json:"paused"`
	PausedServers int  `json:"paused_servers"`
	Attempt       int  `json:"_attempt"`
}

// WorldSizeOutput is a world_size step's outputs: the NCCL group size, 1
// (the trainer) plus every server's world size with DP.
type WorldSizeOutput struct {
	WorldSize int `json:"world_size"`
	Attempt   int `json:"_attempt"`
}

func attemptOf(ctx context.Context) int {
	if activity.IsActivity(ctx) {
		return int(activity.GetInfo(ctx).Attempt)
	}
	return 1
}

// Pause pauses every server in parallel. A pause that fails on some servers
// is undone on the others (vllm.Fleet.PauseAll) and the error names each
// failed server, the call and the reason.
func (a *Activities) Pause(ctx context.Context, in PauseInput) (*ServersOutput, error) {
	mode := in.Mode
	if mode == "" {
		mode = vllm.PauseAbort
	}
	switch mode {
	case vllm.PauseAbort, vllm.PauseWait, vllm.PauseKeep:
	default:
		return nil, badInput(ctx, "pause: mode %q, want abort, wait or keep", mode)
	}
	t := vllm.Timeouts{Control: in.Timeout.D()}
	if mode == vllm.PauseWait {
		t = vllm.Timeouts{Generate: in.Timeout.D()}
	}
	f, err := a.fleet(ctx, "pause", in.Context, t)
	if err != nil {
		return nil, err
	}
	// mode wait lasts as long as the longest request in flight.
	defer a.keepHeartbeating(ctx)()
	if err := f.PauseAll(ctx, mode); err != nil {
		return nil, serverError(ctx, err, "pause (mode %s)", mode)
	}
	return &ServersOutput{Servers: len(f), Attempt: attemptOf(ctx)}, nil
}

// Resume resumes every server in parallel, trying each even if others fail.
func (a *Activities) Resume(ctx context.Context, in ControlInput) (*ServersOutput, error) {
	f, err := a.fleet(ctx, "resume", in.Context, vllm.Timeouts{Control: in.Timeout.D()})
	if err != nil {
		return nil, err
	}
	if err := f.ResumeAll(ctx); err != nil {
		return nil, serverError(ctx, err, "resume")
	}
	return &ServersOutput{Servers: len(f), Attempt: attemptOf(ctx)}, nil
}

// IsPaused asks every server in parallel whether it is paused.
func (a *Activities) IsPaused(ctx context.Context, in ControlInput) (*IsPausedOutput, error) {
	f, err := a.fleet(ctx, "is_paused", in.Context, vllm.Timeouts{Control: in.Timeout.D()})
	if err != nil {
		return nil, err
	}
	paused := make([]bool, len(f))
	errs := make([]error, len(f))
	var wg sync.WaitGroup
	for i, c := range f {
		wg.Go(func() { paused[i], errs[i] = c.IsPaused(ctx) })
	}
	wg.Wait()
	if err := fleetError("is_paused", f, errs); err != nil {
		return nil, serverError(ctx, err, "is_paused")
	}
	out := &IsPausedOutput{Attempt: attemptOf(ctx)}
	for _, p := range paused {
		if p {
			out.PausedServers++
		}
	}
	out.Paused = out.PausedServers > 0
	return out, nil
}

// WorldSize asks every server for its world size (DP included).
func (a *Activities) WorldSize(ctx context.Context, in ControlInput) (*WorldSizeOutput, error) {
	f, err := a.fleet(ctx, "world_size", in.Context, vllm.Timeouts{Control: in.Timeout.D()})
	if err != nil {
		return nil, err
	}
	topo, err := f.WorldSizes(ctx)
	if err != nil {
		return nil, serverError(ctx, err, "world_size")
	}
	return &WorldSizeOutput{WorldSize: topo.WorldSize, Attempt: attemptOf(ctx)}, nil
}
