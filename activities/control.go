package activities

import (
	"context"

	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
)

// PauseInput is the `with` of a pause step.
type PauseInput struct {
	Context pipelines.StepContext `json:"context"`
	Mode    string                `json:"mode,omitempty"`
	// Timeout bounds each server's pause (default
	// vllm.DefaultControlTimeout, or DefaultRequestTimeout for mode
	// wait, which lasts as long as the longest request in flight).
	Timeout pipelines.Duration `json:"timeout,omitempty"`
}

// ServersOutput is the outputs of pause and resume: how many servers the
// call reached (all of them, or the step fails).
type ServersOutput struct {
	Servers int `json:"servers"`
	// VLLM is what the step learned of each server (metadata).
	VLLM    []pipelines.VLLMServer `json:"_vllm,omitempty"`
	Attempt int                    `json:"_attempt"`
}

// ControlInput is the `with` of resume, is_paused and world_size.
type ControlInput struct {
	Context pipelines.StepContext `json:"context"`
	// Timeout bounds each server's call.
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

// Pause pauses every server in parallel. A pause that fails on some servers
// is undone on the others (vllm.Fleet.PauseAll) and the error names each
// failed server, the call and the reason.
func (a *Activities) Pause(ctx context.Context, in PauseInput) (*ServersOutput, error) {
	if err := resolveArgs(ctx, pipelines.StepPause, &in); err != nil {
		return nil, err
	}
	// mode wait lasts as long as the longest request in flight, so its
	// default deadline is a request's.
	var t vllm.Timeouts
	switch timeout := in.Timeout.D(); {
	case in.Mode == vllm.PauseWait && timeout > 0:
		t.Generate = timeout
	case in.Mode == vllm.PauseWait:
		t.Generate = vllm.DefaultGenerateTimeout
	case timeout > 0:
		t.Control = timeout
	default:
		t.Control = vllm.DefaultControlTimeout
	}
	f, err := a.fleet(ctx, pipelines.StepPause, in.Context, t)
	if err != nil {
		return nil, err
	}
	defer a.keepHeartbeating(ctx)()
	if err := f.PauseAll(ctx, in.Mode); err != nil {
		return nil, serverError(ctx, err, "pause (mode %s)", in.Mode)
	}
	metrics.From(ctx).SetPaused(fleetURLs(f), true)
	return &ServersOutput{Servers: len(f), VLLM: describeServers(ctx, f), Attempt: attemptOf(ctx)}, nil
}

// Resume resumes every server in parallel, trying each even if others fail.
func (a *Activities) Resume(ctx context.Context, in ControlInput) (*ServersOutput, error) {
	f, err := a.controlFleet(ctx, pipelines.StepResume, &in)
	if err != nil {
		return nil, err
	}
	if err := f.ResumeAll(ctx); err != nil {
		return nil, serverError(ctx, err, "resume")
	}
	metrics.From(ctx).SetPaused(fleetURLs(f), false)
	return &ServersOutput{Servers: len(f), VLLM: describeServers(ctx, f), Attempt: attemptOf(ctx)}, nil
}

// IsPaused asks every server in parallel whether it is paused.
func (a *Activities) IsPaused(ctx context.Context, in ControlInput) (*IsPausedOutput, error) {
	f, err := a.controlFleet(ctx, pipelines.StepIsPaused, &in)
	if err != nil {
		return nil, err
	}
	paused := make([]bool, len(f))
	err = f.Each("is_paused", func(i int, c *vllm.Client) (err error) {
		paused[i], err = c.IsPaused(ctx)
		return err
	})
	if err != nil {
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
	f, err := a.controlFleet(ctx, pipelines.StepWorldSize, &in)
	if err != nil {
		return nil, err
	}
	topo, err := f.WorldSizes(ctx)
	if err != nil {
		return nil, serverError(ctx, err, "world_size")
	}
	return &WorldSizeOutput{WorldSize: topo.WorldSize, Attempt: attemptOf(ctx)}, nil
}

// controlFleet resolves a control step's input and builds its fleet.
func (a *Activities) controlFleet(ctx context.Context, step string, in *ControlInput) (vllm.Fleet, error) {
	if err := resolveArgs(ctx, step, in); err != nil {
		return nil, err
	}
	return a.fleet(ctx, step, in.Context, vllm.Timeouts{Control: in.Timeout.D()})
}

// fleetURLs are the servers' URLs in fleet order.
func fleetURLs(f vllm.Fleet) []string {
	urls := make([]string, len(f))
	for i, c := range f {
		urls[i] = c.URL()
	}
	return urls
}
