package plan

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

func u8s(sizes ...int64) []Tensor {
	ts := make([]Tensor, len(sizes))
	for i, s := range sizes {
		ts[i] = Tensor{Name: fmt.Sprintf("t%d", i), DType: "uint8", Shape: []int64{s}, Size: s}
	}
	return ts
}

func groups(chunks []PackedChunk) [][]int {
	out := [][]int{}
	for _, c := range chunks {
		out = append(out, c.Tensors)
	}
	return out
}

func TestPackedBoundaries(t *testing.T) {
	tests := []struct {
		name  string
		t     int64
		sizes []int64
		want  [][]int
	}{
		{"empty", 10, nil, [][]int{}},
		{"exactly-T-stays-open", 10, []int64{10}, [][]int{{0}}},
		{"exactly-T-then-more", 10, []int64{10, 1, 3}, [][]int{{0, 1}, {2}}},
		{"T-plus-one-closes", 10, []int64{11, 3}, [][]int{{0}, {1}}},
		{"sum-reaches-T-exactly", 10, []int64{5, 5, 2}, [][]int{{0, 1, 2}}},
		{"sum-reaches-T-exactly-then-ends", 10, []int64{5, 5}, [][]int{{0, 1}}},
		{"crossing-tensor-is-inside", 8, []int64{4, 4, 4, 4, 3}, [][]int{{0, 1, 2}, {3, 4}}},
		{"oversized-alone", 10, []int64{1, 30, 1, 1}, [][]int{{0, 1}, {2, 3}}},
		{"oversized-first", 10, []int64{30, 1}, [][]int{{0}, {1}}},
		{"zero-size-joins-open-chunk", 10, []int64{10, 0}, [][]int{{0, 1}}},
		{"zero-size-remainder-is-a-chunk", 10, []int64{11, 0}, [][]int{{0}, {1}}},
		{"zero-size-only", 10, []int64{0, 0, 0}, [][]int{{0, 1, 2}}},
		{"T-zero", 0, []int64{0, 1, 0, 0, 2}, [][]int{{0, 1}, {2, 3, 4}}},
		{"T-zero-zero-sizes", 0, []int64{0, 0}, [][]int{{0, 1}}},
		{"T-negative-every-tensor", -1, []int64{0, 5, 0}, [][]int{{0}, {1}, {2}}},
		{"T-one", 1, []int64{1, 1, 1, 1, 1}, [][]int{{0, 1}, {2, 3}, {4}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := u8s(tc.sizes...)
			chunks := Packed(ts, tc.t)
			if got := groups(chunks); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Packed = %v, want %v", got, tc.want)
			}
			checkChunks(t, ts, chunks)
		})
	}
}

// checkChunks checks offsets and sizes: back to back, no padding, every
// tensor exactly once in order.
func checkChunks(t *testing.T, ts []Tensor, chunks []PackedChunk) {
	t.Helper()
	next := 0
	for ci, c := range chunks {
		var off int64
		if len(c.Tensors) == 0 || len(c.Tensors) != len(c.Offsets) {
			t.Fatalf("chunk %d: %d tensors, %d offsets", ci, len(c.Tensors), len(c.Offsets))
		}
		for k, i := range c.Tensors {
			if i != next {
				t.Fatalf("chunk %d: tensor %d, want %d", ci, i, next)
			}
			if c.Offsets[k] != off {
				t.Fatalf("chunk %d: offset %d, want %d", ci, c.Offsets[k], off)
			}
			off += ts[i].Size
			next++
		}
		if off != c.Size {
			t.Fatalf("chunk %d: size %d, tensors sum to %d", ci, c.Size, off)
		}
	}
	if next != len(ts) {
		t.Fatalf("chunks hold %d of %d tensors", next, len(ts))
	}
}

// receiverChunks simulates vLLM's packed_nccl_broadcast_consumer: it pulls
// (name, shape, dtype) from an iterator, accumulates, broadcasts when the
// total crosses the target, and on StopIteration broadcasts what is left.
// It returns the byte count of each broadcast and the tensors unpacked from it.
func receiverChunks(ts []Tensor, target int64) (sizes []int64, unpacked [][]string) {
	pos := 0
	next := func() (Tensor, bool) { // the iterator; false = StopIteration
		if pos == len(ts) {
			return Tensor{}, false
		}
		pos++
		return ts[pos-1], true
	}
	for {
		var meta []string
		var total int64
		stopped := false
		for {
			t, ok := next()
			if !ok {
				stopped = true
				break
			}
			meta = append(meta, t.Name)
			total += t.Size
			if total > target {
				break
			}
		}
		if stopped {
			if len(meta) > 0 {
				sizes = append(sizes, total)
				unpacked = append(unpacked, meta)
			}
			return
		}
		sizes = append(sizes, total)
		unpacked = append(unpacked, meta)
	}
}

// producerChunks simulates vLLM's pack_tensors/packed_nccl_broadcast_producer
// on the trainer side: consume until the accumulated size exceeds the buffer
// size or the iterator ends; nothing consumed means no broadcast.
func producerChunks(ts []Tensor, bufferSize int64) (sizes []int64) {
	it := 0
	for {
		var list []int64
		var total int64
		for it < len(ts) {
			list = append(list, ts[it].Size)
			total += ts[it].Size
			it++
			if total > bufferSize {
				break
			}
		}
		if len(list) == 0 {
			return
		}
		sizes = append(sizes, total)
	}
}

func randomSizes(r *rand.Rand, T int64) []int64 {
	n := r.IntN(40)
	sizes := make([]int64, n)
	var run int64
	for i := range sizes {
		var s int64
		switch k := r.IntN(10); {
		case k == 0:
			s = 0
		case k == 1:
			s = T
		case k == 2:
			s = max(T-1, 0)
		case k == 3:
			s = T + 1
		case k == 4 && T > run%max(T, 1):
			// land the running total exactly on T (mod T)
			s = T - run%max(T, 1)
		default:
			s = r.Int64N(3*T + 1)
		}
		sizes[i] = s
		run += s
	}
	return sizes
}

func TestPackedMatchesVLLM(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	thresholds := []int64{0, 1, 2, 3, 7, 8, 64, 1000, 4096}
	for iter := range 20000 {
		T := thresholds[iter%len(thresholds)]
		if iter%7 == 0 {
			T = r.Int64N(10000)
		}
		ts := u8s(randomSizes(r, T)...)
		chunks := Packed(ts, T)
		checkChunks(t, ts, chunks)
		rs, ru := receiverChunks(ts, T)
		ps := producerChunks(ts, T)
		var gotSizes []int64
		var gotNames [][]string
		for _, c := range chunks {
			gotSizes = append(gotSizes, c.Size)
			var names []string
			for _, i := range c.Tensors {
				names = append(names, ts[i].Name)
			}
			gotNames = append(gotNames, names)
		}
		if !reflect.DeepEqual(gotSizes, rs) || !reflect.DeepEqual(gotNames, ru) || !reflect.DeepEqual(gotSizes, ps) {
			t.Fatalf("T=%d sizes=%v:\n Packed   %v %v\n receiver %v %v\n producer %v", T, sizesOf(ts), gotSizes, gotNames, rs, ru, ps)
		}
		// The rule itself: every closed chunk crossed T only with its last tensor.
		for ci, c := range chunks {
			var s int64
			for k, i := range c.Tensors {
				s += ts[i].Size
				last := k == len(c.Tensors)-1
				if !last && s > T {
					t.Fatalf("chunk %d exceeds T before its last tensor", ci)
				}
				if last && ci < len(chunks)-1 && s <= T {
					t.Fatalf("chunk %d closed without exceeding T", ci)
				}
			}
		}
	}
}

func sizesOf(ts []Tensor) []int64 {
	out := make([]int64, len(ts))
	for i, t := range ts {
		out[i] = t.Size
	}
	return out
}

func TestNonPacked(t *testing.T) {
	ts := []Tensor{
		{Name: "a", DType: "bfloat16", Shape: []int64{2, 3}, Size: 12},
		{Name: "b", DType: "float32", Shape: []int64{}, Size: 4},
		{Name: "c", DType: "int64", Shape: []int64{0, 4}, Size: 0},
		{Name: "d", DType: "uint8", Shape: []int64{5}, Size: 5},
		{Name: "e", DType: "int8", Shape: []int64{1}, Size: 1},
		{Name: "f", DType: "int32", Shape: []int64{2}, Size: 8},
		{Name: "g", DType: "float16", Shape: []int64{3}, Size: 6},
		{Name: "h", DType: "float64", Shape: []int64{1}, Size: 8},
		{Name: "i", DType: "float8_e4m3fn", Shape: []int64{3, 5}, Size: 15},
	}
	got, err := NonPacked(ts)
	if err != nil {
		t.Fatal(err)
	}
	want := []Broadcast{
		{0, nccl.Bfloat16, 6, 12}, {1, nccl.Float32, 1, 4}, {2, nccl.Int64, 0, 0}, {3, nccl.Uint8, 5, 5},
		{4, nccl.Int8, 1, 1}, {5, nccl.Int32, 2, 8}, {6, nccl.Float16, 3, 6}, {7, nccl.Float64, 1, 8},
		{8, nccl.Float8e4m3, 15, 15}, // vLLM maps float8_e4m3fn to ncclFloat8e4m3 (10); count = bytes
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("NonPacked = %+v", got)
	}
	// vLLM raises on every other dtype, the other fp8 formats included.
	for _, d := range []string{"uint32", "uint64", "int16", "uint16", "bool", "float8_e5m2", "float8_e8m0fnu", "complex64", "nonsense"} {
		_, err := NonPacked([]Tensor{{Name: "x", DType: d, Shape: []int64{1}, Size: 8}})
		if err == nil || !strings.Contains(err.Error(), `tensor "x"`) || !strings.Contains(err.Error(), d) ||
			!strings.Contains(err.Error(), "(only int8, uint8, int32, int64, float16, float32, float64, bfloat16, float8_e4m3fn); use packed transfer") {
			t.Errorf("dtype %s: %v", d, err)
		}
	}
	if _, err := NonPacked([]Tensor{{Name: "x", DType: "float32", Shape: []int64{1}, Size: 6}}); err == nil {
		t.Error("ragged size accepted")
	}
	// The enum values are nccl.h's.
	enum := map[DataType]int{nccl.Int8: 0, nccl.Uint8: 1, nccl.Int32: 2, nccl.Uint32: 3, nccl.Int64: 4, nccl.Uint64: 5, nccl.Float16: 6, nccl.Float32: 7, nccl.Float64: 8, nccl.Bfloat16: 9, nccl.Float8e4m3: 10}
	for d, v := range enum {
		if int(d) != v {
			t.Errorf("%v = %d, want %d", d, int(d), v)
		}
	}
	if nccl.Bfloat16.String() != "ncclBfloat16" || DataType(42).String() != "ncclDataType(42)" {
		t.Error("String")
	}
}

func TestUpdateInfo(t *testing.T) {
	ts := []Tensor{
		{Name: "model.w", DType: "bfloat16", Shape: []int64{2, 3}, Size: 12},
		{Name: "scale", DType: "float32", Shape: nil, Size: 4},
	}
	u, err := NewTensorMetadata(ts)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(u)
	if string(b) != `{"names":["model.w","scale"],"dtype_names":["bfloat16","float32"],"shapes":[[2,3],[]]}` {
		t.Errorf("json = %s", b)
	}
	p, _ := json.Marshal(PackedFields{Packed: true, BufferSizeBytes: 1 << 30, NumBuffers: 2})
	if string(p) != `{"packed":true,"packed_buffer_size_bytes":1073741824,"packed_num_buffers":2}` {
		t.Errorf("packed json = %s", p)
	}
	ts[0].Shape[0] = 99 // the metadata does not alias the input
	if u.Shapes[0][0] != 2 {
		t.Error("TensorMetadata aliases the tensor list")
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		ts   []Tensor
		want string
	}{
		{"empty-name", []Tensor{{Name: "", DType: "uint8", Size: 1}}, "empty name"},
		{"duplicate", []Tensor{{Name: "a", DType: "uint8", Size: 1}, {Name: "a", DType: "uint8", Size: 1}}, `"a" appears twice`},
		{"dtype", []Tensor{{Name: "a", DType: "torch.float32", Size: 4}}, `unknown dtype "torch.float32"`},
		{"negative", []Tensor{{Name: "a", DType: "uint8", Shape: []int64{-1}, Size: 0}}, "negative dimension"},
		{"size", []Tensor{{Name: "a", DType: "float32", Shape: []int64{3}, Size: 11}}, "size 11, but shape [3] of float32 is 12 bytes"},
		{"overflow", []Tensor{{Name: "a", DType: "float64", Shape: []int64{1 << 62, 2}, Size: 0}}, "overflows"},
	}
	for _, tc := range tests {
		if err := Validate(tc.ts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
		if _, err := NewTensorMetadata(tc.ts); err == nil {
			t.Errorf("%s: NewTensorMetadata accepted", tc.name)
		}
	}
	if err := Validate([]Tensor{{Name: "z", DType: "bool", Shape: []int64{0, 1 << 62, 1 << 62}, Size: 0}}); err != nil {
		t.Errorf("zero dim with huge others: %v", err)
	}
}

func TestFromSafetensors(t *testing.T) {
	infos := []safetensors.TensorInfo{
		{Name: "a", DType: safetensors.BF16, Shape: []int64{2}, Size: 4},
		{Name: "b", DType: safetensors.F32, Shape: []int64{}, Size: 4},
	}
	ts := FromSafetensors(infos)
	want := []Tensor{{Name: "a", DType: "bfloat16", Shape: []int64{2}, Size: 4}, {Name: "b", DType: "float32", Shape: []int64{}, Size: 4}}
	if !reflect.DeepEqual(ts, want) {
		t.Fatalf("FromSafetensors = %+v", ts)
	}
	if err := Validate(ts); err != nil {
		t.Fatal(err)
	}
	if TotalBytes(ts) != 8 {
		t.Error("TotalBytes")
	}
}
