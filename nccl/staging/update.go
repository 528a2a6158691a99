package staging

import (
	"fmt"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/safetensors"
)

// Update is one weight update laid out for the wire: the tensors in update
// order with their wire dtypes (what update_info describes) and the
// broadcasts that carry them, both derived from the same list by nccl/plan.
type Update struct {
	Tensors   []plan.Tensor
	Chunks    []Chunk
	Packed    bool
	Threshold int64 // packed_buffer_size_bytes when Packed
}

// Metadata is update_info's names, dtype_names and shapes for u.
func (u Update) Metadata() (plan.TensorMetadata, error) { return plan.NewTensorMetadata(u.Tensors) }

// Bytes is the size of the update on the wire.
func (u Update) Bytes() int64 { return plan.TotalBytes(u.Tensors) }

// KeepDType sends every tensor in its file dtype.
func KeepDType(t safetensors.TensorInfo) safetensors.DType { return t.DType }

// F32ToBF16 sends float32 tensors as bfloat16 (converted during the host
// copy, rounding to nearest even) and everything else as it is.
func F32ToBF16(t safetensors.TensorInfo) safetensors.DType {
	if t.DType == safetensors.F32 {
		return safetensors.BF16
	}
	return t.DType
}

// Plan lays out the transfer of tensors (in that order, usually
// Checkpoint.Tensors()) with nccl/plan: packed chunks closed once their size
// exceeds threshold, or one broadcast per tensor. wire gives each tensor's
// dtype on the wire (nil: KeepDType).
func Plan(tensors []safetensors.TensorInfo, packed bool, threshold int64, wire func(safetensors.TensorInfo) safetensors.DType) (Update, error) {
	if wire == nil {
		wire = KeepDType
	}
	if packed && threshold <= 0 {
		return Update{}, fmt.Errorf("staging: packed threshold %d must be positive", threshold)
	}
	wd := make([]safetensors.DType, len(tensors))
	pt := make([]plan.Tensor, len(tensors))
	for i, t := range tensors {
		wd[i] = wire(t)
		if _, err := converter(t.DType, wd[i]); err != nil {
			return Update{}, fmt.Errorf("staging: tensor %q: %w", t.Name, err)
		}
		si := int64(t.DType.ItemSize())
		if si == 0 || t.Size%si != 0 {
			return Update{}, fmt.Errorf("staging: tensor %q: %d bytes of %s", t.Name, t.Size, t.DType)
		}
		pt[i] = plan.Tensor{Name: t.Name, DType: wd[i].TorchName(), Shape: append([]int64(nil), t.Shape...),
			Size: t.Size / si * int64(wd[i].ItemSize())}
	}
	if err := plan.Validate(pt); err != nil {
		return Update{}, err
	}
	u := Update{Tensors: pt, Packed: packed, Threshold: threshold}
	piece := func(i int, off int64) Piece {
		return Piece{Src: tensors[i], Wire: wd[i], Offset: off, Bytes: pt[i].Size}
	}
	if packed {
		for _, c := range plan.Packed(pt, threshold) {
			ch := Chunk{Bytes: c.Size, DType: nccl.Uint8, Count: int(c.Size)}
			for j, i := range c.Tensors {
				ch.Pieces = append(ch.Pieces, piece(i, c.Offsets[j]))
			}
			u.Chunks = append(u.Chunks, ch)
		}
	} else {
		bs, err := plan.NonPacked(pt)
		if err != nil {
			return Update{}, err
		}
		for _, b := range bs {
			u.Chunks = append(u.Chunks, Chunk{Pieces: []Piece{piece(b.Tensor, 0)}, Bytes: b.Size,
				DType: b.DType, Count: int(b.Count)})
		}
	}
	if err := check(u.Chunks); err != nil {
		return Update{}, err
	}
	return u, nil
}
