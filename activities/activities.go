// Package activities implements rlflow's step types as Temporal activities,
// registered under the step type's name (pipelines.Step.Uses).
//
// Invariants: each activity takes one Input struct (the rendered `with`
// values plus the pipelines.StepContext under "context") whose fields match
// the step type's ArgSpecs in the pipelines registry (a test holds them
// together), and first resolves it against that registry: unset arguments
// take the registry's defaults, set ones are checked against its ranges. It
// returns one Output struct whose JSON keys are the step's outputs; keys
// starting with "_" are metadata and never outputs. Errors are
// ApplicationErrors typed from pipelines.ErrorTypes; the non-retryable ones
// fail a step at once whatever its retry policy. Both weight-transfer
// backends go through one path (transfer.Engine). Dependencies (paths,
// environment, the NCCL engine) come in through Deps, never from globals.
package activities

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/redact"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer"
	"go.temporal.io/sdk/activity"
)

// Deps are what the activities need from their host.
type Deps struct {
	// LogDir receives one log file per exec attempt.
	LogDir string
	// HeartbeatEvery is the longest gap between heartbeats (default 5s; a
	// step's heartbeat timeout shortens it).
	HeartbeatEvery time.Duration
	// DataDir receives the files of generate and evaluate steps that set no
	// output path: <DataDir>/<run>/iter-<n>/<step>/.
	DataDir string
	// Getenv reads the worker's environment (the servers' api_key_env,
	// exec steps' secrets); nil means os.Getenv. Secrets never come from
	// step input.
	Getenv func(string) string
	// Environ lists the worker's environment, which exec commands get
	// part (ExecEnvMinimal) or all (ExecEnvInherit) of; nil means
	// os.Environ.
	Environ func() []string
	// ExecEnv is how much of the worker's environment exec commands get
	// ("" means ExecEnvMinimal).
	ExecEnv ExecEnv
	// HTTPClient carries every request to the vLLM servers and scorers;
	// nil means one shared client sized for pipelines.MaxConcurrency
	// connections per server (vllm.NewHTTPClient).
	HTTPClient *http.Client
	// Roots are the directories every path a pipeline names must resolve
	// inside (paths.go); nil confines nothing, for programs that trust
	// every spec. The rlflow worker commands always set them.
	Roots *Roots
	// NCCL is the GPU worker's NCCL backend (transfer/ncclengine); nil on
	// control workers, where init_transfer and broadcast with the nccl
	// backend fail at once with NoGPUWorker (the interpreter routes them
	// to a GPU worker).
	NCCL transfer.Engine
	// Trainers run the resident trainers of the runs this GPU worker
	// serves; nil on control workers, where the trainer steps fail at once
	// with NoGPUWorker. TrainerDevice is the CUDA ordinal they use (the
	// NCCL engine's, so the snapshot is on the broadcasting device).
	Trainers      *trainer.Manager
	TrainerDevice int
}

// Activities holds the activities; register each method under its step
// type's name (package worker does).
type Activities struct {
	Deps

	httpOnce sync.Once
	http     *http.Client

	// disk is the disk backend, which any worker runs.
	disk *transfer.Disk
	// ipc is the ipc backend; its publishes need the trainer, so they run
	// on the GPU worker that hosts it.
	ipc *transfer.IPC

	// execs are the exec commands this worker process runs (attempts.go).
	execs execTable

	// secrets are every secret value this worker read (secrets.go).
	secrets *redact.Masker
}

// New returns the activities.
func New(d Deps) *Activities {
	return &Activities{Deps: d, disk: transfer.NewDisk(), ipc: transfer.NewIPC(), secrets: redact.New()}
}

// NoopInput is the `with` of a noop step.
type NoopInput struct {
	Context pipelines.StepContext `json:"context"`
	Outputs map[string]any        `json:"outputs,omitempty"`
	Sleep   pipelines.Duration    `json:"sleep,omitempty"`
}

// Noop returns its `outputs` after sleeping `sleep`, heartbeating meanwhile.
func (a *Activities) Noop(ctx context.Context, in NoopInput) (map[string]any, error) {
	if err := resolveArgs(ctx, pipelines.StepNoop, &in); err != nil {
		return nil, err
	}
	if d := in.Sleep.D(); d > 0 {
		stop := a.keepHeartbeating(ctx)
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
		stop()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
	out := make(map[string]any, len(in.Outputs)+1)
	for k, v := range in.Outputs {
		out[k] = v
	}
	if activity.IsActivity(ctx) {
		out[pipelines.MetaAttempt] = attemptOf(ctx)
	}
	return out, nil
}

// LoadPipeline loads and validates a pipeline file on the worker's disk: a
// regular file inside the worker's roots, whose base_dir lies inside them
// too. A relative path is relative to the worker's working directory.
func (a *Activities) LoadPipeline(ctx context.Context, path string) (*pipelines.Pipeline, error) {
	file, err := a.Roots.Resolve("spec_path", "", path)
	if err != nil {
		return nil, badInput(ctx, "%v", err)
	}
	p, err := pipelines.LoadFile(file)
	if err != nil {
		return nil, badInput(ctx, "%v", err)
	}
	if _, err := a.Roots.Resolve("base_dir", "", p.BaseDir); err != nil {
		return nil, badInput(ctx, "%s: %v", file, err)
	}
	return p, nil
}
