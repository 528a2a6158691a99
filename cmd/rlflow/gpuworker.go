package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/pipelines"
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
	// envErr is a malformed RLFLOW_GPU_DEVICE, reported when the GPU
	// worker starts rather than replaced by the default.
	envErr error
}

func (f *gpuFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.BoolVar(&f.enabled, "gpu", false, "run a GPU worker (init_transfer and broadcast over NCCL) instead of a control worker")
	device, err := envInt("RLFLOW_GPU_DEVICE", -1)
	f.envErr = err
	fl.IntVar(&f.device, "gpu-device", device, "CUDA device of the GPU worker; -1 picks the visible one with the most free memory (env RLFLOW_GPU_DEVICE)")
	fl.StringVar(&f.advertise, "advertise", os.Getenv("RLFLOW_ADVERTISE"), "address the trainer's TCPStore binds (exactly) and the vLLM servers connect to; without it every init_transfer step must give master_address (env RLFLOW_ADVERTISE)")
	fl.StringVar(&f.ncclLib, "nccl-lib", "", "libnccl to load (env "+nccl.EnvNCCLLib+" overrides; default: search)")
	fl.StringVar(&f.cudartLib, "cudart-lib", "", "CUDA runtime to load (env "+nccl.EnvCUDARTLib+" overrides; default: search)")
	fl.StringVar(&f.queue, "gpu-task-queue", envOr("RLFLOW_GPU_TASK_QUEUE", pipelines.DefaultGPUTaskQueue), "shared task queue GPU workers poll for gpu_acquire (env RLFLOW_GPU_TASK_QUEUE)")
	fl.BoolVar(&f.fakeNCCL, "fake-nccl", false, "TEST DOUBLE: simulate NCCL and the GPU in memory (nccltest.Fake with virtual peers); no byte reaches a server; for rlflow's CPU tests only")
	_ = fl.MarkHidden("fake-nccl")
}

// envInt is the integer in the environment variable key, def where it is
// unset; a value that is not an integer is an error, never the default.
func envInt(key string, def int) (int, error) {
	s := os.Getenv(key)
	if s == "" {
		return def, nil
	}
	v, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return def, fmt.Errorf("%s=%q: not an integer", key, s)
	}
	return v, nil
}

func runGPUWorker(ctx context.Context, g *globalFlags, f gpuFlags, cf connectFlags, roots *activities.Roots, m *metrics.Metrics, log *slog.Logger) error {
	if f.envErr != nil {
		return f.envErr
	}
	reports := activities.NewReports()
	defer reports.Close()
	c, err := dialWorker(ctx, g, cf, m, log, reports.Watch)
	if err != nil || c == nil {
		return err
	}
	defer c.Close()
	w, err := gpuworker.New(c, gpuworker.Options{SharedQueue: f.queue, Device: f.device, Advertise: f.advertise,
		NCCLLib: f.ncclLib, CUDARTLib: f.cudartLib, FakeNCCL: f.fakeNCCL, Roots: roots, Log: log, Metrics: m, Reports: reports})
	if err != nil {
		return err
	}
	if err := w.Start(); err != nil {
		w.Close()
		return fmt.Errorf("starting GPU worker: %w", err)
	}
	log.Info("rlflow GPU worker running", "address", g.address, "namespace", g.namespace, "gpu_task_queue", f.queue,
		"host_queue", w.HostQueue, "device", w.Info.Device, "roots", roots.String(), "pid", os.Getpid())
	<-ctx.Done()
	w.Stop()
	return nil
}
