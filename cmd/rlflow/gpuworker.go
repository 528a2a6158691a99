package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker/gpuworker"
	"github.com/spf13/cobra"
)

// gpuFlags are rlflow worker's --gpu mode flags.
type gpuFlags struct {
	enabled   bool
	device    int
	advertise string
	ncclLib   string
	cudartLib string
	queue     string
	fakeNCCL  bool
}

func (f *gpuFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.BoolVar(&f.enabled, "gpu", false, "run a GPU worker (init_transfer and broadcast over NCCL) instead of a control worker")
	fl.IntVar(&f.device, "gpu-device", envInt("RLFLOW_GPU_DEVICE", -1), "CUDA device of the GPU worker; -1 picks the visible one with the most free memory (env RLFLOW_GPU_DEVICE)")
	fl.StringVar(&f.advertise, "advertise", os.Getenv("RLFLOW_ADVERTISE"), "address the trainer's TCPStore binds (exactly) and the vLLM servers connect to; without it every init_transfer step must give master_address (env RLFLOW_ADVERTISE)")
	fl.StringVar(&f.ncclLib, "nccl-lib", "", "libnccl to load (env "+nccl.EnvNCCLLib+" overrides; default: search)")
	fl.StringVar(&f.cudartLib, "cudart-lib", "", "CUDA runtime to load (env "+nccl.EnvCUDARTLib+" overrides; default: search)")
	fl.StringVar(&f.queue, "gpu-task-queue", envOr("RLFLOW_GPU_TASK_QUEUE", pipelines.DefaultGPUTaskQueue), "shared task queue GPU workers poll for gpu_acquire (env RLFLOW_GPU_TASK_QUEUE)")
	fl.BoolVar(&f.fakeNCCL, "fake-nccl", false, "TEST DOUBLE: simulate NCCL and the GPU in memory (nccltest.Fake with virtual peers); no byte reaches a server; for rlflow's CPU tests only")
	_ = fl.MarkHidden("fake-nccl")
}

func envInt(key string, def int) int {
	var v int
	if _, err := fmt.Sscan(os.Getenv(key), &v); err == nil {
		return v
	}
	return def
}

func runGPUWorker(ctx context.Context, g *globalFlags, f gpuFlags) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	c, err := runs.Connect(ctx, g.address, g.namespace)
	if err != nil {
		return err
	}
	defer c.Close()
	w, err := gpuworker.New(c, gpuworker.Options{SharedQueue: f.queue, Device: f.device, Advertise: f.advertise,
		NCCLLib: f.ncclLib, CUDARTLib: f.cudartLib, FakeNCCL: f.fakeNCCL, Log: log})
	if err != nil {
		return err
	}
	if err := w.Start(); err != nil {
		w.Close()
		return fmt.Errorf("starting GPU worker: %w", err)
	}
	log.Info("rlflow GPU worker running", "address", g.address, "namespace", g.namespace, "gpu_task_queue", f.queue,
		"host_queue", w.HostQueue, "device", w.Info.Device, "pid", os.Getpid())
	<-ctx.Done()
	w.Stop()
	return nil
}
