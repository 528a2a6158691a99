package vllm_test

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/vllm"
)

// unpickled is testdata/ipc_unpickle.py's output.
type unpickled struct {
	Handles      json.RawMessage `json:"handles"`
	Opcodes      []string        `json:"opcodes"`
	RepickledHex string          `json:"repickled_hex"`
}

// unpickleInPython runs testdata/ipc_unpickle.py on ipc_handles_pickled:
// CPython's own unpickler, with stand-ins for torch's globals.
func unpickleInPython(t *testing.T, b64 string) unpickled {
	t.Helper()
	py := testutil.Python3(t, "the round trip of ipc_handles_pickled through CPython's pickle")
	cmd := exec.Command(py, "testdata/ipc_unpickle.py")
	cmd.Stdin = strings.NewReader(b64)
	cmd.Env = append(cmd.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "ipc_unpickle.py: %s", stderr.String())
	var u unpickled
	require.NoError(t, json.Unmarshal(out, &u), "ipc_unpickle.py printed %q", out)
	return u
}

// global, blob and the rest spell ipc_unpickle.py's JSON.
func global(name string) map[string]string { return map[string]string{"global": name} }
func blob(b []byte) map[string]string {
	return map[string]string{"bytes": base64.StdEncoding.EncodeToString(b)}
}

// The golden case read by CPython: one dict per tensor under the GPU UUID,
// holding rebuild_cuda_tensor and torch's 15 arguments (written out here
// by hand, not derived from the encoder); CPython, pickling what it read
// without a memo, writes the same bytes; and the opcodes are those the
// contract allows, all of them.
func TestEncodeIPCHandlesInPython(t *testing.T) {
	st, tensors := ipcCase()
	b64, err := vllm.EncodeIPCHandles(st, tensors)
	require.NoError(t, err)
	u := unpickleInPython(t, b64)

	shape := []struct {
		size, stride []int64
		elemOffset   int64
	}{
		{[]int64{2, 3}, []int64{3, 1}, 0},
		{[]int64{}, []int64{}, 3},
		{[]int64{2, 2, 2}, []int64{4, 2, 1}, 16},
		{[]int64{1, 2, 0, 4}, []int64{8, 4, 4, 1}, 1 << 31},
	}
	var want []map[string]any
	for i, tensor := range tensors {
		var event any
		if tensor.EventHandle != nil {
			event = blob(tensor.EventHandle)
		}
		want = append(want, map[string]any{ipcUUID: map[string]any{
			"func": "torch.multiprocessing.reductions.rebuild_cuda_tensor",
			"args": []any{
				global("torch.Tensor"), map[string]any{"size": shape[i].size}, shape[i].stride, shape[i].elemOffset,
				global("torch.storage.TypedStorage"), global("torch." + tensor.DType),
				3, blob(st.Handle), 5 << 30, 70000, false,
				blob(tensor.CounterHandle), tensor.CounterOffset, event, tensor.EventSyncRequired,
			},
		}})
	}
	wantJSON, err := json.Marshal(want)
	require.NoError(t, err)
	assert.JSONEq(t, string(wantJSON), string(u.Handles))

	raw, err := base64.StdEncoding.DecodeString(b64)
	require.NoError(t, err)
	assert.Equal(t, hex.EncodeToString(raw), u.RepickledHex, "CPython's protocol-3 pickle of the same objects, memo off")

	assert.Equal(t, []string{
		"APPENDS", "BINBYTES", "BININT", "BININT1", "BININT2", "BINUNICODE", "EMPTY_DICT", "EMPTY_LIST",
		"EMPTY_TUPLE", "GLOBAL", "LONG1", "MARK", "NEWFALSE", "NEWTRUE", "NONE", "PROTO", "REDUCE",
		"SETITEM", "SHORT_BINBYTES", "STOP", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
	}, u.Opcodes)
}

// A single tensor is a one-item MARK ... APPENDS, which CPython reads
// (its own pickler would write APPEND there).
func TestEncodeIPCHandlesOneTensorInPython(t *testing.T) {
	st, tensors := ipcCase()
	b64, err := vllm.EncodeIPCHandles(st, tensors[1:2])
	require.NoError(t, err)
	u := unpickleInPython(t, b64)
	var handles []map[string]struct {
		Func string            `json:"func"`
		Args []json.RawMessage `json:"args"`
	}
	require.NoError(t, json.Unmarshal(u.Handles, &handles))
	require.Len(t, handles, 1)
	h, ok := handles[0][ipcUUID]
	require.True(t, ok, "keyed by the GPU UUID: %s", u.Handles)
	assert.Equal(t, "torch.multiprocessing.reductions.rebuild_cuda_tensor", h.Func)
	require.Len(t, h.Args, 15)
	assert.JSONEq(t, `{"size":[]}`, string(h.Args[1]))
	assert.JSONEq(t, `{"global":"torch.float32"}`, string(h.Args[5]))
	assert.Equal(t, "null", string(h.Args[13]))
}
