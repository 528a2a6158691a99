package nccl

import (
	"errors"
	"time"
)

// API is the slice of NCCL and the CUDA runtime that rlflow uses, one method
// per C function (names without the nccl/cuda prefix). *Library implements it
// with the dlopen'd libraries; nccltest.Fake (nccltest.NewFake) with host
// memory, for tests.
//
// Thread ownership: the CUDA current device is per OS thread, so call these
// methods only from a goroutine that is locked to its OS thread and on which
// SetDevice ran; Device provides exactly that. Calls that name a
// communicator must all come from the communicator's one goroutine (see
// Comm). Implementations are safe for concurrent use otherwise.
//
// Return codes: NCCL failures are *Error wrapping a Result, CUDA failures
// *Error wrapping a CudaError. "Not ready" answers of the query calls are not
// errors (done=false), and ncclInProgress from a non-blocking communicator is
// returned as an error for which IsInProgress is true.
type API interface {
	// NCCLVersion is ncclGetVersion: major*10000 + minor*100 + patch.
	NCCLVersion() (int, error)
	// GetUniqueID is ncclGetUniqueId. Only rank 0 calls it; it also starts
	// NCCL's bootstrap listener in this process.
	GetUniqueID() (UniqueID, error)
	// CommInitRank is the blocking ncclCommInitRank: it returns only once
	// every rank joined, which may be never. Prefer CommInitRankConfig.
	CommInitRank(nranks int, id UniqueID, rank int) (CommHandle, error)
	// CommInitRankConfig is ncclCommInitRankConfig. With Blocking false the
	// handle is valid at once and the call (or ncclCommGetAsyncError later)
	// answers InProgress until initialisation finished; the communicator can
	// be aborted meanwhile. ErrNotSupported if the library lacks the call.
	CommInitRankConfig(nranks int, id UniqueID, rank int, cfg CommConfig) (CommHandle, error)
	// AllReduce is ncclAllReduce (count elements of dt).
	AllReduce(send, recv DevPtr, count int, dt DataType, op RedOp, comm CommHandle, s Stream) error
	// Broadcast is ncclBroadcast (count elements of dt); on the root
	// send == recv is allowed and is what vLLM's trainer side does.
	Broadcast(send, recv DevPtr, count int, dt DataType, root int, comm CommHandle, s Stream) error
	// CommGetAsyncError is ncclCommGetAsyncError: nil when healthy,
	// InProgress while a non-blocking operation is being set up.
	CommGetAsyncError(comm CommHandle) error
	// CommAbort is ncclCommAbort: it stops outstanding operations (NCCL
	// kernels exit) and frees the communicator. The handle is dead after it.
	CommAbort(comm CommHandle) error
	// CommFinalize is ncclCommFinalize (flushes outstanding operations; on
	// a non-blocking communicator it may answer InProgress).
	CommFinalize(comm CommHandle) error
	// CommDestroy is ncclCommDestroy. The handle is dead after it.
	CommDestroy(comm CommHandle) error

	// CUDARuntimeVersion is cudaRuntimeGetVersion (e.g. 13000).
	CUDARuntimeVersion() (int, error)
	GetDeviceCount() (int, error)
	SetDevice(device int) error
	// MemGetInfo is cudaMemGetInfo for the current device.
	MemGetInfo() (free, total uint64, err error)
	Malloc(n int) (DevPtr, error)
	// Free is cudaFree; note that it synchronises the device.
	Free(p DevPtr) error
	Memset(p DevPtr, value byte, n int) error
	MemsetAsync(p DevPtr, value byte, n int, s Stream) error
	// HostAlloc is cudaHostAlloc: page-locked host memory, returned as a
	// slice over memory that is not Go's. It stays valid until FreeHost.
	HostAlloc(n int, flags uint) ([]byte, error)
	// FreeHost is cudaFreeHost; b must be a slice returned by HostAlloc.
	FreeHost(b []byte) error
	// HostRegister is cudaHostRegister: page-lock existing memory (e.g. a
	// read-only mmap, with HostRegisterReadOnly). b must not be Go heap
	// memory that can be freed while registered.
	HostRegister(b []byte, flags uint) error
	HostUnregister(b []byte) error
	// MemcpyHtoDAsync is cudaMemcpyAsync(dst, src, len(src), HostToDevice, s).
	// src must be pinned (ErrNotPinned otherwise) and must not be written
	// until the copy completed.
	MemcpyHtoDAsync(dst DevPtr, src []byte, s Stream) error
	// MemcpyDtoHAsync is cudaMemcpyAsync(dst, src, len(dst), DeviceToHost, s);
	// dst must be pinned.
	MemcpyDtoHAsync(dst []byte, src DevPtr, s Stream) error
	MemcpyDtoDAsync(dst, src DevPtr, n int, s Stream) error
	// StreamCreate is cudaStreamCreateWithFlags.
	StreamCreate(flags uint) (Stream, error)
	StreamDestroy(s Stream) error
	// StreamSynchronize blocks the calling thread without a timeout: the
	// Comm never uses it on a stream that carries NCCL work.
	StreamSynchronize(s Stream) error
	// StreamQuery is cudaStreamQuery: done is false while work is pending.
	StreamQuery(s Stream) (done bool, err error)
	// StreamWaitEvent is cudaStreamWaitEvent(s, e, 0): work enqueued on s
	// after this waits for the most recent EventRecord of e.
	StreamWaitEvent(s Stream, e Event) error
	// EventCreate is cudaEventCreateWithFlags.
	EventCreate(flags uint) (Event, error)
	EventRecord(e Event, s Stream) error
	EventSynchronize(e Event) error
	// EventQuery is cudaEventQuery: done is false while the work before the
	// most recent record is pending.
	EventQuery(e Event) (done bool, err error)
	// EventElapsedTime is cudaEventElapsedTime (both events completed).
	EventElapsedTime(start, end Event) (time.Duration, error)
	EventDestroy(e Event) error
	DeviceSynchronize() error
}

// CommConfig is the part of ncclConfig_t rlflow sets.
type CommConfig struct {
	// Blocking false makes init and collectives return InProgress instead
	// of blocking, so that a peer that never comes can be given up on.
	Blocking bool
}

// The kinds of IPCHandle: how another process exported the device memory.
// They are the values of the resident trainer's publish reply field "ipc"
// (trainer/PROTOCOL.md); package trainer spells them with these constants.
const (
	// IPCCUDA: Mem is a cudaIpcMemHandle_t of a cudaMalloc block
	// (cudaIpcGetMemHandle in the exporter).
	IPCCUDA = "cuda"
	// IPCFakeShm: Path names a shared file standing in for device memory.
	// A TEST DOUBLE: only nccltest.Fake opens it.
	IPCFakeShm = "fake_shm"
)

// IPCHandle names device memory that another process on this host exported.
// It is comparable: equal handles name the same memory, so a caller may
// cache what it opened by handle.
type IPCHandle struct {
	Kind string // IPCCUDA or IPCFakeShm
	// Mem (IPCCUDA) is the 64-byte cudaIpcMemHandle_t of the block's base.
	Mem [64]byte
	// Path and Bytes (IPCFakeShm): the shared file and how many of its
	// bytes, from its start, stand for the block (the block's size).
	Path  string
	Bytes int64
}

// IPCImporter maps device memory another process exported into this
// process: cudaipc.Importer for CUDA IPC handles on a GPU, nccltest.Fake
// for its fake_shm TEST DOUBLE. Both methods run on a thread whose current
// device is the memory's device, inside Device.Do. The pointer OpenIPC
// returns is the base of the exported block, valid on every thread of the
// process until CloseIPC(p); the exporter keeps the memory alive until then
// (the importer never frees it). An importer that does not open h's Kind
// returns an error matching ErrIPCKind.
type IPCImporter interface {
	OpenIPC(h IPCHandle) (DevPtr, error)
	CloseIPC(p DevPtr) error
}

// ErrIPCKind marks an IPCImporter's refusal of a handle kind it cannot open
// (a fake_shm handle on a real GPU, a CUDA handle in the test double): a
// request that can never work on this process.
var ErrIPCKind = errors.New("nccl: IPC handle of a kind this importer does not open")
