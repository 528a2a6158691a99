//go:build !unix

package nccltest

import (
	"fmt"

	"github.com/rlflow/rlflow/nccl"
)

var _ nccl.IPCImporter = (*Fake)(nil)

// fakeIPC is never set on this platform.
type fakeIPC struct{}

// OpenIPC needs mmap: the fake maps fake_shm files on unix only.
func (f *Fake) OpenIPC(h nccl.IPCHandle) (nccl.DevPtr, error) {
	if h.Kind != nccl.IPCFakeShm {
		return 0, fmt.Errorf("nccltest: the fake NCCL (a TEST DOUBLE) opens fake_shm snapshots only, not %q: %w", h.Kind, nccl.ErrIPCKind)
	}
	return 0, fmt.Errorf("nccltest: fake_shm snapshots are mapped with mmap, which this platform lacks")
}

// CloseIPC has nothing to close on this platform.
func (f *Fake) CloseIPC(p nccl.DevPtr) error {
	return &nccl.Error{Func: "cudaIpcCloseMemHandle (fake_shm)", Code: nccl.CudaErrorInvalidValue, Detail: fmt.Sprintf("%#x is not an open IPC mapping", uintptr(p))}
}
