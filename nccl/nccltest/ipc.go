//go:build unix

package nccltest

import (
	"fmt"
	"os"
	"sort"
	"syscall"

	"github.com/rlflow/rlflow/nccl"
)

// The Fake is the TEST DOUBLE's nccl.IPCImporter: fake_shm handles only.
var _ nccl.IPCImporter = (*Fake)(nil)

// fakeIPC is one open fake_shm mapping.
type fakeIPC struct {
	key  ipcKey
	refs int // opens not yet closed: CUDA counts a handle opened twice
}

type ipcKey struct {
	dev   int
	path  string
	bytes int64
}

// OpenIPC maps the first h.Bytes bytes of the file h.Path (kind
// nccl.IPCFakeShm) read-write and MAP_SHARED, and registers the mapping
// as an allocation of the calling thread's current device whose bytes ARE
// the mapping: what the exporter writes into the file later is what a
// broadcast from the pointer sends, as with memory shared by CUDA IPC.
// Like cudaIpcOpenMemHandle, opening the same handle again on the same
// device returns the same pointer and counts: each open needs its
// CloseIPC. The mapping is not counted in the device's memory (it is the
// exporter's) and cudaFree refuses it. A cuda handle is refused with an
// error matching nccl.ErrIPCKind.
func (f *Fake) OpenIPC(h nccl.IPCHandle) (nccl.DevPtr, error) {
	if h.Kind != nccl.IPCFakeShm {
		return 0, fmt.Errorf("nccltest: the fake NCCL (a TEST DOUBLE) opens fake_shm snapshots only, not %q: %w", h.Kind, nccl.ErrIPCKind)
	}
	fail := func(detail string, args ...any) (nccl.DevPtr, error) {
		return 0, &nccl.Error{Func: "cudaIpcOpenMemHandle (fake_shm)", Code: nccl.CudaErrorInvalidValue, Detail: fmt.Sprintf(detail, args...)}
	}
	if h.Bytes <= 0 || int64(int(h.Bytes)) != h.Bytes {
		return fail("%s: %d bytes to map", h.Path, h.Bytes)
	}
	f.mu.Lock()
	key := ipcKey{dev: f.device(), path: h.Path, bytes: h.Bytes}
	if a := f.ipcAlloc(key); a != nil {
		a.ipc.refs++
		f.mu.Unlock()
		return nccl.DevPtr(a.base), nil
	}
	f.mu.Unlock()

	file, err := os.OpenFile(h.Path, os.O_RDWR, 0)
	if err != nil {
		return fail("%v", err)
	}
	defer file.Close() // the mapping outlives the descriptor
	st, err := file.Stat()
	if err != nil {
		return fail("%v", err)
	}
	if st.Size() < h.Bytes {
		// Bytes past the end of the file would be SIGBUS, not an error.
		return fail("%s holds %d bytes, the handle maps %d", h.Path, st.Size(), h.Bytes)
	}
	mem, err := syscall.Mmap(int(file.Fd()), 0, int(h.Bytes), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return fail("mmap %s: %v", h.Path, err)
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	if a := f.ipcAlloc(key); a != nil { // opened meanwhile by another thread
		_ = syscall.Munmap(mem)
		a.ipc.refs++
		return nccl.DevPtr(a.base), nil
	}
	d := key.dev
	base := (max(devBase(d), f.bump[d]) + 255) &^ 255
	f.bump[d] = base + uintptr(len(mem))
	a := &fakeAlloc{dev: d, base: base, mem: mem, ipc: &fakeIPC{key: key, refs: 1}}
	i := sort.Search(len(f.allocs), func(i int) bool { return f.allocs[i].base > base })
	f.allocs = append(f.allocs, nil)
	copy(f.allocs[i+1:], f.allocs[i:])
	f.allocs[i] = a
	return nccl.DevPtr(base), nil
}

// CloseIPC undoes one OpenIPC of p; the last one unmaps the file. Every
// access of the fake to device memory happens under its lock, so an
// operation still queued on a stream that reads the mapping afterwards
// fails with an illegal address instead of touching unmapped memory.
func (f *Fake) CloseIPC(p nccl.DevPtr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, a := range f.allocs {
		if a.base != uintptr(p) || a.ipc == nil {
			continue
		}
		if a.ipc.refs--; a.ipc.refs > 0 {
			return nil
		}
		f.allocs = append(f.allocs[:i], f.allocs[i+1:]...)
		if err := syscall.Munmap(a.mem); err != nil {
			return &nccl.Error{Func: "cudaIpcCloseMemHandle (fake_shm)", Code: nccl.CudaErrorUnknown, Detail: fmt.Sprintf("munmap %s: %v", a.ipc.key.path, err)}
		}
		return nil
	}
	return &nccl.Error{Func: "cudaIpcCloseMemHandle (fake_shm)", Code: nccl.CudaErrorInvalidValue, Detail: fmt.Sprintf("%#x is not an open IPC mapping", uintptr(p))}
}

// ipcAlloc is the open mapping of key, nil if none. f.mu is held.
func (f *Fake) ipcAlloc(key ipcKey) *fakeAlloc {
	for _, a := range f.allocs {
		if a.ipc != nil && a.ipc.key == key {
			return a
		}
	}
	return nil
}
