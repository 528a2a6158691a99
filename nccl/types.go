package nccl

import (
	"errors"
	"fmt"
)

// DevPtr is a device address as returned by cudaMalloc. It is a plain
// integer on the Go side on purpose: the Go garbage collector must never see
// device addresses as pointers.
type DevPtr uintptr

// Stream is a cudaStream_t. The zero Stream is the legacy default stream.
type Stream uintptr

// Event is a cudaEvent_t.
type Event uintptr

// CommHandle is an ncclComm_t.
type CommHandle uintptr

// UniqueIDBytes is sizeof(ncclUniqueId).
const UniqueIDBytes = 128

// UniqueID is the 128 opaque bytes of an ncclUniqueId, as produced by
// ncclGetUniqueId on rank 0 and carried to the other ranks (pickled in the
// TCPStore for vLLM).
type UniqueID [UniqueIDBytes]byte

// DataType is ncclDataType_t. The values are NCCL's wire-stable enum.
type DataType int

// The NCCL data types (spec section 3). The two fp8 types exist from NCCL
// 2.24 on (see MinVersion); an older library refuses them.
const (
	Int8       DataType = 0
	Uint8      DataType = 1
	Int32      DataType = 2
	Uint32     DataType = 3
	Int64      DataType = 4
	Uint64     DataType = 5
	Float16    DataType = 6
	Float32    DataType = 7
	Float64    DataType = 8
	Bfloat16   DataType = 9
	Float8e4m3 DataType = 10
	Float8e5m2 DataType = 11
)

// Float8MinVersion is the first NCCL release with Float8e4m3 and
// Float8e5m2, in ncclGetVersion's encoding (2.24.0).
const Float8MinVersion = 22400

var dataTypeInfo = [...]struct {
	name       string
	size       int
	minVersion int // 0: in every NCCL 2
}{
	Int8:       {"ncclInt8", 1, 0},
	Uint8:      {"ncclUint8", 1, 0},
	Int32:      {"ncclInt32", 4, 0},
	Uint32:     {"ncclUint32", 4, 0},
	Int64:      {"ncclInt64", 8, 0},
	Uint64:     {"ncclUint64", 8, 0},
	Float16:    {"ncclFloat16", 2, 0},
	Float32:    {"ncclFloat32", 4, 0},
	Float64:    {"ncclFloat64", 8, 0},
	Bfloat16:   {"ncclBfloat16", 2, 0},
	Float8e4m3: {"ncclFloat8e4m3", 1, Float8MinVersion},
	Float8e5m2: {"ncclFloat8e5m2", 1, Float8MinVersion},
}

// Valid reports whether d is one of the twelve NCCL data types above
// (whether the loaded library has it is MinVersion's question).
func (d DataType) Valid() bool { return d >= 0 && int(d) < len(dataTypeInfo) }

// MinVersion is the first NCCL version (ncclGetVersion's number) that has
// d: 0 for the types of every NCCL 2, Float8MinVersion for the fp8 types,
// 0 for an invalid type.
func (d DataType) MinVersion() int {
	if !d.Valid() {
		return 0
	}
	return dataTypeInfo[d].minVersion
}

// VersionString spells ncclGetVersion's number as NCCL does ("2.28.3"):
// major*10000 + minor*100 + patch from 2.9 on, major*1000 + minor*100 +
// patch before.
func VersionString(v int) string {
	if v >= 10000 {
		return fmt.Sprintf("%d.%d.%d", v/10000, v/100%100, v%100)
	}
	return fmt.Sprintf("%d.%d.%d", v/1000, v/100%10, v%100)
}

// Size is the element size in bytes (0 for an invalid type).
func (d DataType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dataTypeInfo[d].size
}

func (d DataType) String() string {
	if !d.Valid() {
		return fmt.Sprintf("ncclDataType(%d)", int(d))
	}
	return dataTypeInfo[d].name
}

// RedOp is ncclRedOp_t.
type RedOp int

// Sum is ncclSum, the only reduction rlflow needs (the warm-up all-reduce).
const Sum RedOp = 0

// Result is an ncclResult_t. Non-zero values implement error; the texts are
// those of ncclGetErrorString, so nccltest.Fake produces the same messages.
type Result int

// The NCCL result codes.
const (
	Success            Result = 0
	UnhandledCudaError Result = 1
	SystemError        Result = 2
	InternalError      Result = 3
	InvalidArgument    Result = 4
	InvalidUsage       Result = 5
	RemoteError        Result = 6
	// InProgress is not a failure: a non-blocking communicator returns it
	// while an operation is still being set up (ncclCommGetAsyncError keeps
	// returning it until the operation is enqueued or init is complete).
	InProgress Result = 7
	Timeout    Result = 8
)

var resultText = map[Result]string{
	Success:            "ncclSuccess: no error",
	UnhandledCudaError: "ncclUnhandledCudaError: unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
	SystemError:        "ncclSystemError: unhandled system error (run with NCCL_DEBUG=INFO for details)",
	InternalError:      "ncclInternalError: internal error - please report this issue to the NCCL developers",
	InvalidArgument:    "ncclInvalidArgument: invalid argument (run with NCCL_DEBUG=WARN for details)",
	InvalidUsage:       "ncclInvalidUsage: invalid usage (run with NCCL_DEBUG=WARN for details)",
	RemoteError:        "ncclRemoteError: remote process exited or there was a network error",
	InProgress:         "ncclInProgress: NCCL operation in progress",
	Timeout:            "ncclTimeout: operation timed out",
}

func (r Result) Error() string {
	if s, ok := resultText[r]; ok {
		return s
	}
	return fmt.Sprintf("ncclResult(%d)", int(r))
}

// CudaError is a cudaError_t. Non-zero values implement error.
type CudaError int

// The CUDA runtime error codes rlflow reacts to or that tests produce.
const (
	CudaSuccess                 CudaError = 0
	CudaErrorInvalidValue       CudaError = 1
	CudaErrorMemoryAllocation   CudaError = 2
	CudaErrorInitialization     CudaError = 3
	CudaErrorInsufficientDriver CudaError = 35
	CudaErrorNoDevice           CudaError = 100
	CudaErrorInvalidDevice      CudaError = 101
	CudaErrorInvalidHandle      CudaError = 400
	CudaErrorNotReady           CudaError = 600
	CudaErrorIllegalAddress     CudaError = 700
	CudaErrorHostMemAlreadyReg  CudaError = 712
	CudaErrorHostMemNotReg      CudaError = 713
	CudaErrorLaunchFailure      CudaError = 719
	CudaErrorNotSupported       CudaError = 801
	CudaErrorUnknown            CudaError = 999
)

var cudaErrorText = map[CudaError]string{
	CudaSuccess:                 "cudaSuccess: no error",
	CudaErrorInvalidValue:       "cudaErrorInvalidValue: invalid argument",
	CudaErrorMemoryAllocation:   "cudaErrorMemoryAllocation: out of memory",
	CudaErrorInitialization:     "cudaErrorInitializationError: initialization error",
	CudaErrorInsufficientDriver: "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
	CudaErrorNoDevice:           "cudaErrorNoDevice: no CUDA-capable device is detected",
	CudaErrorInvalidDevice:      "cudaErrorInvalidDevice: invalid device ordinal",
	CudaErrorInvalidHandle:      "cudaErrorInvalidResourceHandle: invalid resource handle",
	CudaErrorNotReady:           "cudaErrorNotReady: device not ready",
	CudaErrorIllegalAddress:     "cudaErrorIllegalAddress: an illegal memory access was encountered",
	CudaErrorHostMemAlreadyReg:  "cudaErrorHostMemoryAlreadyRegistered: part or all of the requested memory range is already mapped",
	CudaErrorHostMemNotReg:      "cudaErrorHostMemoryNotRegistered: pointer does not correspond to a registered memory region",
	CudaErrorLaunchFailure:      "cudaErrorLaunchFailure: unspecified launch failure",
	CudaErrorNotSupported:       "cudaErrorNotSupported: operation not supported",
	CudaErrorUnknown:            "cudaErrorUnknown: unknown error",
}

func (e CudaError) Error() string {
	if s, ok := cudaErrorText[e]; ok {
		return s
	}
	return fmt.Sprintf("cudaError(%d)", int(e))
}

// Error is a failed NCCL or CUDA call: the C function, its return code
// (Result or CudaError, reachable with errors.Is/As) and the library's own
// message (ncclGetLastError or cudaGetErrorString), which often names the
// real cause (for instance the peer that went away).
type Error struct {
	Func   string
	Code   error
	Detail string
}

func (e *Error) Error() string {
	s := e.Func + ": " + e.Code.Error()
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

func (e *Error) Unwrap() error { return e.Code }

// Sentinel errors. Match them with errors.Is.
var (
	// ErrAborted marks every error of a communicator that was aborted
	// (context ended, Abort called, asynchronous NCCL error). The error also
	// wraps the cause.
	ErrAborted = errors.New("nccl: communicator aborted")
	// ErrClosed is returned by a Device or Comm after Close.
	ErrClosed = errors.New("nccl: closed")
	// ErrNotSupported means the loaded library lacks an optional entry
	// point (for example ncclCommInitRankConfig in NCCL < 2.14).
	ErrNotSupported = errors.New("nccl: not supported by the loaded library")
	// ErrNotPinned is returned for an asynchronous copy from or to host
	// memory that did not come from HostAlloc or HostRegister.
	ErrNotPinned = errors.New("nccl: host memory is not pinned (use HostAlloc or HostRegister)")
)

// IsInProgress reports whether err is NCCL's ncclInProgress, the "not yet"
// answer of a non-blocking communicator.
func IsInProgress(err error) bool { return errors.Is(err, InProgress) }

// Flags for StreamCreate (cudaStreamCreateWithFlags).
const (
	StreamDefault     = 0
	StreamNonBlocking = 1 // no implicit synchronisation with the legacy default stream
)

// Flags for HostAlloc (cudaHostAlloc).
const (
	HostAllocDefault       = 0
	HostAllocPortable      = 1 // pinned for every CUDA context, not only the current one
	HostAllocMapped        = 2
	HostAllocWriteCombined = 4 // fast for the GPU to read and the CPU to write, very slow for the CPU to read
)

// Flags for HostRegister (cudaHostRegister).
const (
	HostRegisterDefault  = 0
	HostRegisterPortable = 1
	HostRegisterMapped   = 2
	HostRegisterIoMemory = 4
	HostRegisterReadOnly = 8 // needed for read-only mappings such as a PROT_READ mmap of a checkpoint
)

// Flags for EventCreate (cudaEventCreateWithFlags).
const (
	EventDefault       = 0
	EventBlockingSync  = 1
	EventDisableTiming = 2 // cheaper; such events cannot be used with EventElapsedTime
)
