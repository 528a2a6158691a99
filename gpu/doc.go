// Package gpu is the GPU worker's side of rlflow's NCCL weight path: Transfer
// implements activities.NCCLTransfer (init_transfer and broadcast) over
// nccl/staging, and Monitor reads the GPU's inventory and health through
// NVML (go-nvml, dlopen'd at Init).
//
// Invariants:
//
//   - One transfer group per (run id, server list with generation pins): a
//     communicator (rank 0), the group's topology and a staging pipeline of
//     pinned buffers, reused across iterations. A vLLM worker holds a single
//     communicator, so initialising a group closes every other group that
//     shares a server with it. Before a group allocates staging buffers,
//     the buffers of every idle group are freed, so a long-lived worker
//     holds pinned memory for the groups in use, not for every past run.
//   - A group is re-initialised when it is missing or its communicator is
//     poisoned (nccl.Comm.Err), and after every failed broadcast that
//     poisoned it: an NCCL failure is never retried on the same communicator.
//     Every (re)initialisation binds a fresh TCPStore port.
//   - The update_info sent to the servers and the broadcasts come from the
//     same staging.Update, so metadata and bytes cannot disagree.
//   - Nothing waits without a way out: an HTTP failure during a broadcast
//     aborts the communicator at once, an NCCL failure cancels the HTTP
//     calls, and the whole update runs under a deadline (update_timeout, or
//     one that scales with the checkpoint). After a failure, every server
//     whose update session was opened is asked to close it (best effort,
//     bounded), so no server is left mid-update.
//   - Errors are Temporal ApplicationErrors typed with the activities
//     package's constants: BadInput (non-retryable) for arguments and
//     checkpoints that can never work, NCCLError and ServerError
//     (retryable) for the transport; a cancelled context is returned as is.
//
// The package never logs; progress and device health go to the activity
// heartbeat, problems into the errors.
package gpu
