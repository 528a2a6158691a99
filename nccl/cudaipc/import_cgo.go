//go:build linux && cgo

package cudaipc

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Our own declaration of cudaIpcMemHandle_t instead of cuda_runtime_api.h
// (as package nccl does): the layout is what matters, 64 opaque bytes.
typedef struct { char reserved[64]; } rlf_ipc_mem_handle;

static void *rlf_ipc_dlopen(const char *path, int noload) {
	return dlopen(path, RTLD_NOW | RTLD_LOCAL | (noload ? RTLD_NOLOAD : 0));
}
static const char *rlf_ipc_dlerror(void) { return dlerror(); }
static void *rlf_ipc_dlsym(void *h, const char *name) { dlerror(); return dlsym(h, name); }

// cudaIpcOpenMemHandle takes the handle by value (a 64-byte struct, which the
// x86-64 and AArch64 ABIs pass in memory): copy Go's bytes into one here.
static int rlf_cudaIpcOpenMemHandle(void *f, uintptr_t *p, const void *h, unsigned int flags) {
	rlf_ipc_mem_handle v;
	memcpy(&v, h, sizeof v);
	return ((int (*)(void **, rlf_ipc_mem_handle, unsigned int))f)((void **)p, v, flags);
}
static int rlf_cudaIpcCloseMemHandle(void *f, uintptr_t p) { return ((int (*)(void *))f)((void *)p); }
// cudaGetErrorName and cudaGetErrorString: const char *f(cudaError_t).
static const char *rlf_cudaErrorText(void *f, int e) { return ((const char *(*)(int))f)(e); }
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/rlflow/rlflow/nccl"
)

// lazyEnablePeerAccess is cudaIpcMemLazyEnablePeerAccess, the one flag
// cudaIpcOpenMemHandle accepts (and the one PyTorch passes): a block on
// another device than the current one is reached through peer access.
const lazyEnablePeerAccess = 1

// Importer opens CUDA IPC memory handles through one loaded CUDA runtime.
// Its methods are safe for concurrent use; each must run on a thread whose
// current device is the handle's (inside nccl.Device.Do).
type Importer struct {
	path string
	f    struct{ open, close, errName, errString unsafe.Pointer }
}

// New resolves the IPC entry points in the CUDA runtime that lib loaded
// (lib.CUDARTPath()). It opens that file with RTLD_NOLOAD, so it gets the
// very instance nccl's calls go through (one runtime, one primary context
// per device) or fails; it never loads a second runtime.
func New(lib *nccl.Library) (*Importer, error) {
	return load(lib.CUDARTPath(), true)
}

// load resolves the entry points in the CUDA runtime at path; with
// alreadyLoaded it refuses a library the process has not loaded yet.
func load(path string, alreadyLoaded bool) (*Importer, error) {
	if path == "" {
		return nil, errors.New("cudaipc: no CUDA runtime path (was nccl.Load successful?)")
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	noload := C.int(0)
	if alreadyLoaded {
		noload = 1
	}
	h := C.rlf_ipc_dlopen(cpath, noload)
	if h == nil {
		msg := "not loaded by this process (load it with nccl.Load first)"
		if e := C.rlf_ipc_dlerror(); e != nil {
			msg = C.GoString(e)
		}
		return nil, fmt.Errorf("cudaipc: open the CUDA runtime %s: %s", path, msg)
	}
	im := &Importer{path: path}
	for _, s := range []struct {
		dst  *unsafe.Pointer
		name string
	}{
		{&im.f.open, "cudaIpcOpenMemHandle"},
		{&im.f.close, "cudaIpcCloseMemHandle"},
		{&im.f.errName, "cudaGetErrorName"},
		{&im.f.errString, "cudaGetErrorString"},
	} {
		cname := C.CString(s.name)
		*s.dst = C.rlf_ipc_dlsym(h, cname)
		C.free(unsafe.Pointer(cname))
		if *s.dst == nil {
			return nil, fmt.Errorf("cudaipc: the CUDA runtime %s lacks symbol %s (set %s to one that has it)", path, s.name, nccl.EnvCUDARTLib)
		}
	}
	return im, nil
}

// CUDARTPath is the CUDA runtime the importer calls.
func (im *Importer) CUDARTPath() string { return im.path }

// Open is cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess): the
// base of the exported block, mapped into the current device's context.
// Release it with Close once, whatever its offsets were used for.
func (im *Importer) Open(h MemHandle) (nccl.DevPtr, error) {
	var p C.uintptr_t
	r := C.rlf_cudaIpcOpenMemHandle(im.f.open, &p, unsafe.Pointer(&h[0]), lazyEnablePeerAccess)
	if err := im.cudaErr("cudaIpcOpenMemHandle", r); err != nil {
		return 0, err
	}
	return nccl.DevPtr(p), nil
}

// Close is cudaIpcCloseMemHandle(p) for a pointer Open returned: it unmaps
// the block from this process (the exporter's memory is not freed).
func (im *Importer) Close(p nccl.DevPtr) error {
	return im.cudaErr("cudaIpcCloseMemHandle", C.rlf_cudaIpcCloseMemHandle(im.f.close, C.uintptr_t(p)))
}

// cudaErr is a failed call as a *nccl.Error wrapping the nccl.CudaError, so
// errors.Is matches nccl's codes; the detail carries the runtime's own
// error name where nccl's table lacks the code, and its message.
func (im *Importer) cudaErr(fn string, r C.int) error {
	if r == 0 {
		return nil
	}
	code := nccl.CudaError(r)
	var name, text string
	if s := C.rlf_cudaErrorText(im.f.errName, r); s != nil {
		name = C.GoString(s)
	}
	if s := C.rlf_cudaErrorText(im.f.errString, r); s != nil {
		text = C.GoString(s)
	}
	detail := text
	if strings.HasPrefix(code.Error(), name+":") {
		detail = "" // nccl's text already names the code
	} else if name != "" {
		detail = name + ": " + text
	}
	return fmt.Errorf("cudaipc: %w", &nccl.Error{Func: fn, Code: code, Detail: detail})
}
