//go:build linux && cgo

package nccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>

static void *rlf_dlopen(const char *path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static const char *rlf_dlerror(void) { return dlerror(); }
static void *rlf_dlsym(void *h, const char *name) { dlerror(); return dlsym(h, name); }
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
