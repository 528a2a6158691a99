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
// times, which is what lets the copy keep up with PCIe Gen5.
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
//     Device's) actor thread; host copies (and prefaulting, if asked for)
//     run on ordinary goroutines, and the copies touch only pinned host
//     memory that no copy in flight reads.
//   - After a failure whose copies could not be drained, the device
//     buffers and pinned slots stay allocated (the GPU may still use them)
//     and the pipeline refuses every later run.
//   - Every wait polls and watches the context and the communicator's
//     asynchronous error. Any failure in broadcast mode aborts the
//     communicator: the receivers would otherwise wait forever for the rest
//     of the sequence.
//
// The package never logs; errors are lowercase and wrapped with context.
package staging
