// Package staging streams a safetensors checkpoint to the GPU and out over
// NCCL in vLLM's wire order: mmap'd tensor bytes are copied (and optionally
// converted, F32 -> BF16 for instance) into one of N pinned host buffers by
// parallel goroutines, copied host-to-device on a copy stream into one of N
// device buffers, and broadcast from there on the communicator's stream,
// so that chunk k is on the wire while chunk k+1 is being staged. Inside a
// chunk the host-to-device copy proceeds in windows (Options.WindowBytes)
// that start as soon as their bytes are staged, so a large chunk does not
// wait for its whole host copy. ModeRegister skips the host copy: it
// page-locks the read-only mapping in place (cudaHostRegister, ReadOnly),
// segment by segment on helper threads, copies to the device straight from
// it and unregisters each segment once the copies reading it completed;
// conversions and failed registrations fall back to the pinned buffers.
// DefaultOptions holds the strategy a zero Options gets.
//
// Invariants:
//
//   - The wire sequence is exactly the layout's: one ncclBroadcast per
//     chunk, in order, each of the chunk's dtype and element count (packed
//     chunks are Uint8, tensors back to back without padding). Receivers
//     issue one broadcast per chunk, so a chunk is never split: buffers are
//     at least as large as the largest chunk.
//   - Buffer slot i is reused for chunk k+N only after its previous
//     contents left: the host buffer once the host-to-device copy of chunk
//     k completed (host-side wait on an event), the device buffer once the
//     broadcast of chunk k completed (stream-side wait, cudaStreamWaitEvent,
//     so the GPU does not stall the host).
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
