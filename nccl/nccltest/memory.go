package nccltest

import (
	"fmt"
	"sort"
	"unsafe"

	"github.com/rlflow/rlflow/nccl"
)

// ---- device memory ----

type fakeAlloc struct {
	dev  int
	base uintptr
	mem  []byte
	// ipc is set for a fake_shm mapping OpenIPC made (mem is the mapping):
	// the exporter's memory, not counted as this device's and not freed.
	ipc *fakeIPC
}

// Fake device addresses: device d's allocations live at (d+1)<<40 + offset,
// so a pointer says which device it belongs to, as with CUDA's UVA.
func devBase(d int) uintptr { return uintptr(d+1) << 40 }

func (f *Fake) devSlice(p nccl.DevPtr, n int) ([]byte, int, error) {
	i := sort.Search(len(f.allocs), func(i int) bool { return f.allocs[i].base > uintptr(p) }) - 1
	if i >= 0 {
		a := f.allocs[i]
		off := uintptr(p) - a.base
		if off+uintptr(n) <= uintptr(len(a.mem)) {
			return a.mem[off : off+uintptr(n)], a.dev, nil
		}
	}
	return nil, 0, &nccl.Error{Func: "fake", Code: nccl.CudaErrorIllegalAddress, Detail: fmt.Sprintf("%d bytes at %#x are not inside one device allocation", n, uintptr(p))}
}

func (f *Fake) CUDARuntimeVersion() (int, error) { return 13000, nil }

func (f *Fake) GetDeviceCount() (int, error) { return f.cfg.Devices, nil }

func (f *Fake) SetDevice(d int) error {
	if d < 0 || d >= f.cfg.Devices {
		return &nccl.Error{Func: "cudaSetDevice", Code: nccl.CudaErrorInvalidDevice}
	}
	f.mu.Lock()
	f.cur[nccl.ThreadID()] = d
	f.mu.Unlock()
	return nil
}

func (f *Fake) MemGetInfo() (uint64, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.device()
	return f.cfg.DeviceMemory - f.used[d], f.cfg.DeviceMemory, nil
}

func (f *Fake) Malloc(n int) (nccl.DevPtr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.device()
	if n <= 0 || f.used[d]+uint64(n) > f.cfg.DeviceMemory {
		return 0, &nccl.Error{Func: "cudaMalloc", Code: nccl.CudaErrorMemoryAllocation, Detail: fmt.Sprintf("%d bytes on fake device %d (%d of %d in use)", n, d, f.used[d], f.cfg.DeviceMemory)}
	}
	// Bump allocation, 256-byte aligned like cudaMalloc; addresses are
	// never reused, so a use after free is an illegal address.
	base := max(devBase(d), f.bump[d])
	base = (base + 255) &^ 255
	f.bump[d] = base + uintptr(n)
	a := &fakeAlloc{dev: d, base: base, mem: make([]byte, n)}
	i := sort.Search(len(f.allocs), func(i int) bool { return f.allocs[i].base > base })
	f.allocs = append(f.allocs, nil)
	copy(f.allocs[i+1:], f.allocs[i:])
	f.allocs[i] = a
	f.used[d] += uint64(n)
	return nccl.DevPtr(base), nil
}

func (f *Fake) Free(p nccl.DevPtr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, a := range f.allocs {
		if a.base == uintptr(p) && a.ipc != nil {
			return &nccl.Error{Func: "cudaFree", Code: nccl.CudaErrorInvalidValue, Detail: fmt.Sprintf("%#x is an IPC mapping (close it with CloseIPC)", uintptr(p))}
		}
		if a.base == uintptr(p) {
			f.used[a.dev] -= uint64(len(a.mem))
			f.allocs = append(f.allocs[:i], f.allocs[i+1:]...)
			return nil
		}
	}
	return &nccl.Error{Func: "cudaFree", Code: nccl.CudaErrorInvalidValue, Detail: fmt.Sprintf("%#x is not an allocation", uintptr(p))}
}

func (f *Fake) Memset(p nccl.DevPtr, v byte, n int) error { return f.memset(p, v, n) }

func (f *Fake) MemsetAsync(p nccl.DevPtr, v byte, n int, s nccl.Stream) error {
	return f.enqueue(s, "cudaMemsetAsync", func() error { return f.memset(p, v, n) })
}

// memset sets n bytes of device memory at p to v.
func (f *Fake) memset(p nccl.DevPtr, v byte, n int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, _, err := f.devSlice(p, n)
	if err != nil {
		return err
	}
	for i := range b {
		b[i] = v
	}
	return nil
}

// ---- host memory ----

func (f *Fake) HostAlloc(n int, flags uint) ([]byte, error) {
	if n <= 0 {
		return nil, &nccl.Error{Func: "cudaHostAlloc", Code: nccl.CudaErrorInvalidValue}
	}
	b := make([]byte, n)
	f.mu.Lock()
	f.hostMem[uintptr(unsafe.Pointer(&b[0]))] = b
	f.mu.Unlock()
	f.pinned.Add(b, true)
	return b, nil
}

func (f *Fake) FreeHost(b []byte) error {
	if !f.pinned.Remove(b, true) {
		return &nccl.Error{Func: "cudaFreeHost", Code: nccl.CudaErrorInvalidValue, Detail: "not a HostAlloc allocation"}
	}
	f.mu.Lock()
	delete(f.hostMem, uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	f.mu.Unlock()
	return nil
}

func (f *Fake) HostRegister(b []byte, flags uint) error {
	if len(b) == 0 {
		return nil
	}
	// Like CUDA, any overlap with pinned memory is refused, so that callers
	// that register a mapping piecewise must keep the pieces disjoint.
	if f.pinned.Overlaps(b) {
		return &nccl.Error{Func: "cudaHostRegister", Code: nccl.CudaErrorHostMemAlreadyReg}
	}
	f.pinned.Add(b, false)
	return nil
}

func (f *Fake) HostUnregister(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if !f.pinned.Remove(b, false) {
		return &nccl.Error{Func: "cudaHostUnregister", Code: nccl.CudaErrorHostMemNotReg}
	}
	return nil
}

func (f *Fake) MemcpyHtoDAsync(dst nccl.DevPtr, src []byte, s nccl.Stream) error {
	if len(src) == 0 {
		return nil
	}
	if !f.pinned.Contains(src) {
		return fmt.Errorf("cudaMemcpyAsync HtoD: %w", nccl.ErrNotPinned)
	}
	f.mu.Lock()
	_, _, err := f.devSlice(dst, len(src))
	f.mu.Unlock()
	if err != nil {
		return err
	}
	// Like the GPU, read the host bytes when the copy executes, not now.
	return f.enqueue(s, "cudaMemcpyAsync HtoD", func() error {
		// Memory unregistered (or freed) before its copy ran is a bug the
		// GPU would not report: the fake does.
		if !f.pinned.Contains(src) {
			return &nccl.Error{Func: "fake", Code: nccl.CudaErrorIllegalAddress, Detail: "host memory of a pending HtoD copy was unregistered or freed before the copy ran"}
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		d, _, err := f.devSlice(dst, len(src))
		if err != nil {
			return err
		}
		copy(d, src)
		return nil
	})
}

func (f *Fake) MemcpyDtoHAsync(dst []byte, src nccl.DevPtr, s nccl.Stream) error {
	if len(dst) == 0 {
		return nil
	}
	if !f.pinned.Contains(dst) {
		return fmt.Errorf("cudaMemcpyAsync DtoH: %w", nccl.ErrNotPinned)
	}
	return f.enqueue(s, "cudaMemcpyAsync DtoH", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		d, _, err := f.devSlice(src, len(dst))
		if err != nil {
			return err
		}
		copy(dst, d)
		return nil
	})
}

func (f *Fake) MemcpyDtoDAsync(dst, src nccl.DevPtr, n int, s nccl.Stream) error {
	if n == 0 {
		return nil
	}
	return f.enqueue(s, "cudaMemcpyAsync DtoD", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		d, _, err := f.devSlice(dst, n)
		if err != nil {
			return err
		}
		sb, _, err := f.devSlice(src, n)
		if err != nil {
			return err
		}
		copy(d, sb)
		return nil
	})
}
