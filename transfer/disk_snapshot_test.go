package transfer

import (
	"context"
	"errors"
	"testing"

	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
)

// The disk backend refuses a resident trainer's snapshot before calling any
// server: it loads checkpoint directories, and the snapshot is GPU memory.
func TestDiskRefusesASnapshot(t *testing.T) {
	_, c, rec := recordedDouble(t, double.Config{Backend: double.BackendDisk})
	snap := &trainer.Snapshot{Version: "v1", IPC: trainer.IPCFakeShm, Path: "/dev/shm/snap", StorageBytes: 8,
		Tensors: []trainer.Tensor{{Name: "w", DType: "float32", Shape: []int64{2}, Bytes: 8}}}
	_, err := NewDisk().Update(context.Background(), UpdateRequest{Target: Target{RunID: "run", Fleet: vllm.Fleet{c}}, Snapshot: snap, Version: "v1"})
	var te *Error
	const want = "publish from a resident trainer needs weight_transfer.backend nccl or ipc: its snapshot lives in the trainer's GPU memory, and the disk backend loads checkpoint directories"
	if !errors.As(err, &te) || te.Kind != BadInput || err.Error() != want {
		t.Fatalf("got %v\nwant BadInput: %s", err, want)
	}
	if lines := rec.Lines(); len(lines) != 0 {
		t.Fatalf("requests reached the server: %q", lines)
	}
}
