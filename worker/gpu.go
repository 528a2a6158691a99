package worker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	sdkworker "go.temporal.io/sdk/worker"
)

// GPUOptions configure a GPU worker.
type GPUOptions struct {
	// SharedQueue is the task queue every GPU worker polls for
	// workflows.AcquireGPUActivity (default workflows.DefaultGPUTaskQueue).
	SharedQueue string
	// Host names this machine in the host queue and in GPUHost (default
	// os.Hostname).
	Host string
	// InstanceID tells this process from an earlier one on the same host
	// (default: random, drawn by NewGPU), so a restarted worker never
	// inherits a dead one's queue and the steps routed there.
	InstanceID string
	// Device is the CUDA ordinal reported in GPUHost.
	Device int
	// NCCL runs init_transfer and broadcast (a *gpu.Transfer).
	NCCL activities.NCCLTransfer
	// Getenv reads the servers' API keys (api_key_env) from this worker's
	// environment (default os.Getenv).
	Getenv func(string) string
}

// GPU is a GPU worker: two Temporal workers in one process. Shared polls
// the shared GPU queue and answers AcquireGPUActivity with HostQueue; Host
// polls HostQueue and runs the transfer steps, one at a time, because the
// process owns one communicator per transfer group and one GPU.
type GPU struct {
	Shared    sdkworker.Worker
	Host      sdkworker.Worker
	HostQueue string
	Info      workflows.GPUHost
}

// HostQueue is a GPU worker's own task queue: rlflow-gpu/<host>/<instance>.
func HostQueue(shared, host, instance string) string {
	return shared + "/" + host + "/" + instance
}

// NewGPU builds (but does not start) a GPU worker.
func NewGPU(c client.Client, opts GPUOptions) (*GPU, error) {
	if opts.NCCL == nil {
		return nil, errors.New("worker: GPUOptions.NCCL is required")
	}
	if opts.SharedQueue == "" {
		opts.SharedQueue = workflows.DefaultGPUTaskQueue
	}
	if opts.Host == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("worker: hostname: %w", err)
		}
		opts.Host = h
	}
	if opts.InstanceID == "" {
		var b [6]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("worker: instance id: %w", err)
		}
		opts.InstanceID = hex.EncodeToString(b[:])
	}
	if opts.Getenv == nil {
		opts.Getenv = os.Getenv
	}
	g := &GPU{HostQueue: HostQueue(opts.SharedQueue, opts.Host, opts.InstanceID)}
	g.Info = workflows.GPUHost{TaskQueue: g.HostQueue, Host: opts.Host, Device: opts.Device}

	g.Host = sdkworker.New(c, g.HostQueue, sdkworker.Options{
		// One communicator, one transfer at a time: a second broadcast
		// would interleave its collectives with the first's.
		MaxConcurrentActivityExecutionSize: 1,
	})
	// The activities package builds the fleet from the step context (API
	// keys from this worker's environment) and hands it to the NCCL path.
	RegisterTransferActivities(g.Host, activities.New(activities.Deps{NCCL: opts.NCCL, Getenv: opts.Getenv}))

	g.Shared = sdkworker.New(c, opts.SharedQueue, sdkworker.Options{})
	g.Shared.RegisterActivityWithOptions(g.Acquire, activity.RegisterOptions{Name: workflows.AcquireGPUActivity})
	return g, nil
}

// Acquire is workflows.AcquireGPUActivity: it answers with this process's
// host queue. Any GPU worker may answer; the run then sticks to it.
func (g *GPU) Acquire(ctx context.Context, in workflows.GPUAcquireInput) (workflows.GPUHost, error) {
	return g.Info, nil
}

// Start starts the host queue's worker first, so that no acquire is
// answered with a queue nobody polls yet.
func (g *GPU) Start() error {
	if err := g.Host.Start(); err != nil {
		return fmt.Errorf("worker: host queue %s: %w", g.HostQueue, err)
	}
	if err := g.Shared.Start(); err != nil {
		g.Host.Stop()
		return fmt.Errorf("worker: shared GPU queue: %w", err)
	}
	return nil
}

// Stop stops answering acquires first, then the transfer steps.
func (g *GPU) Stop() {
	g.Shared.Stop()
	g.Host.Stop()
}

// TransferSteps are the init_transfer and broadcast activities.
type TransferSteps interface {
	InitTransfer(ctx context.Context, in activities.InitTransferInput) (*activities.InitTransferOutput, error)
	Broadcast(ctx context.Context, in activities.BroadcastInput) (*activities.BroadcastOutput, error)
}

// RegisterTransferActivities registers the transfer steps under their step
// type names.
func RegisterTransferActivities(r sdkworker.ActivityRegistry, s TransferSteps) {
	r.RegisterActivityWithOptions(s.InitTransfer, activity.RegisterOptions{Name: pipelines.StepInitTransfer})
	r.RegisterActivityWithOptions(s.Broadcast, activity.RegisterOptions{Name: pipelines.StepBroadcast})
}
