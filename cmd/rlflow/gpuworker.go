package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/rlflow/rlflow/gpu"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker"
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
	fl.StringVar(&f.queue, "gpu-task-queue", envOr("RLFLOW_GPU_TASK_QUEUE", "rlflow-gpu"), "shared task queue GPU workers poll for gpu_acquire (env RLFLOW_GPU_TASK_QUEUE)")
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

// defaultStagingNeed is what the staging buffers take with vLLM's packed
// defaults (2 x 1 GiB) plus the pipeline's margin: below it, a broadcast
// with the defaults will not fit.
const defaultStagingNeed = plan.DefaultNumBuffers*plan.DefaultBufferSizeBytes + 256<<20

func runGPUWorker(ctx context.Context, g *globalFlags, f gpuFlags) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := checkAdvertise(f.advertise); err != nil {
		return err
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
	var mon gpu.Monitor
	var sel gpu.Selection
	if f.fakeNCCL {
		log.Warn("--fake-nccl: NCCL and the GPU are the nccltest.Fake TEST DOUBLE (virtual peers, host memory); no weights reach any server. For rlflow's CPU tests only.")
		api = nccltest.NewFake(nccltest.Config{VirtualPeers: true, DeviceMemory: 64 << 30})
		sel = gpu.Selection{CUDA: max(f.device, 0), NVML: -1}
	} else {
		m, err := gpu.OpenNVML("")
		if err != nil {
			log.Warn("NVML unavailable: no GPU health data (NCCL may still work)", "err", err)
		} else {
			mon = m
			defer m.Close()
		}
		sel, err = gpu.Select(mon, f.device, os.Getenv("CUDA_VISIBLE_DEVICES"), 0)
		if err != nil {
			return err
		}
		for _, w := range sel.Warnings {
			log.Warn(w)
		}
		lib, err := nccl.Load(nccl.Config{NCCLPath: f.ncclLib, CUDARTPath: f.cudartLib})
		if err != nil {
			return err
		}
		api = lib
		v, _ := lib.NCCLVersion()
		cv, _ := lib.CUDARuntimeVersion()
		log.Info("NCCL loaded", "nccl_version", v, "nccl", lib.NCCLPath(), "cuda_runtime_version", cv, "cudart", lib.CUDARTPath())
	}
	if sel.NVML < 0 {
		mon = nil // no whole-GPU NVML device to ask
	}
	if mon != nil {
		h, err := mon.Health(sel.NVML)
		switch {
		case err != nil:
			log.Warn("GPU health unavailable", "err", err)
		case len(h.Problems) > 0:
			log.Warn("GPU health problems", "device", sel.CUDA, "problems", h.Problems)
		default:
			log.Info("GPU healthy", "device", sel.CUDA, "ecc_uncorrected", h.ECCUncorrected, "retired_pages", h.RetiredPages, "remapped_rows_uncorrectable", h.RemappedUncorrected)
		}
		if sel.Info.MemoryFree < defaultStagingNeed {
			log.Warn("little free device memory for the staging buffers", "free", sel.Info.MemoryFree, "default_need", int64(defaultStagingNeed))
		}
	}
	if f.advertise == "" {
		log.Warn("no --advertise: every init_transfer step must give master_address, and a broadcast cannot re-initialise a lost group on its own")
	}

	tr, err := gpu.New(gpu.Config{API: api, Device: sel.CUDA, Advertise: f.advertise, Monitor: mon, MonitorIndex: sel.NVML})
	if err != nil {
		return err
	}
	defer tr.Close()
	c, err := runs.Connect(ctx, g.address, g.namespace)
	if err != nil {
		return err
	}
	defer c.Close()
	w, err := worker.NewGPU(c, worker.GPUOptions{SharedQueue: f.queue, Device: sel.CUDA, NCCL: tr})
	if err != nil {
		return err
	}
	if err := w.Start(); err != nil {
		return fmt.Errorf("starting GPU worker: %w", err)
	}
	log.Info("rlflow GPU worker running", "address", g.address, "namespace", g.namespace, "gpu_task_queue", f.queue,
		"host_queue", w.HostQueue, "device", sel.CUDA, "gpu", sel.Info.Name, "uuid", sel.Info.UUID,
		"memory_free", sel.Info.MemoryFree, "advertise", f.advertise, "fake_nccl", f.fakeNCCL, "pid", os.Getpid())
	<-ctx.Done()
	w.Stop()
	return nil
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
