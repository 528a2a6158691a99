package vllm_test

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"flag"
	"fmt"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/goldenfile"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func golden(t *testing.T, name, got string) {
	t.Helper()
	goldenfile.Check(t, name, got, *update, "go test ./vllm -run "+t.Name()+" -update")
}

const ipcUUID = "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"

// ipcCase is a small publish whose pickle uses every opcode the writer
// has: a 2-, 0-, 3- and 4-dimensional tensor (a zero dimension among
// them), an event handle and None, short and long bytes, and ints of
// every width (StorageBytes and the last tensor's element offset need
// LONG1).
func ipcCase() (vllm.IPCStorage, []vllm.IPCTensor) {
	handle := make([]byte, 64)
	for i := range handle {
		handle[i] = byte(i)
	}
	counter := []byte("/torch_4242_1234567_0")
	st := vllm.IPCStorage{GPUUUID: ipcUUID, Device: 3, Handle: handle, StorageBytes: 5 << 30, StorageOffset: 70000}
	return st, []vllm.IPCTensor{
		{Name: "embed.weight", DType: "bfloat16", Shape: []int64{2, 3}, Offset: 0,
			CounterHandle: counter, CounterOffset: 0, EventHandle: bytes.Repeat([]byte{0xee}, 64), EventSyncRequired: true},
		{Name: "norm.scale", DType: "float32", Shape: []int64{}, Offset: 12,
			CounterHandle: bytes.Repeat([]byte("counter."), 40), CounterOffset: 300},
		{Name: "conv.weight", DType: "int8", Shape: []int64{2, 2, 2}, Offset: 16, CounterHandle: counter, CounterOffset: 70000},
		{Name: "empty.weight", DType: "float16", Shape: []int64{1, 2, 0, 4}, Offset: 4 << 30, CounterHandle: counter, CounterOffset: 3},
	}
}

func TestEncodeIPCHandlesGolden(t *testing.T) {
	st, tensors := ipcCase()
	got, err := vllm.EncodeIPCHandles(st, tensors)
	require.NoError(t, err)
	golden(t, "ipc_handles.golden", got+"\n")
	again, err := vllm.EncodeIPCHandles(st, tensors)
	require.NoError(t, err)
	assert.Equal(t, got, again, "the output is a function of the input")
}

// One scalar, spelled out opcode by opcode: what the golden file holds
// for four tensors, checkable by eye.
func TestEncodeIPCHandlesBytes(t *testing.T) {
	st := vllm.IPCStorage{GPUUUID: ipcUUID, Device: 1, Handle: []byte{0xaa, 0xbb}, StorageBytes: 8, StorageOffset: 512}
	got, err := vllm.EncodeIPCHandles(st, []vllm.IPCTensor{{Name: "s", DType: "float32", Shape: []int64{}, Offset: 4, CounterHandle: []byte("rc"), CounterOffset: 7}})
	require.NoError(t, err)
	raw, err := base64.StdEncoding.DecodeString(got)
	require.NoError(t, err)
	var want bytes.Buffer
	for _, part := range []string{
		"\x80\x03",                    // PROTO 3
		"]",                           // EMPTY_LIST
		"(",                           // MARK
		"}",                           // EMPTY_DICT
		"X\x24\x00\x00\x00" + ipcUUID, // BINUNICODE uuid
		"ctorch.multiprocessing.reductions\nrebuild_cuda_tensor\n", // GLOBAL
		"(",                              // MARK (args)
		"ctorch\nTensor\n",               // 0
		"ctorch\nSize\n)\x85R",           // 1: Size(()) = GLOBAL, EMPTY_TUPLE, TUPLE1, REDUCE
		")",                              // 2: strides ()
		"K\x01",                          // 3: element offset 4/4
		"ctorch.storage\nTypedStorage\n", // 4
		"ctorch\nfloat32\n",              // 5
		"K\x01",                          // 6: device
		"C\x02\xaa\xbb",                  // 7: SHORT_BINBYTES handle
		"K\x08",                          // 8: storage bytes
		"M\x00\x02",                      // 9: storage offset 512
		"\x89",                           // 10: NEWFALSE
		"C\x02rc",                        // 11
		"K\x07",                          // 12
		"N",                              // 13: None
		"\x89",                           // 14
		"t",                              // TUPLE (args)
		"\x86",                           // TUPLE2 (func, args)
		"s",                              // SETITEM
		"e",                              // APPENDS
		".",                              // STOP
	} {
		want.WriteString(part)
	}
	assert.Equal(t, hex.EncodeToString(want.Bytes()), hex.EncodeToString(raw))
}

// Every refusal names the tensor (index and name) or the storage, and the
// field.
func TestEncodeIPCHandlesRefusals(t *testing.T) {
	type edit struct {
		name    string
		storage func(*vllm.IPCStorage)
		tensors func([]vllm.IPCTensor) []vllm.IPCTensor
	}
	one := func(f func(*vllm.IPCTensor)) func([]vllm.IPCTensor) []vllm.IPCTensor {
		return func(ts []vllm.IPCTensor) []vllm.IPCTensor { f(&ts[1]); return ts }
	}
	cases := []edit{
		{name: "uuid uppercase", storage: func(s *vllm.IPCStorage) { s.GPUUUID = strings.ToUpper(ipcUUID) }},
		{name: "uuid with GPU- prefix", storage: func(s *vllm.IPCStorage) { s.GPUUUID = "GPU-" + ipcUUID }},
		{name: "uuid empty", storage: func(s *vllm.IPCStorage) { s.GPUUUID = "" }},
		{name: "uuid short group", storage: func(s *vllm.IPCStorage) { s.GPUUUID = ipcUUID[:35] }},
		{name: "device negative", storage: func(s *vllm.IPCStorage) { s.Device = -1 }},
		{name: "handle empty", storage: func(s *vllm.IPCStorage) { s.Handle = nil }},
		{name: "storage bytes negative", storage: func(s *vllm.IPCStorage) { s.StorageBytes = -1 }},
		{name: "storage offset negative", storage: func(s *vllm.IPCStorage) { s.StorageOffset = -1 }},
		{name: "no tensors", tensors: func([]vllm.IPCTensor) []vllm.IPCTensor { return nil }},
		{name: "dtype unknown", tensors: one(func(t *vllm.IPCTensor) { t.DType = "float128" })},
		{name: "dtype empty", tensors: one(func(t *vllm.IPCTensor) { t.DType = "" })},
		{name: "dimension negative", tensors: one(func(t *vllm.IPCTensor) { t.Shape = []int64{2, -3} })},
		{name: "shape overflows elements", tensors: one(func(t *vllm.IPCTensor) { t.Shape = []int64{1 << 32, 1 << 32} })},
		{name: "shape overflows strides before a zero", tensors: one(func(t *vllm.IPCTensor) { t.Shape = []int64{1 << 32, 1 << 32, 1 << 32, 0} })},
		{name: "shape overflows bytes", tensors: one(func(t *vllm.IPCTensor) { t.Shape = []int64{1 << 62} })},
		{name: "offset negative", tensors: one(func(t *vllm.IPCTensor) { t.Offset = -4 })},
		{name: "offset misaligned", tensors: one(func(t *vllm.IPCTensor) { t.Offset = 14 })},
		{name: "tensor past the storage end", tensors: one(func(t *vllm.IPCTensor) { t.Shape = []int64{2}; t.Offset = 5<<30 - 4 })},
		{name: "offset past the storage end", tensors: one(func(t *vllm.IPCTensor) { t.Shape = []int64{0}; t.Offset = 5<<30 + 4 })},
		{name: "ref counter handle empty", tensors: one(func(t *vllm.IPCTensor) { t.CounterHandle = []byte{} })},
		{name: "ref counter offset negative", tensors: one(func(t *vllm.IPCTensor) { t.CounterOffset = -1 })},
		{name: "event handle short", tensors: one(func(t *vllm.IPCTensor) { t.EventHandle = make([]byte, 63) })},
		{name: "event handle empty, not nil", tensors: one(func(t *vllm.IPCTensor) { t.EventHandle = []byte{} })},
	}
	var out strings.Builder
	for _, c := range cases {
		st, ts := ipcCase()
		if c.storage != nil {
			c.storage(&st)
		}
		if c.tensors != nil {
			ts = c.tensors(ts)
		}
		got, err := vllm.EncodeIPCHandles(st, ts)
		if !assert.Error(t, err, c.name) {
			continue
		}
		assert.Empty(t, got, c.name)
		assert.NotContains(t, err.Error(), "\xaa", "no handle bytes in errors")
		fmt.Fprintf(&out, "%s: %v\n", c.name, err)
	}
	golden(t, "ipc_errors.golden", out.String())
}

// Edge cases that are valid: a tensor ending exactly at the storage's
// end, an empty tensor at it, an empty storage holding only empty tensors
// (whose strides fit though their dimensions' product would not).
func TestEncodeIPCHandlesBounds(t *testing.T) {
	st, _ := ipcCase()
	st.StorageBytes = 16
	for _, tensor := range []vllm.IPCTensor{
		{DType: "float32", Shape: []int64{4}, Offset: 0},
		{DType: "float64", Shape: []int64{1}, Offset: 8},
		{DType: "bool", Shape: []int64{0}, Offset: 16},
	} {
		tensor.Name, tensor.CounterHandle = "t", []byte("rc")
		_, err := vllm.EncodeIPCHandles(st, []vllm.IPCTensor{tensor})
		assert.NoError(t, err, "%+v", tensor)
	}
	st.StorageBytes = 0
	for _, shape := range [][]int64{{3, 0}, {1 << 32, 1 << 32, 0}} {
		_, err := vllm.EncodeIPCHandles(st, []vllm.IPCTensor{{Name: "t", DType: "int64", Shape: shape, CounterHandle: []byte("rc")}})
		assert.NoError(t, err, "shape %v", shape)
	}
}

// Whatever the input, EncodeIPCHandles returns an error or a protocol-3
// pickle ending in STOP, and never panics.
func FuzzEncodeIPCHandlesNoPanic(f *testing.F) {
	f.Add(ipcUUID, []byte("handle"), int64(64), int64(0), "float32", int64(2), int64(3), int64(8), []byte("rc"), []byte(nil), 1)
	f.Add("GPU-x", []byte(nil), int64(-1), int64(-1), "float128", int64(-1), int64(1<<40), int64(3), []byte(nil), make([]byte, 64), 0)
	f.Fuzz(func(t *testing.T, uuid string, handle []byte, storageBytes, storageOffset int64, dtype string, d0, d1, offset int64, counter, event []byte, n int) {
		if uuid == "" {
			uuid = ipcUUID // reach the tensor checks
		}
		st := vllm.IPCStorage{GPUUUID: uuid, Device: 0, Handle: handle, StorageBytes: storageBytes, StorageOffset: storageOffset}
		tensor := vllm.IPCTensor{Name: "t", DType: dtype, Shape: []int64{d0, d1}, Offset: offset, CounterHandle: counter, EventHandle: event}
		tensors := make([]vllm.IPCTensor, max(0, min(n, 3)))
		for i := range tensors {
			tensors[i] = tensor
		}
		got, err := vllm.EncodeIPCHandles(st, tensors)
		if err != nil {
			return
		}
		raw, err := base64.StdEncoding.DecodeString(got)
		if err != nil || len(raw) < 3 || raw[0] != 0x80 || raw[1] != 3 || raw[len(raw)-1] != '.' {
			t.Fatalf("not a protocol-3 pickle: %x", raw)
		}
	})
}
