package activities

import (
	"context"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
)

// Deps are what the control activities need from their host.
type Deps struct {
	// LogDir receives one log file per exec attempt.
	LogDir string
	// HeartbeatEvery is the longest gap between heartbeats (default 5s; a
	// step's heartbeat timeout shortens it).
	HeartbeatEvery time.Duration
}

// Activities holds the control-worker activities; register it with
// worker.RegisterActivityWithOptions per method, under the step type names.
type Activities struct {
	Deps
}

// New returns the control activities.
func New(d Deps) *Activities { return &Activities{Deps: d} }

// NoopInput is the `with` of a noop step.
type NoopInput struct {
	Context pipelines.StepContext `json:"context"`
	Outputs map[string]any        `json:"outputs,omitempty"`
	Sleep   pipelines.Duration    `json:"sleep,omitempty"`
}

// Noop returns its `outputs` after sleeping `sleep`, heartbeating meanwhile.
func (a *Activities) Noop(ctx context.Context, in NoopInput) (map[string]any, error) {
	if d := in.Sleep.D(); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		tick := time.NewTicker(a.heartbeatEvery(ctx))
		defer tick.Stop()
	wait:
		for {
			select {
			case <-t.C:
				break wait
			case <-tick.C:
				if activity.IsActivity(ctx) {
					activity.RecordHeartbeat(ctx)
				}
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
	}
	out := make(map[string]any, len(in.Outputs)+1)
	for k, v := range in.Outputs {
		out[k] = v
	}
	if activity.IsActivity(ctx) {
		out[pipelines.MetaAttempt] = activity.GetInfo(ctx).Attempt
	}
	return out, nil
}

// LoadPipeline loads and validates a pipeline file on the worker's disk.
func (a *Activities) LoadPipeline(ctx context.Context, path string) (*pipelines.Pipeline, error) {
	p, err := pipelines.LoadFile(path)
	if err != nil {
		return nil, badInput(ctx, "%v", err)
	}
	return p, nil
}
