package cudaipc

import (
	"fmt"

	"github.com/rlflow/rlflow/nccl"
)

// Importer is the GPU's nccl.IPCImporter: CUDA IPC handles only.
var _ nccl.IPCImporter = (*Importer)(nil)

// OpenIPC opens a handle of kind nccl.IPCCUDA with Open. Any other kind is
// refused with an error matching nccl.ErrIPCKind: a fake_shm handle is the
// test double's, which no GPU can map.
func (im *Importer) OpenIPC(h nccl.IPCHandle) (nccl.DevPtr, error) {
	switch h.Kind {
	case nccl.IPCCUDA:
		return im.Open(MemHandle(h.Mem))
	case nccl.IPCFakeShm:
		return 0, fmt.Errorf("cudaipc: a fake_shm snapshot (a TEST DOUBLE) cannot be opened on a real GPU: %w", nccl.ErrIPCKind)
	}
	return 0, fmt.Errorf("cudaipc: IPC kind %q: want %q: %w", h.Kind, nccl.IPCCUDA, nccl.ErrIPCKind)
}

// CloseIPC is Close: it unmaps a block OpenIPC opened.
func (im *Importer) CloseIPC(p nccl.DevPtr) error { return im.Close(p) }
