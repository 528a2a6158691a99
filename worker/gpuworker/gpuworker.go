// Package gpuworker is rlflow's GPU worker: on the trainer's GPU host it
// runs init_transfer and broadcast with the NCCL backend, broadcasting
// checkpoints from its GPU to the vLLM servers (transfer/ncclengine).
//
// Invariants: one process owns one GPU and one NCCL engine, and runs one
// transfer step at a time (a second broadcast would interleave its
// collectives with the first's). It polls two task queues: the shared GPU
// queue, where it answers workflows.AcquireGPUActivity with its own host
// queue, and that host queue, unique to the process, where the transfer
// steps of the runs that acquired it arrive; a restarted worker never
// inherits a dead one's queue. The host queue's worker starts before the
// shared one, so no acquire is answered with a queue nobody polls.
package gpuworker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/cudaipc"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/transfer/ncclengine"
	"github.com/rlflow/rlflow/worker"
	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/temporal"
	sdkworker "go.temporal.io/sdk/worker"
)

// Options configure a GPU worker.
type Options struct {
	// SharedQueue is the task queue every GPU worker polls for
	// workflows.AcquireGPUActivity (default pipelines.DefaultGPUTaskQueue).
	SharedQueue string
	// Host names this machine in the host queue and in GPUHost (default
	// os.Hostname).
	Host string
	// InstanceID tells this process from an earlier one on the same host
	// (default: random), so a restarted worker never inherits a dead one's
	// queue and the steps routed there.
	InstanceID string
	// Device is the CUDA ordinal to use; -1 picks the visible device with
	// the most free memory.
	Device int
	// Advertise is the address the vLLM servers reach this worker's
	// TCPStore at (it binds exactly this address); "" means every
	// init_transfer must give master_address.
	Advertise string
	// NCCLLib and CUDARTLib are the libraries to load ("" = search; the
	// nccl package's environment variables override both).
	NCCLLib, CUDARTLib string
	// FakeNCCL runs the nccltest.Fake TEST DOUBLE instead of NCCL and the
	// GPU: no byte reaches a server. For rlflow's CPU tests only.
	FakeNCCL bool
	// Engine, when set, is the NCCL backend to run instead of the one New
	// builds from the device, NVML and NCCL (tests of the wiring).
	Engine transfer.Engine
	// Getenv reads the servers' API keys (api_key_env) from this worker's
	// environment (default os.Getenv).
	Getenv func(string) string
	// Roots confine the checkpoints broadcast reads (activities.Roots;
	// nil confines nothing).
	Roots *activities.Roots
	// Log receives start-up warnings and facts (default: discarded).
	Log *slog.Logger
	// Metrics observe the transfer steps and acquires (nil: none).
	Metrics *metrics.Metrics
	// Reports keeps each transfer step's result until the server
	// acknowledged it and reports one an outage swallowed, so a finished
	// broadcast is not sent again (activities.Reports; in memory, the GPU
	// worker has no log dir). Its Watch must be on c's connection. Nil:
	// none.
	Reports *activities.Reports
	// TrainerIdle stops a run's resident trainer after this long without a
	// call (its run ended, or moved to another GPU worker); 0 means
	// DefaultTrainerIdle.
	TrainerIdle time.Duration
}

// DefaultTrainerIdle is how long a resident trainer with no call keeps its
// GPU memory: longer than any step a run puts between two trainer calls
// (a generate, an evaluate), short enough that a finished run's trainer
// does not hold the GPU for the next.
const DefaultTrainerIdle = time.Hour

// GPU is a GPU worker: two Temporal workers in one process and the
// engine they share.
type GPU struct {
	Shared    sdkworker.Worker
	Host      sdkworker.Worker
	HostQueue string
	Info      workflows.GPUHost

	close []func() // the trainers, the engine, then NVML
}

// HostQueue is a GPU worker's own task queue: rlflow-gpu/<host>/<instance>.
func HostQueue(shared, host, instance string) string {
	return shared + "/" + host + "/" + instance
}

// New builds (but does not start) a GPU worker: it picks the device, opens
// NVML for its health and loads NCCL (or the fake), unless opts.Engine
// is given.
func New(c client.Client, opts Options) (*GPU, error) {
	if opts.SharedQueue == "" {
		opts.SharedQueue = pipelines.DefaultGPUTaskQueue
	}
	if opts.Host == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("gpuworker: hostname: %w", err)
		}
		opts.Host = h
	}
	if opts.InstanceID == "" {
		var b [6]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("gpuworker: instance id: %w", err)
		}
		opts.InstanceID = hex.EncodeToString(b[:])
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	g := &GPU{HostQueue: HostQueue(opts.SharedQueue, opts.Host, opts.InstanceID)}
	engine, device := opts.Engine, max(opts.Device, 0)
	if engine == nil {
		e, dev, err := g.openEngine(opts)
		if err != nil {
			g.Close()
			return nil, err
		}
		engine, device = e, dev
	}
	g.Info = workflows.GPUHost{TaskQueue: g.HostQueue, Host: opts.Host, Device: device}

	// The resident trainers of the runs this worker serves: started by
	// their first step, on the engine's device (their snapshots are what
	// it broadcasts), stopped when idle and before the engine closes.
	idle := opts.TrainerIdle
	if idle <= 0 {
		idle = DefaultTrainerIdle
	}
	topts := trainer.Options{IdleTimeout: idle, Log: opts.Log}
	if e, ok := engine.(snapshotCloser); ok {
		// A stopped trainer's snapshot mapping would keep its GPU memory.
		topts.OnStop = func(runID string) { _ = e.CloseSnapshot(runID) }
	}
	trainers := trainer.NewManager(topts)
	g.close = append([]func(){func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = trainers.Close(ctx)
	}}, g.close...)

	// The activities build the fleet from the step context (API keys from
	// this worker's environment) and hand it to the engine.
	steps := activities.New(activities.Deps{NCCL: engine, Getenv: opts.Getenv, Roots: opts.Roots, Trainers: trainers, TrainerDevice: device})
	// The API keys are masked in all the steps report; the metrics see
	// each step inside the masking; kept results are the masked ones.
	interceptors := []interceptor.WorkerInterceptor{steps.Interceptor(), opts.Metrics.Interceptor()}
	if opts.Reports != nil {
		opts.Reports.Bind(c, steps, worker.LogKept)
		interceptors = append([]interceptor.WorkerInterceptor{opts.Reports.Interceptor()}, interceptors...)
	}
	g.Host = sdkworker.New(c, g.HostQueue, sdkworker.Options{
		// One communicator, one transfer at a time: a second broadcast
		// would interleave its collectives with the first's.
		MaxConcurrentActivityExecutionSize: 1,
		Interceptors:                       interceptors,
	})
	worker.RegisterTransferActivities(g.Host, steps)

	g.Shared = sdkworker.New(c, opts.SharedQueue, sdkworker.Options{Interceptors: []interceptor.WorkerInterceptor{opts.Metrics.Interceptor()}})
	g.Shared.RegisterActivityWithOptions(g.Acquire, activity.RegisterOptions{Name: workflows.AcquireGPUActivity})
	return g, nil
}

// snapshotCloser is the NCCL engine's release of a run's snapshot mapping.
type snapshotCloser interface{ CloseSnapshot(runID string) error }

// openEngine is the GPU worker's start-up policy: the device, its health,
// NCCL, and the engine over them.
func (g *GPU) openEngine(opts Options) (*ncclengine.Engine, int, error) {
	log := opts.Log
	if err := checkAdvertise(opts.Advertise); err != nil {
		return nil, 0, err
	}
	// CUDA orders devices fastest first by default, NVML by PCI bus: make
	// CUDA ordinals match NVML indices so that health describes the device
	// NCCL uses. Must happen before the CUDA runtime initialises.
	switch order := os.Getenv("CUDA_DEVICE_ORDER"); order {
	case "":
		os.Setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
	case "PCI_BUS_ID":
	default:
		log.Warn("CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA ordinals may not match NVML's, so device selection and health may describe another GPU than NCCL uses", "CUDA_DEVICE_ORDER", order)
	}
	var api nccl.API
	var ipc nccl.IPCImporter
	var mon gpuhealth.Monitor
	var sel Selection
	if opts.FakeNCCL {
		log.Warn("--fake-nccl: NCCL and the GPU are the nccltest.Fake TEST DOUBLE (virtual peers, host memory); no weights reach any server. For rlflow's CPU tests only.")
		fake := nccltest.NewFake(nccltest.Config{VirtualPeers: true, DeviceMemory: 64 << 30})
		api, ipc = fake, fake
		sel = Selection{CUDA: max(opts.Device, 0), NVML: -1}
	} else {
		m, err := gpuhealth.OpenNVML("")
		if err != nil {
			log.Warn("NVML unavailable: no GPU health data (NCCL may still work)", "err", err)
		} else {
			mon = m
			g.close = append(g.close, func() { m.Close() })
		}
		sel, err = Select(mon, opts.Device, os.Getenv("CUDA_VISIBLE_DEVICES"), 0)
		if err != nil {
			return nil, 0, err
		}
		for _, w := range sel.Warnings {
			log.Warn(w)
		}
		lib, err := nccl.Load(nccl.Config{NCCLPath: opts.NCCLLib, CUDARTPath: opts.CUDARTLib})
		if err != nil {
			return nil, 0, err
		}
		api = lib
		// The resident trainers' snapshots arrive as CUDA IPC handles,
		// opened through the runtime nccl loaded.
		if im, err := cudaipc.New(lib); err != nil {
			log.Warn("CUDA IPC unavailable: publish steps (resident trainers) will fail on this worker", "err", err)
		} else {
			ipc = im
		}
		v, _ := lib.NCCLVersion()
		cv, _ := lib.CUDARuntimeVersion()
		log.Info("NCCL loaded", "nccl_version", v, "nccl", lib.NCCLPath(), "cuda_runtime_version", cv, "cudart", lib.CUDARTPath())
	}
	if sel.NVML < 0 {
		mon = nil // no whole-GPU NVML device to ask
	}
	if mon != nil {
		logHealth(log, mon, sel)
	}
	if opts.Advertise == "" {
		log.Warn("no --advertise: every init_transfer step must give master_address, and a broadcast cannot re-initialise a lost group on its own")
	}
	e, err := ncclengine.New(ncclengine.Config{API: api, IPC: ipc, Device: sel.CUDA, Advertise: opts.Advertise, Monitor: mon, MonitorIndex: sel.NVML})
	if err != nil {
		return nil, 0, err
	}
	g.close = append([]func(){func() { e.Close() }}, g.close...)
	log.Info("GPU selected", "device", sel.CUDA, "gpu", sel.Info.Name, "uuid", sel.Info.UUID, "memory_free", sel.Info.MemoryFree,
		"advertise", opts.Advertise, "fake_nccl", opts.FakeNCCL)
	return e, sel.CUDA, nil
}

// logHealth reports the selected device's health at start-up.
func logHealth(log *slog.Logger, mon gpuhealth.Monitor, sel Selection) {
	h, err := mon.Health(sel.NVML)
	switch {
	case err != nil:
		log.Warn("GPU health unavailable", "err", err)
	case len(h.Problems) > 0:
		log.Warn("GPU health problems", "device", sel.CUDA, "problems", h.Problems)
	default:
		log.Info("GPU healthy", "device", sel.CUDA, "ecc_uncorrected", h.ECCUncorrected, "retired_pages", h.RetiredPages, "remapped_rows_uncorrectable", h.RemappedUncorrected)
	}
	if sel.Info.MemoryFree < ncclengine.DefaultStagingNeed {
		log.Warn("little free device memory for the staging buffers", "free", sel.Info.MemoryFree, "default_need", ncclengine.DefaultStagingNeed)
	}
}

// checkAdvertise refuses addresses the servers cannot connect to: the
// TCPStore binds exactly this address, and vLLM is told the same one.
func checkAdvertise(addr string) error {
	if addr == "" {
		return nil
	}
	if ip := net.ParseIP(addr); ip != nil && ip.IsUnspecified() {
		return errors.New("--advertise: the TCPStore binds exactly this address and the vLLM servers connect to it, so it must be one they can reach, not " + addr)
	}
	return nil
}

// Acquire is workflows.AcquireGPUActivity: it answers with this process's
// host queue. Any GPU worker may answer; the run then sticks to it. A
// worker the run just lost (its device or communicator gone, so the
// interpreter moved the step away) refuses: it is alive and polls, and
// answering would hand the step back to the GPU that failed it. The retry
// goes to another GPU worker, or the acquire fails naming this one.
func (g *GPU) Acquire(ctx context.Context, in workflows.GPUAcquireInput) (workflows.GPUHost, error) {
	if in.Lost != "" && in.Lost == g.Info.TaskQueue {
		return workflows.GPUHost{}, temporal.NewApplicationError(
			fmt.Sprintf("GPU worker %s (device %d, task queue %s) was lost to run %s; another GPU worker must take the run", g.Info.Host, g.Info.Device, g.Info.TaskQueue, in.RunID),
			pipelines.ErrTypeGPUWorkerLost)
	}
	return g.Info, nil
}

// Start starts the host queue's worker first, so that no acquire is
// answered with a queue nobody polls yet.
func (g *GPU) Start() error {
	if err := g.Host.Start(); err != nil {
		return fmt.Errorf("gpuworker: host queue %s: %w", g.HostQueue, err)
	}
	if err := g.Shared.Start(); err != nil {
		g.Host.Stop()
		return fmt.Errorf("gpuworker: shared GPU queue: %w", err)
	}
	return nil
}

// Stop stops answering acquires first, then the transfer steps, then
// closes the engine (communicators, pinned memory) and NVML.
func (g *GPU) Stop() {
	g.Shared.Stop()
	g.Host.Stop()
	g.Close()
}

// Close releases the engine and NVML; Stop calls it.
func (g *GPU) Close() {
	for _, c := range g.close {
		c()
	}
	g.close = nil
}
