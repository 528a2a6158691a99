//go:build linux && cgo

package nccl

/*
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// Our own minimal declarations instead of nccl.h / cuda_runtime_api.h: both
// libraries return C enums (int), handles are pointers, and the only struct
// that crosses by value is the 128-byte ncclUniqueId.
typedef struct { char internal[128]; } rlf_uid;

// A prefix of ncclConfig_t as it was in NCCL 2.14. NCCL copies min(size,
// sizeof(its ncclConfig_t)) bytes and resets every field newer than
// "version" to its default, so declaring the old layout is forward
// compatible (NCCL's parseCommConfig does exactly this).
typedef struct {
	size_t size;
	unsigned int magic;
	unsigned int version;
	int blocking;
	int cgaClusterSize;
	int minCTAs;
	int maxCTAs;
	const char *netName;
	int splitShare;
} rlf_config;

typedef void *ptr;

static int rlf_ncclGetVersion(void *f, int *v) { return ((int (*)(int *))f)(v); }
static int rlf_ncclGetUniqueId(void *f, void *id) { return ((int (*)(rlf_uid *))f)((rlf_uid *)id); }
static const char *rlf_ncclGetErrorString(void *f, int r) { return ((const char *(*)(int))f)(r); }
static const char *rlf_ncclGetLastError(void *f, uintptr_t comm) { return ((const char *(*)(ptr))f)((ptr)comm); }
// The id travels by value: copy it into a real struct here so the C
// compiler, not Go, lays out the call.
static int rlf_ncclCommInitRank(void *f, uintptr_t *comm, int n, const void *id, int rank) {
	rlf_uid uid;
	memcpy(&uid, id, sizeof uid);
	return ((int (*)(ptr *, int, rlf_uid, int))f)((ptr *)comm, n, uid, rank);
}
static int rlf_ncclCommInitRankConfig(void *f, uintptr_t *comm, int n, const void *id, int rank, int blocking) {
	rlf_uid uid;
	rlf_config cfg;
	memcpy(&uid, id, sizeof uid);
	memset(&cfg, 0, sizeof cfg);
	cfg.size = sizeof cfg;
	cfg.magic = 0xcafebeef;
	cfg.version = 21400; // NCCL_VERSION(2, 14, 0): the layout above
	cfg.blocking = blocking;
	cfg.cgaClusterSize = INT_MIN; // NCCL_CONFIG_UNDEF_INT
	cfg.minCTAs = INT_MIN;
	cfg.maxCTAs = INT_MIN;
	cfg.netName = NULL;
	cfg.splitShare = INT_MIN;
	return ((int (*)(ptr *, int, rlf_uid, int, rlf_config *))f)((ptr *)comm, n, uid, rank, &cfg);
}
static int rlf_ncclAllReduce(void *f, uintptr_t s, uintptr_t r, size_t n, int dt, int op, uintptr_t comm, uintptr_t st) {
	return ((int (*)(const void *, void *, size_t, int, int, ptr, ptr))f)((const void *)s, (void *)r, n, dt, op, (ptr)comm, (ptr)st);
}
static int rlf_ncclBroadcast(void *f, uintptr_t s, uintptr_t r, size_t n, int dt, int root, uintptr_t comm, uintptr_t st) {
	return ((int (*)(const void *, void *, size_t, int, int, ptr, ptr))f)((const void *)s, (void *)r, n, dt, root, (ptr)comm, (ptr)st);
}
static int rlf_ncclCommGetAsyncError(void *f, uintptr_t comm, int *res) { return ((int (*)(ptr, int *))f)((ptr)comm, res); }
// ncclCommAbort, ncclCommDestroy, ncclCommFinalize: int f(handle).
static int rlf_call1(void *f, uintptr_t h) { return ((int (*)(ptr))f)((ptr)h); }
*/
import "C"

import (
	"fmt"
	"unsafe"
)

func (l *Library) ncclErr(fn string, r C.int, comm CommHandle) error {
	if r == 0 {
		return nil
	}
	e := &Error{Func: fn, Code: Result(r)}
	if Result(r) == InProgress {
		return e
	}
	if l.f.ncclGetLastError != nil {
		if s := C.rlf_ncclGetLastError(l.f.ncclGetLastError, C.uintptr_t(comm)); s != nil {
			e.Detail = C.GoString(s)
		}
	}
	return e
}

func (l *Library) NCCLVersion() (int, error) {
	var v C.int
	r := C.rlf_ncclGetVersion(l.f.ncclGetVersion, &v)
	return int(v), l.ncclErr("ncclGetVersion", r, 0)
}

func (l *Library) GetUniqueID() (UniqueID, error) {
	var id UniqueID
	r := C.rlf_ncclGetUniqueId(l.f.ncclGetUniqueId, unsafe.Pointer(&id[0]))
	return id, l.ncclErr("ncclGetUniqueId", r, 0)
}

func (l *Library) CommInitRank(nranks int, id UniqueID, rank int) (CommHandle, error) {
	var c C.uintptr_t
	r := C.rlf_ncclCommInitRank(l.f.ncclCommInitRank, &c, C.int(nranks), unsafe.Pointer(&id[0]), C.int(rank))
	return CommHandle(c), l.ncclErr("ncclCommInitRank", r, CommHandle(c))
}

func (l *Library) CommInitRankConfig(nranks int, id UniqueID, rank int, cfg CommConfig) (CommHandle, error) {
	if l.f.ncclCommInitRankConfig == nil {
		return 0, fmt.Errorf("ncclCommInitRankConfig (%s): %w", l.ncclPath, ErrNotSupported)
	}
	blocking := C.int(0)
	if cfg.Blocking {
		blocking = 1
	}
	var c C.uintptr_t
	r := C.rlf_ncclCommInitRankConfig(l.f.ncclCommInitRankConfig, &c, C.int(nranks), unsafe.Pointer(&id[0]), C.int(rank), blocking)
	return CommHandle(c), l.ncclErr("ncclCommInitRankConfig", r, CommHandle(c))
}

func (l *Library) AllReduce(send, recv DevPtr, count int, dt DataType, op RedOp, comm CommHandle, s Stream) error {
	r := C.rlf_ncclAllReduce(l.f.ncclAllReduce, C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count),
		C.int(dt), C.int(op), C.uintptr_t(comm), C.uintptr_t(s))
	return l.ncclErr("ncclAllReduce", r, comm)
}

func (l *Library) Broadcast(send, recv DevPtr, count int, dt DataType, root int, comm CommHandle, s Stream) error {
	r := C.rlf_ncclBroadcast(l.f.ncclBroadcast, C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count),
		C.int(dt), C.int(root), C.uintptr_t(comm), C.uintptr_t(s))
	return l.ncclErr("ncclBroadcast", r, comm)
}

func (l *Library) CommGetAsyncError(comm CommHandle) error {
	var res C.int
	if r := C.rlf_ncclCommGetAsyncError(l.f.ncclCommGetAsyncError, C.uintptr_t(comm), &res); r != 0 {
		return l.ncclErr("ncclCommGetAsyncError", r, comm)
	}
	return l.ncclErr("ncclCommGetAsyncError (async)", res, comm)
}

func (l *Library) CommAbort(comm CommHandle) error {
	return l.ncclErr("ncclCommAbort", C.rlf_call1(l.f.ncclCommAbort, C.uintptr_t(comm)), 0)
}

func (l *Library) CommFinalize(comm CommHandle) error {
	if l.f.ncclCommFinalize == nil {
		return fmt.Errorf("ncclCommFinalize (%s): %w", l.ncclPath, ErrNotSupported)
	}
	return l.ncclErr("ncclCommFinalize", C.rlf_call1(l.f.ncclCommFinalize, C.uintptr_t(comm)), comm)
}

func (l *Library) CommDestroy(comm CommHandle) error {
	return l.ncclErr("ncclCommDestroy", C.rlf_call1(l.f.ncclCommDestroy, C.uintptr_t(comm)), 0)
}
