package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

const ipcTestUUID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"

// ipcDouble is a generation-E double of vLLM's ipc backend on the GPU
// ipcTestUUID, opening the fake_shm snapshots' files (double.FileIPC).
func ipcDouble(t *testing.T, mod func(*double.Config)) (*double.Server, *vllm.Client, func() []string) {
	cfg := double.Config{Generation: double.GenE, Backend: double.BackendIPC, GPUUUID: ipcTestUUID,
		IPCOpener: double.FileIPC{}, AllowInsecureSerialization: true}
	if mod != nil {
		mod(&cfg)
	}
	d, c, rec := recordedDouble(t, cfg)
	return d, c, rec.Lines
}

// fakeSnapshot writes model's one tensor into a fake_shm file at a storage
// offset within it, as the TEST DOUBLE trainer exports its snapshot, with
// one ref-counter share per tensor.
func fakeSnapshot(t *testing.T, m *bigram.Model, version string) *trainer.Snapshot {
	t.Helper()
	const storageOffset = 512
	data := m.Bytes()
	path := filepath.Join(t.TempDir(), "snapshot.shm")
	file := append(bytes.Repeat([]byte{0xEE}, storageOffset), data...)
	require.NoError(t, os.WriteFile(path, file, 0o600))
	return &trainer.Snapshot{Version: version, IPC: trainer.IPCFakeShm, Path: path, GPUUUID: ipcTestUUID,
		StorageBytes: int64(len(data)), StorageOffset: storageOffset, Iteration: 1,
		Tensors: []trainer.Tensor{{Name: bigram.TensorName, DType: "float32", Shape: []int64{bigram.Vocab, bigram.Vocab}, Bytes: int64(len(data))}},
		Refs:    []trainer.IPCRef{{CounterHandle: []byte("fake_refcounter"), CounterOffset: 0}}}
}

// The ipc backend hands the double the snapshot's handles in one session:
// init_info {}, start, update_weights with the pickle, finish with the
// version; the double serves the snapshot's bytes after it, and took the
// one ref-counter share. A second update (the next publish) needs no init.
func TestIPCUpdateLoadsTheSnapshot(t *testing.T) {
	d, c, lines := ipcDouble(t, nil)
	ctx := context.Background()
	e := NewIPC()
	trained, err := bigram.Train("the cat sat on the mat", bigram.TrainOptions{})
	require.NoError(t, err)
	require.NotEqual(t, trained.Checksum(), d.Model().Checksum(), "the double starts on other weights")

	req := UpdateRequest{Target: Target{RunID: "run", Fleet: vllm.Fleet{c}}, Snapshot: fakeSnapshot(t, trained, "v1"), Version: "v1"}
	res, err := e.Update(ctx, req)
	require.NoError(t, err)
	assert.Equal(t, UpdateResult{Bytes: int64(len(trained.Bytes())), Tensors: 1, Source: SourceSnapshot, Group: GroupKey(req.Target),
		Initialized: true, Methods: []string{MethodIPC}, Elapsed: res.Elapsed}, res)
	assert.Equal(t, trained.Checksum(), d.Model().Checksum(), "the double serves the snapshot's weights")
	assert.Equal(t, "v1", d.WeightVersion())
	assert.Equal(t, 1, d.IPCRefs().Held+d.IPCRefs().Released, "one ref-counter share per tensor")
	var posts []string
	for _, l := range lines() {
		if route, _, _ := strings.Cut(l, " {"); strings.HasPrefix(l, "POST ") {
			posts = append(posts, route)
		}
	}
	assert.Equal(t, []string{"POST /init_weight_transfer_engine", "POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update"}, posts)

	again, err := bigram.Train("a dog ran", bigram.TrainOptions{})
	require.NoError(t, err)
	req.Snapshot, req.Version = fakeSnapshot(t, again, "v2"), "v2"
	res, err = e.Update(ctx, req)
	require.NoError(t, err)
	assert.False(t, res.Initialized)
	assert.Equal(t, again.Checksum(), d.Model().Checksum())
}

// What the ipc backend refuses before any server is called, and what a
// server's refusal does: the session closes and the weights are labelled
// failed.
func TestIPCRefusals(t *testing.T) {
	m := bigram.Random(3)
	for _, tc := range []struct {
		name string
		mod  func(*trainer.Snapshot, *UpdateRequest)
		want string
	}{
		{"a checkpoint", func(_ *trainer.Snapshot, r *UpdateRequest) { r.Snapshot, r.Checkpoint = nil, "/ckpt" },
			"the ipc backend hands vLLM a resident trainer's GPU memory: a checkpoint cannot go this way (use publish, or backend nccl or disk for checkpoints)"},
		{"no refs", func(s *trainer.Snapshot, _ *UpdateRequest) { s.Refs = nil },
			"the trainer's publish has 0 ipc_refs for 1 tensors: vLLM's ipc backend needs one ref-counter share per tensor"},
		{"no uuid", func(s *trainer.Snapshot, _ *UpdateRequest) { s.GPUUUID = "" },
			"the trainer's publish reported no gpu_uuid: vLLM's ipc backend finds each tensor's handle by its GPU's UUID"},
		{"a tensor past the storage", func(s *trainer.Snapshot, _ *UpdateRequest) { s.StorageBytes-- },
			"the trainer's snapshot cannot be handed to vLLM's ipc backend: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, c, lines := ipcDouble(t, nil)
			req := UpdateRequest{Target: Target{RunID: "run", Fleet: vllm.Fleet{c}}, Snapshot: fakeSnapshot(t, m, "v1"), Version: "v1"}
			tc.mod(req.Snapshot, &req)
			_, err := NewIPC().Update(context.Background(), req)
			var te *Error
			require.True(t, errors.As(err, &te), "%v", err)
			assert.Equal(t, BadInput, te.Kind)
			assert.True(t, strings.HasPrefix(err.Error(), tc.want), "got %q\nwant prefix %q", err, tc.want)
			assert.Empty(t, lines(), "no request reached the server")
		})
	}

	t.Run("the server's GPU is another", func(t *testing.T) {
		other := "11111111-2222-3333-4444-555555555555"
		d, c, _ := ipcDouble(t, func(cfg *double.Config) { cfg.GPUUUID = other })
		before := d.Model().Checksum()
		_, err := NewIPC().Update(context.Background(), UpdateRequest{Target: Target{RunID: "run", Fleet: vllm.Fleet{c}},
			Snapshot: fakeSnapshot(t, m, "v1"), Version: "v1"})
		require.Error(t, err)
		assert.Contains(t, err.Error(), fmt.Sprintf("IPC handle not found for GPU UUID %s", other))
		assert.Contains(t, err.Error(), "the server closed its update session itself, weights labelled v1-failed")
		assert.Equal(t, before, d.Model().Checksum())
		assert.Equal(t, "v1-failed", d.WeightVersion())
	})
}
