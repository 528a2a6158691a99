// Package staging streams a safetensors checkpoint to the GPU and out over
// NCCL in vLLM's wire order: mmap'd tensor bytes are copied (and optionally
// converted, F32 -> BF16 for instance) by parallel goroutines into a ring
// of small pinned host slots (Options.WindowBytes each, Options.PinnedBytes
// in all), each slot copied host-to-device on a copy stream into its place
// in one of N device buffers as soon as it is filled and reused once that
// copy completed; chunks are broadcast from the device buffers on the
// communicator's stream, so that chunk k is on the wire while chunk k+1 is
// being staged. Slots of a few MiB are still in the CPU's cache when the
// copy engine reads them: the staged bytes cross DRAM once instead of three
// times, which is what lets the copy keep up with PCIe Gen5. ModeRegister
// skips the host copy: it page-locks the read-only mapping in place
// (cudaHostRegister, ReadOnly), segment by segment on helper threads,
// copies to the device straight from it and unregisters each segment once
// the copies reading it completed; conversions and failed registrations
// fall back to the pinned ring.
// DefaultOptions holds the strategy a zero Options gets.
//
// Invariants:
//
//   - The wire sequence is exactly the layout's: one ncclBroadcast per
//     chunk, in order, each of the chunk's dtype and element count (packed
//     chunks are Uint8, tensors back to back without padding). Receivers
//     issue one broadcast per chunk, so a chunk is never split: buffers are
//     at least as large as the largest chunk.
//   - Device buffer i is reused for chunk k+N only after the broadcast of
//     chunk k completed (stream-side wait, cudaStreamWaitEvent, so the GPU
//     does not stall the host). A pinned slot is refilled only after the
//     event recorded behind its host-to-device copy completed (polled by the
//     goroutine that issues the copies, with the communicator's health in
//     broadcast mode: a copy queued behind a broadcast whose peer died ends
//     the transfer with NCCL's error, not a hang).
//   - All CUDA and NCCL calls run on the communicator's (or the stage-only
//     Device's) actor thread, except cudaHostRegister/Unregister and the
//     event queries that gate an unregistration, which run on the
//     pipeline's own helper Devices (their own locked threads, same
//     device); host copies run on ordinary goroutines and touch only pinned
//     host memory that no copy in flight reads.
//   - A registered segment is unregistered only after the event following
//     the last copy that reads it completed, and never while the copy
//     stream could not be drained after a failure (it stays registered,
//     like the device buffers then).
//   - Every wait polls and watches the context and the communicator's
//     asynchronous error. Any failure in broadcast mode aborts the
//     communicator: the receivers would otherwise wait forever for the rest
//     of the sequence.
//
// The package never logs; errors are lowercase and wrapped with context.
package staging
