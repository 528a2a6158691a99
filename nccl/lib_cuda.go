//go:build linux && cgo

package nccl

/*
#include <stddef.h>
#include <stdint.h>

// Our own minimal declarations instead of cuda_runtime_api.h, as for NCCL
// (lib_nccl.go): the runtime returns C enums (int) and handles are pointers.
typedef void *ptr;

// cudaFree, cudaStream{Destroy,Synchronize,Query},
// cudaEvent{Synchronize,Query,Destroy}: int f(handle).
static int rlf_call1(void *f, uintptr_t h) { return ((int (*)(ptr))f)((ptr)h); }

static int rlf_cudaIntOut(void *f, int *v) { return ((int (*)(int *))f)(v); }
static int rlf_cudaSetDevice(void *f, int d) { return ((int (*)(int))f)(d); }
static const char *rlf_cudaGetErrorString(void *f, int e) { return ((const char *(*)(int))f)(e); }
static int rlf_cudaMemGetInfo(void *f, size_t *fr, size_t *tot) { return ((int (*)(size_t *, size_t *))f)(fr, tot); }
static int rlf_cudaMalloc(void *f, uintptr_t *p, size_t n) { return ((int (*)(ptr *, size_t))f)((ptr *)p, n); }
static int rlf_cudaMemset(void *f, uintptr_t p, int v, size_t n) { return ((int (*)(ptr, int, size_t))f)((ptr)p, v, n); }
static int rlf_cudaMemsetAsync(void *f, uintptr_t p, int v, size_t n, uintptr_t s) { return ((int (*)(ptr, int, size_t, ptr))f)((ptr)p, v, n, (ptr)s); }
static int rlf_cudaHostAlloc(void *f, void **p, size_t n, unsigned int fl) { return ((int (*)(void **, size_t, unsigned int))f)(p, n, fl); }
static int rlf_cudaFreeHost(void *f, void *p) { return ((int (*)(void *))f)(p); }
static int rlf_cudaHostRegister(void *f, void *p, size_t n, unsigned int fl) { return ((int (*)(void *, size_t, unsigned int))f)(p, n, fl); }
static int rlf_cudaHostUnregister(void *f, void *p) { return ((int (*)(void *))f)(p); }
// kind: 1 HostToDevice, 2 DeviceToHost, 3 DeviceToDevice (cudaMemcpyKind).
static int rlf_cudaMemcpyAsync(void *f, uintptr_t dst, uintptr_t src, size_t n, int kind, uintptr_t s) {
	return ((int (*)(void *, const void *, size_t, int, ptr))f)((void *)dst, (const void *)src, n, kind, (ptr)s);
}
static int rlf_cudaMemcpyHtoDAsync(void *f, uintptr_t dst, const void *src, size_t n, uintptr_t s) {
	return ((int (*)(void *, const void *, size_t, int, ptr))f)((void *)dst, src, n, 1, (ptr)s);
}
static int rlf_cudaMemcpyDtoHAsync(void *f, void *dst, uintptr_t src, size_t n, uintptr_t s) {
	return ((int (*)(void *, const void *, size_t, int, ptr))f)(dst, (const void *)src, n, 2, (ptr)s);
}
static int rlf_cudaHandleOut(void *f, uintptr_t *h, unsigned int fl) { return ((int (*)(ptr *, unsigned int))f)((ptr *)h, fl); }
static int rlf_cudaStreamWaitEvent(void *f, uintptr_t s, uintptr_t e) { return ((int (*)(ptr, ptr, unsigned int))f)((ptr)s, (ptr)e, 0); }
static int rlf_cudaEventRecord(void *f, uintptr_t e, uintptr_t s) { return ((int (*)(ptr, ptr))f)((ptr)e, (ptr)s); }
static int rlf_cudaEventElapsedTime(void *f, float *ms, uintptr_t a, uintptr_t b) { return ((int (*)(float *, ptr, ptr))f)(ms, (ptr)a, (ptr)b); }
static int rlf_call0(void *f) { return ((int (*)(void))f)(); }
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"
)

func (l *Library) cudaErr(fn string, r C.int) error {
	if r == 0 {
		return nil
	}
	e := &Error{Func: fn, Code: CudaError(r)}
	if s := C.rlf_cudaGetErrorString(l.f.cudaGetErrorString, r); s != nil {
		e.Detail = C.GoString(s)
	}
	return e
}

func (l *Library) CUDARuntimeVersion() (int, error) {
	var v C.int
	r := C.rlf_cudaIntOut(l.f.cudaRuntimeGetVersion, &v)
	return int(v), l.cudaErr("cudaRuntimeGetVersion", r)
}

func (l *Library) GetDeviceCount() (int, error) {
	var v C.int
	r := C.rlf_cudaIntOut(l.f.cudaGetDeviceCount, &v)
	return int(v), l.cudaErr("cudaGetDeviceCount", r)
}

func (l *Library) SetDevice(device int) error {
	return l.cudaErr("cudaSetDevice", C.rlf_cudaSetDevice(l.f.cudaSetDevice, C.int(device)))
}

func (l *Library) MemGetInfo() (free, total uint64, err error) {
	var f, t C.size_t
	r := C.rlf_cudaMemGetInfo(l.f.cudaMemGetInfo, &f, &t)
	return uint64(f), uint64(t), l.cudaErr("cudaMemGetInfo", r)
}

func (l *Library) Malloc(n int) (DevPtr, error) {
	var p C.uintptr_t
	if err := l.cudaErr("cudaMalloc", C.rlf_cudaMalloc(l.f.cudaMalloc, &p, C.size_t(n))); err != nil {
		return 0, fmt.Errorf("%w (%d bytes)", err, n)
	}
	return DevPtr(p), nil
}

func (l *Library) Free(p DevPtr) error {
	return l.cudaErr("cudaFree", C.rlf_call1(l.f.cudaFree, C.uintptr_t(p)))
}

func (l *Library) Memset(p DevPtr, value byte, n int) error {
	return l.cudaErr("cudaMemset", C.rlf_cudaMemset(l.f.cudaMemset, C.uintptr_t(p), C.int(value), C.size_t(n)))
}

func (l *Library) MemsetAsync(p DevPtr, value byte, n int, s Stream) error {
	return l.cudaErr("cudaMemsetAsync",
		C.rlf_cudaMemsetAsync(l.f.cudaMemsetAsync, C.uintptr_t(p), C.int(value), C.size_t(n), C.uintptr_t(s)))
}

func (l *Library) HostAlloc(n int, flags uint) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cudaHostAlloc: invalid size %d", n)
	}
	var p unsafe.Pointer
	if err := l.cudaErr("cudaHostAlloc", C.rlf_cudaHostAlloc(l.f.cudaHostAlloc, &p, C.size_t(n), C.uint(flags))); err != nil {
		return nil, fmt.Errorf("%w (%d bytes)", err, n)
	}
	b := unsafe.Slice((*byte)(p), n)
	l.pinned.Add(b, true)
	return b, nil
}

func (l *Library) FreeHost(b []byte) error {
	if !l.pinned.Remove(b, true) {
		return fmt.Errorf("cudaFreeHost: %w", &Error{Func: "cudaFreeHost", Code: CudaErrorInvalidValue, Detail: "not a HostAlloc allocation"})
	}
	return l.cudaErr("cudaFreeHost", C.rlf_cudaFreeHost(l.f.cudaFreeHost, unsafe.Pointer(unsafe.SliceData(b))))
}

func (l *Library) HostRegister(b []byte, flags uint) error {
	if len(b) == 0 {
		return nil
	}
	r := C.rlf_cudaHostRegister(l.f.cudaHostRegister, unsafe.Pointer(unsafe.SliceData(b)), C.size_t(len(b)), C.uint(flags))
	if err := l.cudaErr("cudaHostRegister", r); err != nil {
		return err
	}
	l.pinned.Add(b, false)
	return nil
}

func (l *Library) HostUnregister(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if !l.pinned.Remove(b, false) {
		return &Error{Func: "cudaHostUnregister", Code: CudaErrorHostMemNotReg, Detail: "not registered through HostRegister"}
	}
	return l.cudaErr("cudaHostUnregister", C.rlf_cudaHostUnregister(l.f.cudaHostUnregister, unsafe.Pointer(unsafe.SliceData(b))))
}

func (l *Library) MemcpyHtoDAsync(dst DevPtr, src []byte, s Stream) error {
	if len(src) == 0 {
		return nil
	}
	if !l.pinned.Contains(src) {
		return fmt.Errorf("cudaMemcpyAsync HtoD: %w", ErrNotPinned)
	}
	r := C.rlf_cudaMemcpyHtoDAsync(l.f.cudaMemcpyAsync, C.uintptr_t(dst), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)), C.uintptr_t(s))
	return l.cudaErr("cudaMemcpyAsync HtoD", r)
}

func (l *Library) MemcpyDtoHAsync(dst []byte, src DevPtr, s Stream) error {
	if len(dst) == 0 {
		return nil
	}
	if !l.pinned.Contains(dst) {
		return fmt.Errorf("cudaMemcpyAsync DtoH: %w", ErrNotPinned)
	}
	r := C.rlf_cudaMemcpyDtoHAsync(l.f.cudaMemcpyAsync, unsafe.Pointer(unsafe.SliceData(dst)), C.uintptr_t(src), C.size_t(len(dst)), C.uintptr_t(s))
	return l.cudaErr("cudaMemcpyAsync DtoH", r)
}

func (l *Library) MemcpyDtoDAsync(dst, src DevPtr, n int, s Stream) error {
	if n == 0 {
		return nil
	}
	r := C.rlf_cudaMemcpyAsync(l.f.cudaMemcpyAsync, C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), 3, C.uintptr_t(s))
	return l.cudaErr("cudaMemcpyAsync DtoD", r)
}

func (l *Library) StreamCreate(flags uint) (Stream, error) {
	var h C.uintptr_t
	r := C.rlf_cudaHandleOut(l.f.cudaStreamCreateWithFlags, &h, C.uint(flags))
	return Stream(h), l.cudaErr("cudaStreamCreateWithFlags", r)
}

func (l *Library) StreamDestroy(s Stream) error {
	return l.cudaErr("cudaStreamDestroy", C.rlf_call1(l.f.cudaStreamDestroy, C.uintptr_t(s)))
}

func (l *Library) StreamSynchronize(s Stream) error {
	return l.cudaErr("cudaStreamSynchronize", C.rlf_call1(l.f.cudaStreamSynchronize, C.uintptr_t(s)))
}

func (l *Library) StreamQuery(s Stream) (bool, error) {
	r := C.rlf_call1(l.f.cudaStreamQuery, C.uintptr_t(s))
	if CudaError(r) == CudaErrorNotReady {
		return false, nil
	}
	return r == 0, l.cudaErr("cudaStreamQuery", r)
}

func (l *Library) StreamWaitEvent(s Stream, e Event) error {
	return l.cudaErr("cudaStreamWaitEvent", C.rlf_cudaStreamWaitEvent(l.f.cudaStreamWaitEvent, C.uintptr_t(s), C.uintptr_t(e)))
}

func (l *Library) EventCreate(flags uint) (Event, error) {
	var h C.uintptr_t
	r := C.rlf_cudaHandleOut(l.f.cudaEventCreateWithFlags, &h, C.uint(flags))
	return Event(h), l.cudaErr("cudaEventCreateWithFlags", r)
}

func (l *Library) EventRecord(e Event, s Stream) error {
	return l.cudaErr("cudaEventRecord", C.rlf_cudaEventRecord(l.f.cudaEventRecord, C.uintptr_t(e), C.uintptr_t(s)))
}

func (l *Library) EventSynchronize(e Event) error {
	return l.cudaErr("cudaEventSynchronize", C.rlf_call1(l.f.cudaEventSynchronize, C.uintptr_t(e)))
}

func (l *Library) EventQuery(e Event) (bool, error) {
	r := C.rlf_call1(l.f.cudaEventQuery, C.uintptr_t(e))
	if CudaError(r) == CudaErrorNotReady {
		return false, nil
	}
	return r == 0, l.cudaErr("cudaEventQuery", r)
}

func (l *Library) EventElapsedTime(start, end Event) (time.Duration, error) {
	var ms C.float
	r := C.rlf_cudaEventElapsedTime(l.f.cudaEventElapsedTime, &ms, C.uintptr_t(start), C.uintptr_t(end))
	if err := l.cudaErr("cudaEventElapsedTime", r); err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

func (l *Library) EventDestroy(e Event) error {
	return l.cudaErr("cudaEventDestroy", C.rlf_call1(l.f.cudaEventDestroy, C.uintptr_t(e)))
}

func (l *Library) DeviceSynchronize() error {
	return l.cudaErr("cudaDeviceSynchronize", C.rlf_call0(l.f.cudaDeviceSynchronize))
}
