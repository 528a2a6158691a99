// Package plan lays out the NCCL data plane of one weight update: which
// bytes go in which ncclBroadcast, in which order, and the update_info
// metadata vLLM needs to receive them (spec section 6).
//
// Invariants:
//
//   - Everything derives from one ordered []Tensor: the metadata (TensorMetadata)
//     and the broadcast sequence (Packed or NonPacked) list the same tensors
//     in the same order, so a receiver never waits for bytes that do not come.
//   - Packed implements vLLM's rule exactly: append a tensor to the current
//     chunk, add its size to the running total S, and close the chunk after
//     appending when S > T (strict). The remainder, if it holds any tensor
//     (zero-size ones included), is the last chunk. Chunks are byte-contiguous
//     with no padding; each is one ncclBroadcast of ncclUint8.
//   - NonPacked emits one broadcast per tensor, zero-size ones included (vLLM
//     issues those too), with the NCCL data type vLLM's
//     ncclDataTypeEnum.from_torch maps the dtype to; the dtypes it does not
//     map are an error here rather than a 500 (and a hung broadcast) there,
//     and so is a type the loaded NCCL lacks (CheckNCCLVersion: fp8 needs
//     NCCL 2.24).
//   - A packed layout is what vLLM's receiver can unpack (CheckPackedReceivable):
//     it views each tensor in its uint8 chunk by byte offset, dtype, then
//     shape, which fails for a 0-dim tensor and for an offset that is not a
//     multiple of the dtype's item size.
package plan

import (
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

// Tensor is one tensor of an update, in update order.
type Tensor struct {
	Name string
	// DType is the torch attribute name ("bfloat16", "float32", ...), the
	// spelling of update_info.dtype_names.
	DType string
	Shape []int64
	Size  int64 // bytes: prod(Shape) * itemsize
}

// FromSafetensors converts checkpoint tensors, keeping their order.
func FromSafetensors(infos []safetensors.TensorInfo) []Tensor {
	out := make([]Tensor, len(infos))
	for i, ti := range infos {
		out[i] = Tensor{Name: ti.Name, DType: ti.DType.TorchName(), Shape: slices.Clone(ti.Shape), Size: ti.Size}
	}
	return out
}

// Validate checks that names are unique and non-empty, dtypes known, shapes
// non-negative and sizes equal to prod(shape) * itemsize.
func Validate(tensors []Tensor) error {
	seen := make(map[string]int, len(tensors))
	for i, t := range tensors {
		if t.Name == "" {
			return fmt.Errorf("plan: tensor %d: empty name", i)
		}
		if j, dup := seen[t.Name]; dup {
			return fmt.Errorf("plan: tensor %q appears twice (positions %d and %d)", t.Name, j, i)
		}
		seen[t.Name] = i
		d, err := safetensors.DTypeFromTorch(t.DType)
		if err != nil {
			return fmt.Errorf("plan: tensor %q: unknown dtype %q", t.Name, t.DType)
		}
		want, ok := uint64(d.ItemSize()), true
		zero := false
		for _, dim := range t.Shape {
			if dim < 0 {
				return fmt.Errorf("plan: tensor %q: negative dimension in shape %v", t.Name, t.Shape)
			}
			zero = zero || dim == 0
		}
		if zero {
			want = 0
		} else {
			for _, dim := range t.Shape {
				hi, lo := bits.Mul64(want, uint64(dim))
				if hi != 0 || lo > math.MaxInt64 {
					ok = false
					break
				}
				want = lo
			}
		}
		if !ok {
			return fmt.Errorf("plan: tensor %q: shape %v overflows", t.Name, t.Shape)
		}
		if uint64(t.Size) != want || t.Size < 0 {
			return fmt.Errorf("plan: tensor %q: size %d, but shape %v of %s is %d bytes", t.Name, t.Size, t.Shape, t.DType, want)
		}
	}
	return nil
}

// PackedChunk is one packed broadcast.
type PackedChunk struct {
	Tensors []int   // indices into the tensor list, ascending and consecutive
	Offsets []int64 // byte offset of each tensor within the chunk
	Size    int64   // total bytes: the ncclBroadcast count (ncclUint8)
}

// Packed groups tensors into chunks for packed transfer with threshold T =
// packed_buffer_size_bytes (see the package comment for the rule). A tensor
// larger than T is a chunk by itself. It does not validate; see Validate.
func Packed(tensors []Tensor, threshold int64) []PackedChunk {
	var chunks []PackedChunk
	var cur PackedChunk
	for i, t := range tensors {
		cur.Tensors = append(cur.Tensors, i)
		cur.Offsets = append(cur.Offsets, cur.Size)
		cur.Size += t.Size
		if cur.Size > threshold {
			chunks = append(chunks, cur)
			cur = PackedChunk{}
		}
	}
	if len(cur.Tensors) > 0 {
		chunks = append(chunks, cur)
	}
	return chunks
}

// DataType is ncclDataType_t, nccl.DataType itself: the plan names the
// type each non-packed broadcast carries.
type DataType = nccl.DataType

// vllmDataTypes is vLLM's ncclDataTypeEnum.from_torch, in its order: nine
// dtypes. NCCL also has Uint32, Uint64 and Float8e5m2, but a vLLM worker
// raises on them (as on float8_e5m2, float8_e8m0fnu and every other dtype).
var vllmDataTypes = []struct {
	torch string
	nccl  DataType
}{
	{"int8", nccl.Int8}, {"uint8", nccl.Uint8}, {"int32", nccl.Int32}, {"int64", nccl.Int64},
	{"float16", nccl.Float16}, {"float32", nccl.Float32}, {"float64", nccl.Float64}, {"bfloat16", nccl.Bfloat16},
	{"float8_e4m3fn", nccl.Float8e4m3},
}

// NCCLDataType maps a torch dtype name to the NCCL type a vLLM worker
// broadcasts it with.
func NCCLDataType(torchDType string) (DataType, error) {
	names := make([]string, len(vllmDataTypes))
	for i, m := range vllmDataTypes {
		if m.torch == torchDType {
			return m.nccl, nil
		}
		names[i] = m.torch
	}
	return 0, fmt.Errorf("plan: dtype %q has no NCCL type in vLLM's non-packed path (only %s); use packed transfer", torchDType, strings.Join(names, ", "))
}

// Broadcast is one non-packed ncclBroadcast.
type Broadcast struct {
	Tensor int // index into the tensor list
	DType  DataType
	Count  int64 // elements of DType (ncclBroadcast's count)
	Size   int64 // bytes
}

// NonPacked returns one broadcast per tensor, in order. It fails on the
// first tensor vLLM cannot receive this way, or whose size is not a whole
// number of elements.
func NonPacked(tensors []Tensor) ([]Broadcast, error) {
	out := make([]Broadcast, len(tensors))
	for i, t := range tensors {
		d, err := NCCLDataType(t.DType)
		if err != nil {
			return nil, fmt.Errorf("plan: tensor %q: %w", t.Name, err)
		}
		st, _ := safetensors.DTypeFromTorch(t.DType) // every vLLM dtype is known
		item := int64(st.ItemSize())
		if t.Size < 0 || t.Size%item != 0 {
			return nil, fmt.Errorf("plan: tensor %q: size %d is not a multiple of the %s item size %d", t.Name, t.Size, t.DType, item)
		}
		out[i] = Broadcast{Tensor: i, DType: d, Count: t.Size / item, Size: t.Size}
	}
	return out, nil
}

// TensorMetadata is the part of update_info every API generation takes.
type TensorMetadata struct {
	Names      []string  `json:"names"`
	DTypeNames []string  `json:"dtype_names"`
	Shapes     [][]int64 `json:"shapes"`
}

// PackedFields are the packed-transfer settings: in update_info for API
// generations B and C, in init_info for D (and only packed for A).
type PackedFields struct {
	Packed          bool  `json:"packed"`
	BufferSizeBytes int64 `json:"packed_buffer_size_bytes"`
	NumBuffers      int   `json:"packed_num_buffers"`
}

// NewTensorMetadata builds the metadata from the same list the broadcasts are
// planned from, after Validate. Shapes are never null in JSON (a scalar is []).
func NewTensorMetadata(tensors []Tensor) (TensorMetadata, error) {
	if err := Validate(tensors); err != nil {
		return TensorMetadata{}, err
	}
	u := TensorMetadata{
		Names:      make([]string, len(tensors)),
		DTypeNames: make([]string, len(tensors)),
		Shapes:     make([][]int64, len(tensors)),
	}
	for i, t := range tensors {
		u.Names[i] = t.Name
		u.DTypeNames[i] = t.DType
		u.Shapes[i] = append([]int64{}, t.Shape...)
	}
	return u, nil
}

// TotalBytes is the sum of the tensor sizes.
func TotalBytes(tensors []Tensor) int64 {
	var n int64
	for _, t := range tensors {
		n += t.Size
	}
	return n
}
