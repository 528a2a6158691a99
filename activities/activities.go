package activities

import (
	"context"
	"net/http"
	"sync"
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
	// DataDir receives the files of generate and evaluate steps that set no
	// output path: <DataDir>/<run>/iter-<n>/<step>/.
	DataDir string
	// Getenv reads the worker's environment (the servers' api_key_env);
	// nil means os.Getenv. Secrets never come from step input.
	Getenv func(string) string
	// HTTPClient carries every request to the vLLM servers and scorers;
	// nil means one shared client sized for MaxConcurrency connections per
	// server (vllm.NewHTTPClient).
	HTTPClient *http.Client
	// NCCL is the GPU worker's NCCL weight path; nil on control workers,
	// where init_transfer and broadcast with the nccl backend fail at once.
	NCCL NCCLTransfer
}

// Activities holds the control-worker activities; register it with
// worker.RegisterActivityWithOptions per method, under the step type names.
type Activities struct {
	Deps

	httpOnce sync.Once
	http     *http.Client

	// diskInit remembers the (run, server set) pairs whose disk transfer
	// engine this process initialised, so broadcast initialises on first use
	// (and again after a worker restart) without an init_transfer step.
	diskMu   sync.Mutex
	diskInit map[string]bool
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
