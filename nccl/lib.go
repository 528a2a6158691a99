//go:build linux && cgo

package nccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
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

static void *rlf_dlopen(const char *path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static const char *rlf_dlerror(void) { return dlerror(); }
static void *rlf_dlsym(void *h, const char *name) { dlerror(); return dlsym(h, name); }

typedef void *ptr;

// NCCL
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
// ncclCommAbort, ncclCommDestroy, ncclCommFinalize, cudaFree, cudaFreeHost,
// cudaHostUnregister, cudaStream{Destroy,Synchronize,Query},
// cudaEvent{Synchronize,Query,Destroy}: int f(handle).
static int rlf_call1(void *f, uintptr_t h) { return ((int (*)(ptr))f)((ptr)h); }

// CUDA runtime
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
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"
	"unsafe"
)

// Environment variables that override where the libraries are loaded from.
// They take precedence over Config so that an operator can redirect a
// binary whose configuration is baked in.
const (
	EnvNCCLLib   = "RLFLOW_NCCL_LIB"
	EnvCUDARTLib = "RLFLOW_CUDART_LIB"
)

// Config says where to find the libraries. Empty fields mean "search".
type Config struct {
	// NCCLPath is a path or soname of libnccl (default: libnccl.so.2 via the
	// dynamic loader, then the usual directories).
	NCCLPath string
	// CUDARTPath is a path or soname of the CUDA runtime (default:
	// libcudart.so.13, .12, .so via the loader, LD_LIBRARY_PATH and
	// /usr/local/cuda*/targets/<arch>/lib).
	CUDARTPath string
}

// Library is the real API: NCCL and the CUDA runtime opened with dlopen.
// It is safe for concurrent use (see API for thread ownership). The
// libraries stay loaded for the life of the process: NCCL starts threads
// that make dlclose unsafe.
type Library struct {
	ncclPath, cudartPath string

	f struct {
		ncclGetVersion, ncclGetUniqueId, ncclGetErrorString, ncclGetLastError   unsafe.Pointer
		ncclCommInitRank, ncclCommInitRankConfig, ncclAllReduce, ncclBroadcast  unsafe.Pointer
		ncclCommGetAsyncError, ncclCommAbort, ncclCommDestroy, ncclCommFinalize unsafe.Pointer
		cudaRuntimeGetVersion, cudaGetDeviceCount, cudaSetDevice                unsafe.Pointer
		cudaGetErrorString, cudaMemGetInfo, cudaMalloc, cudaFree                unsafe.Pointer
		cudaMemset, cudaMemsetAsync, cudaHostAlloc, cudaFreeHost                unsafe.Pointer
		cudaHostRegister, cudaHostUnregister, cudaMemcpyAsync                   unsafe.Pointer
		cudaStreamCreateWithFlags, cudaStreamDestroy, cudaStreamSynchronize     unsafe.Pointer
		cudaStreamQuery, cudaStreamWaitEvent, cudaEventCreateWithFlags          unsafe.Pointer
		cudaEventRecord, cudaEventSynchronize, cudaEventQuery                   unsafe.Pointer
		cudaEventElapsedTime, cudaEventDestroy, cudaDeviceSynchronize           unsafe.Pointer
	}

	pinned PinnedSet
}

var _ API = (*Library)(nil)

// Load opens NCCL and the CUDA runtime and resolves every entry point. A
// library that cannot be found or a missing symbol is an error that names
// the library, the symbol and the environment variable to override it.
func Load(cfg Config) (*Library, error) {
	l := &Library{}
	nh, npath, err := openLib("libnccl", EnvNCCLLib, cfg.NCCLPath, []string{"libnccl.so.2", "libnccl.so"}, ncclDirs())
	if err != nil {
		return nil, err
	}
	ch, cpath, err := openLib("libcudart", EnvCUDARTLib, cfg.CUDARTPath,
		[]string{"libcudart.so.13", "libcudart.so.12", "libcudart.so"}, cudartDirs())
	if err != nil {
		return nil, err
	}
	l.ncclPath, l.cudartPath = npath, cpath

	type sym struct {
		dst      *unsafe.Pointer
		names    []string // alternatives, first found wins
		optional bool
	}
	nsyms := []sym{
		{&l.f.ncclGetVersion, []string{"ncclGetVersion"}, false},
		{&l.f.ncclGetUniqueId, []string{"ncclGetUniqueId"}, false},
		{&l.f.ncclGetErrorString, []string{"ncclGetErrorString"}, false},
		{&l.f.ncclGetLastError, []string{"ncclGetLastError"}, true},
		{&l.f.ncclCommInitRank, []string{"ncclCommInitRank"}, false},
		{&l.f.ncclCommInitRankConfig, []string{"ncclCommInitRankConfig"}, true},
		{&l.f.ncclAllReduce, []string{"ncclAllReduce"}, false},
		{&l.f.ncclBroadcast, []string{"ncclBroadcast"}, false},
		{&l.f.ncclCommGetAsyncError, []string{"ncclCommGetAsyncError"}, false},
		{&l.f.ncclCommAbort, []string{"ncclCommAbort"}, false},
		{&l.f.ncclCommDestroy, []string{"ncclCommDestroy"}, false},
		{&l.f.ncclCommFinalize, []string{"ncclCommFinalize"}, true},
	}
	csyms := []sym{
		{&l.f.cudaRuntimeGetVersion, []string{"cudaRuntimeGetVersion"}, false},
		{&l.f.cudaGetDeviceCount, []string{"cudaGetDeviceCount"}, false},
		{&l.f.cudaSetDevice, []string{"cudaSetDevice"}, false},
		{&l.f.cudaGetErrorString, []string{"cudaGetErrorString"}, false},
		{&l.f.cudaMemGetInfo, []string{"cudaMemGetInfo"}, false},
		{&l.f.cudaMalloc, []string{"cudaMalloc"}, false},
		{&l.f.cudaFree, []string{"cudaFree"}, false},
		{&l.f.cudaMemset, []string{"cudaMemset"}, false},
		{&l.f.cudaMemsetAsync, []string{"cudaMemsetAsync"}, false},
		{&l.f.cudaHostAlloc, []string{"cudaHostAlloc"}, false},
		{&l.f.cudaFreeHost, []string{"cudaFreeHost"}, false},
		{&l.f.cudaHostRegister, []string{"cudaHostRegister"}, false},
		{&l.f.cudaHostUnregister, []string{"cudaHostUnregister"}, false},
		{&l.f.cudaMemcpyAsync, []string{"cudaMemcpyAsync"}, false},
		{&l.f.cudaStreamCreateWithFlags, []string{"cudaStreamCreateWithFlags"}, false},
		{&l.f.cudaStreamDestroy, []string{"cudaStreamDestroy"}, false},
		{&l.f.cudaStreamSynchronize, []string{"cudaStreamSynchronize"}, false},
		{&l.f.cudaStreamQuery, []string{"cudaStreamQuery"}, false},
		{&l.f.cudaStreamWaitEvent, []string{"cudaStreamWaitEvent"}, false},
		{&l.f.cudaEventCreateWithFlags, []string{"cudaEventCreateWithFlags"}, false},
		{&l.f.cudaEventRecord, []string{"cudaEventRecord"}, false},
		{&l.f.cudaEventSynchronize, []string{"cudaEventSynchronize"}, false},
		{&l.f.cudaEventQuery, []string{"cudaEventQuery"}, false},
		// CUDA 12.8 added a _v2 with the same signature; 13.x may export
		// either spelling.
		{&l.f.cudaEventElapsedTime, []string{"cudaEventElapsedTime", "cudaEventElapsedTime_v2"}, false},
		{&l.f.cudaEventDestroy, []string{"cudaEventDestroy"}, false},
		{&l.f.cudaDeviceSynchronize, []string{"cudaDeviceSynchronize"}, false},
	}
	resolve := func(h unsafe.Pointer, path, env string, syms []sym) error {
		for _, s := range syms {
			for _, name := range s.names {
				cname := C.CString(name)
				p := C.rlf_dlsym(h, cname)
				C.free(unsafe.Pointer(cname))
				if p != nil {
					*s.dst = p
					break
				}
			}
			if *s.dst == nil && !s.optional {
				return fmt.Errorf("nccl: %s lacks symbol %s (set %s to a library that has it)",
					path, strings.Join(s.names, " or "), env)
			}
		}
		return nil
	}
	if err := resolve(nh, npath, EnvNCCLLib, nsyms); err != nil {
		return nil, err
	}
	if err := resolve(ch, cpath, EnvCUDARTLib, csyms); err != nil {
		return nil, err
	}
	return l, nil
}

// NCCLPath and CUDARTPath are the library files (or sonames) Load opened.
func (l *Library) NCCLPath() string   { return l.ncclPath }
func (l *Library) CUDARTPath() string { return l.cudartPath }

// openLib tries, in order: the environment override, the configured path,
// then every candidate soname through the dynamic loader and in each of dirs.
func openLib(what, env, configured string, names, dirs []string) (unsafe.Pointer, string, error) {
	explicit, source := os.Getenv(env), env
	if explicit == "" {
		explicit, source = configured, "Config"
	}
	if explicit != "" {
		h, err := dlopen(explicit)
		if err != nil {
			return nil, "", fmt.Errorf("nccl: cannot load %s from %s (set by %s): %w", what, explicit, source, err)
		}
		return h, explicit, nil
	}
	var tried []string
	var last error
	for _, name := range names {
		cands := []string{name}
		for _, d := range dirs {
			if p := filepath.Join(d, name); fileExists(p) {
				cands = append(cands, p)
			}
		}
		for _, c := range cands {
			h, err := dlopen(c)
			if err == nil {
				return h, c, nil
			}
			tried = append(tried, c)
			last = err
		}
	}
	return nil, "", fmt.Errorf("nccl: cannot load %s (tried %s; last error: %v); set %s to its path",
		what, strings.Join(tried, ", "), last, env)
}

func dlopen(path string) (unsafe.Pointer, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	h := C.rlf_dlopen(cpath)
	if h == nil {
		msg := "unknown dlopen error"
		if e := C.rlf_dlerror(); e != nil {
			msg = C.GoString(e)
		}
		return nil, errors.New(msg)
	}
	return h, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func ldLibraryPath() []string {
	var out []string
	for _, d := range filepath.SplitList(os.Getenv("LD_LIBRARY_PATH")) {
		if d != "" {
			out = append(out, d)
		}
	}
	return out
}

func multiarch() (triple string, targets []string) {
	if runtime.GOARCH == "arm64" {
		return "aarch64-linux-gnu", []string{"sbsa-linux", "aarch64-linux"}
	}
	return "x86_64-linux-gnu", []string{"x86_64-linux"}
}

func ncclDirs() []string {
	triple, _ := multiarch()
	return append(ldLibraryPath(), "/usr/lib/"+triple, "/usr/local/nccl/lib", "/usr/local/lib", "/usr/lib64")
}

// cudartDirs lists LD_LIBRARY_PATH, then the CUDA toolkits, newest first
// (cuda-13.0 before cuda-12.8), so that a machine with several toolkits
// picks the runtime matching the newest driver-supported one.
func cudartDirs() []string {
	triple, targets := multiarch()
	dirs := ldLibraryPath()
	roots := []string{"/usr/local/cuda"}
	if m, _ := filepath.Glob("/usr/local/cuda-*"); len(m) > 0 {
		sort.Sort(sort.Reverse(sort.StringSlice(m)))
		roots = append(roots, m...)
	}
	for _, r := range roots {
		for _, t := range targets {
			dirs = append(dirs, filepath.Join(r, "targets", t, "lib"))
		}
		dirs = append(dirs, filepath.Join(r, "lib64"))
	}
	return append(dirs, "/usr/lib/"+triple)
}

// ---- error helpers ----

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

// ---- NCCL ----

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

// ---- CUDA runtime ----

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
