package vllm_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm"
)

// ipcRecorder is a server that answers every request 200 {} and records
// "METHOD path body": the ipc wire is checked without a server-side ipc
// engine.
type ipcRecorder struct {
	URL  string
	mu   sync.Mutex
	reqs []string
}

func newIPCRecorder(t *testing.T) *ipcRecorder {
	r := &ipcRecorder{}
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		b, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		r.reqs = append(r.reqs, req.Method+" "+req.URL.Path+" "+string(b))
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, "{}")
	}))
	t.Cleanup(hs.Close)
	r.URL = hs.URL
	return r
}

func (r *ipcRecorder) requests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.reqs...)
}

func ipcUpdate(t *testing.T) vllm.UpdateInfo {
	st, tensors := ipcCase()
	enc, err := vllm.EncodeIPCHandles(st, tensors)
	require.NoError(t, err)
	u := vllm.UpdateInfo{IPCHandlesPickled: enc, CheckpointBytes: 1 << 30}
	for _, tensor := range tensors {
		u.Names = append(u.Names, tensor.Name)
		u.DTypeNames = append(u.DTypeNames, tensor.DType)
		u.Shapes = append(u.Shapes, tensor.Shape)
	}
	return u
}

// C, D and E: init_info {} and one update_info object with the handles,
// no packed keys; a list is refused on E.
func TestIPCWire(t *testing.T) {
	ctx := context.Background()
	u := ipcUpdate(t)
	wantUpdate := `{"update_info":{"names":["embed.weight","norm.scale","conv.weight","empty.weight"],` +
		`"dtype_names":["bfloat16","float32","int8","float16"],"shapes":[[2,3],[],[2,2,2],[1,2,0,4]],` +
		`"ipc_handles_pickled":"` + u.IPCHandlesPickled + `"}}`
	for _, gen := range []vllm.Generation{vllm.GenC, vllm.GenD, vllm.GenE} {
		r := newIPCRecorder(t)
		c, err := vllm.New(r.URL, vllm.Options{Generation: gen})
		require.NoError(t, err)
		require.NoError(t, c.InitWeightTransfer(ctx, vllm.InitInfo{IPC: true}), "generation %s", gen)
		require.NoError(t, c.UpdateWeights(ctx, u), "generation %s", gen)
		reqs := r.requests()
		require.Len(t, reqs, 2, "generation %s", gen)
		assert.Equal(t, `POST /init_weight_transfer_engine {"init_info":{}}`, reqs[0], "generation %s", gen)
		path, body, _ := strings.Cut(strings.TrimPrefix(reqs[1], "POST "), " ")
		assert.Equal(t, "/update_weights", path)
		assert.JSONEq(t, wantUpdate, body, "generation %s", gen)
	}

	r := newIPCRecorder(t)
	e, err := vllm.New(r.URL, vllm.Options{Generation: vllm.GenE})
	require.NoError(t, err)
	err = e.UpdateWeightsPerWorker(ctx, []vllm.UpdateInfo{u, u})
	assert.ErrorContains(t, err, "POST /update_weights: update_info[0]: the ipc backend sends one update_info object (UpdateWeights), not one per worker")
	assert.Empty(t, r.requests(), "refused before any request (even get_world_size)")
}

// Refusals before any request: A and B, which have no ipc backend, and
// bodies vLLM would refuse or misread.
func TestIPCClientSideRefusals(t *testing.T) {
	ctx := context.Background()
	r := newIPCRecorder(t)
	clients := map[vllm.Generation]*vllm.Client{}
	for _, gen := range vllm.Generations {
		c, err := vllm.New(r.URL, vllm.Options{Generation: gen})
		require.NoError(t, err)
		clients[gen] = c
	}
	a, b, d := clients[vllm.GenA], clients[vllm.GenB], clients[vllm.GenD]
	u := ipcUpdate(t)
	with := func(f func(*vllm.UpdateInfo)) vllm.UpdateInfo {
		c := u
		f(&c)
		return c
	}
	for _, c := range []struct {
		err  error
		want string
	}{
		{a.InitWeightTransfer(ctx, vllm.InitInfo{IPC: true}), "POST /init_weight_transfer: generation A has no ipc backend (C, D or E needed)"},
		{b.InitWeightTransfer(ctx, vllm.InitInfo{IPC: true}), "POST /init_weight_transfer_engine: generation B has no ipc backend (C, D or E needed)"},
		{a.UpdateWeights(ctx, u), "POST /update_weights: generation A has no ipc backend (C, D or E needed)"},
		{b.UpdateWeights(ctx, u), "POST /update_weights: generation B has no ipc backend (C, D or E needed)"},
		{d.InitWeightTransfer(ctx, vllm.InitInfo{IPC: true, RankOffset: 1}), "ipc backend: init_info is {}, but NCCL fields are set"},
		{d.InitWeightTransfer(ctx, vllm.InitInfo{IPC: true, Disk: true}), "init_info: the disk and ipc backends are exclusive"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.Packed = true })), "the ipc backend is not packed here"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.PackedNumBuffers = 2 })), "the ipc backend is not packed here"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.Path = "/ckpt" })), "path (disk) and ipc_handles_pickled (ipc) are exclusive"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.Shapes = u.Shapes[:3] })), "4 names, 4 dtype_names, 3 shapes: lengths must match"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.Names = nil; u.DTypeNames = nil; u.Shapes = nil })), "no tensors"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.Shapes = [][]int64{{1}, {-1}, {1}, {1}} })), `tensor "norm.scale" has negative dimension`},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.IPCHandlesPickled = "not base64!" })), "ipc_handles_pickled is not standard base64"},
		{d.UpdateWeights(ctx, with(func(u *vllm.UpdateInfo) { u.IPCHandlesPickled = strings.TrimRight(u.IPCHandlesPickled, "=") })), "ipc_handles_pickled is not standard base64"},
	} {
		require.Error(t, c.err, c.want)
		assert.Contains(t, c.err.Error(), c.want)
	}
	assert.Empty(t, r.requests(), "every refusal happens before a request")
}
