package staging

import (
	"runtime"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// DefaultOptions supplies every zero field of Options. It is the one place
// to change the staging strategy: TestGPUBenchStage sweeps the candidates on
// the GPU host and prints the best one (GPU-FIGURE stage BEST ...).
var DefaultOptions = Options{
	Buffers: 2,
	// CopyWorkers 0: GOMAXPROCS, at most 16 (see withDefaults).
	// A 64 MiB ring of 4 MiB slots, each filled by four workers in 1 MiB
	// parts: the best and steadiest candidate of the sweep. Slots filled by
	// one worker each did worse, larger single copies run closer to the
	// pinned ceiling, and larger rings were as good on one host and far
	// worse on another. When other tenants load the host's memory, every
	// candidate falls alike. The figures are in nccl/GPU-RESULTS.md.
	SplitBytes:      1 << 20,
	WindowBytes:     4 << 20,
	PinnedBytes:     64 << 20,
	HostAllocFlags:  nccl.HostAllocPortable,
	PrefaultWorkers: 0, // none: prefaulting gained nothing in the sweep
	DeviceMargin:    256 << 20,
	CleanupTimeout:  30 * time.Second,
}

// Options tune a Stager. Zero values take DefaultOptions' values.
type Options struct {
	// Buffers is the number of device buffers N, each as large as the
	// largest chunk (default 2: chunk k is broadcast while chunk k+1 is
	// staged).
	Buffers int
	// CopyWorkers is the number of goroutines per host copy (default
	// GOMAXPROCS, at most 16: in the sweep, fewer workers than the host's
	// cores did no better, see nccl/GPU-RESULTS.md).
	CopyWorkers int
	// SplitBytes bounds one host-copy job: tensors are cut at element
	// boundaries into parts of at most min(SplitBytes, WindowBytes) bytes
	// (default 1 MiB: four workers fill a default window together, so a
	// window is ready sooner after its slot is taken).
	SplitBytes int64
	// WindowBytes is the granularity of the host-to-device copies inside a
	// chunk (default 4 MiB): the host copy fills pinned slots of this size
	// and each is copied to the device as soon as it is filled. Negative:
	// one copy per chunk.
	WindowBytes int64
	// PinnedBytes is the pinned host memory of the host copy (default 64
	// MiB): a ring of max(PinnedBytes / WindowBytes, 2) slots of
	// WindowBytes (of the largest chunk for whole-chunk windows), each
	// reused once its host-to-device copy completed. Slots small enough to
	// still be in the CPU's cache when the copy engine reads them are what
	// makes the host copy fast: the bytes cross DRAM once, not three times.
	PinnedBytes int64
	// HostAllocFlags for cudaHostAlloc (default nccl.HostAllocPortable;
	// adding nccl.HostAllocWriteCombined is a candidate of the sweep).
	HostAllocFlags uint
	// PrefaultWorkers > 0 populates the mapping's page tables ahead of use
	// with madvise(MADV_POPULATE_READ): that many goroutines run ahead of
	// the copy workers. Default 0, negative: none.
	PrefaultWorkers int
	// DeviceMargin is device memory left free besides the buffers (default
	// 256 MiB): CUDA and NCCL allocate lazily too.
	DeviceMargin int64
	// CleanupTimeout bounds the wait for in-flight copies before buffers
	// are freed after a failure (default 30s).
	CleanupTimeout time.Duration
	// Progress, if set, is called on Broadcast's goroutine each time a
	// broadcast is known to have completed, with the bytes of this run's
	// chunks completed so far: what a caller heartbeats while a long
	// transfer runs. It must not block.
	Progress func(sent int64)
}

func (o Options) withDefaults() Options {
	d := DefaultOptions
	if o.Buffers <= 0 {
		o.Buffers = max(d.Buffers, 1)
	}
	if o.CopyWorkers <= 0 {
		o.CopyWorkers = d.CopyWorkers
	}
	if o.CopyWorkers <= 0 {
		o.CopyWorkers = min(runtime.GOMAXPROCS(0), 16)
	}
	if o.SplitBytes <= 0 {
		o.SplitBytes = max(d.SplitBytes, 1)
	}
	if o.WindowBytes == 0 {
		o.WindowBytes = d.WindowBytes
	}
	if o.PinnedBytes <= 0 {
		o.PinnedBytes = max(d.PinnedBytes, 1)
	}
	if o.HostAllocFlags == 0 {
		o.HostAllocFlags = d.HostAllocFlags
	}
	if o.PrefaultWorkers == 0 {
		o.PrefaultWorkers = d.PrefaultWorkers
	}
	if o.DeviceMargin <= 0 {
		o.DeviceMargin = d.DeviceMargin
	}
	if o.CleanupTimeout <= 0 {
		o.CleanupTimeout = d.CleanupTimeout
	}
	return o
}
