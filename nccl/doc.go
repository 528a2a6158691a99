// Package nccl binds NCCL and the CUDA runtime for rlflow's trainer side of a
// vLLM weight transfer, and runs communicators as thread-owning actors.
//
// The libraries are opened with dlopen at Load time (no CUDA or NCCL headers
// or libraries are needed to build), so one binary builds on any Linux
// machine and runs wherever libnccl.so.2 and libcudart.so.* are installed.
// Everything the higher layers need is behind the API interface: *Library is
// the real implementation; the test double that simulates devices, streams,
// events and NCCL groups in host memory is *nccltest.Fake
// (nccltest.NewFake(nccltest.Config{...}), package nccl/nccltest).
//
// Invariants:
//
//   - The current CUDA device is per OS thread, so API methods are only ever
//     called from a goroutine locked to its OS thread with
//     runtime.LockOSThread on which SetDevice ran first. Device is that
//     goroutine: an actor that owns one locked thread and runs requests sent
//     to it over a channel, one at a time, in order.
//   - Every CUDA and NCCL call for one communicator runs on the one goroutine
//     of its Comm's Device. No other goroutine touches the ncclComm_t.
//   - Nothing blocks without a way out: communicators are created
//     non-blocking (ncclCommInitRankConfig with blocking=0) and every wait
//     polls cudaStreamQuery/cudaEventQuery together with
//     ncclCommGetAsyncError. When the caller's context ends, Abort is called
//     or an asynchronous error shows up, the communicator is aborted with
//     ncclCommAbort and poisoned: every later call fails fast with an error
//     matching ErrAborted and the original cause.
//   - Host memory handed to asynchronous copies must be pinned memory that
//     came from HostAlloc or was registered with HostRegister: both
//     implementations refuse anything else, because the GPU reads it after
//     the call returns and Go memory may not be retained by C.
//
// The package never logs; it returns errors, lowercase and wrapped with
// context. NCCL and CUDA return codes implement error (Result, CudaError)
// and are wrapped in *Error, which names the call and carries the library's
// own message.
package nccl
