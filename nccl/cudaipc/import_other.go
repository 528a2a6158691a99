//go:build !(linux && cgo)

package cudaipc

import (
	"errors"

	"github.com/rlflow/rlflow/nccl"
)

var errNoCgo = errors.New("cudaipc: this binary was built without cgo or not for linux, so CUDA IPC handles cannot be opened (rebuild with CGO_ENABLED=1 on linux)")

// Importer is unavailable in this build: New always fails.
type Importer struct{}

// New always fails in a build without cgo or on a platform other than Linux.
func New(*nccl.Library) (*Importer, error) { return nil, errNoCgo }

// CUDARTPath is empty in this build.
func (*Importer) CUDARTPath() string { return "" }

// Open always fails in this build.
func (*Importer) Open(MemHandle) (nccl.DevPtr, error) { return 0, errNoCgo }

// Close always fails in this build.
func (*Importer) Close(nccl.DevPtr) error { return errNoCgo }
