package staging

import (
	"fmt"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

// Chunk is one broadcast of the wire sequence.
type Chunk struct {
	// Pieces are the tensors in the chunk, back to back in wire order.
	Pieces []Piece
	// Bytes is the chunk's size on the wire.
	Bytes int64
	// DType and Count describe the ncclBroadcast: Uint8 and Bytes for a
	// packed chunk, the tensor's own type and element count otherwise.
	DType nccl.DataType
	Count int
}

// Piece is one tensor inside a chunk.
type Piece struct {
	// Src says where the bytes come from (name, file dtype, offset, size).
	Src safetensors.TensorInfo
	// Wire is the dtype sent; when it differs from Src.DType the bytes are
	// converted during the host copy.
	Wire safetensors.DType
	// Offset is the piece's position in its chunk; Bytes its size on the
	// wire (elements x Wire's item size).
	Offset, Bytes int64
}

// converter returns the function that turns src-dtype bytes into
// wire-dtype bytes, nil when they are the same dtype.
func converter(src, wire safetensors.DType) (func(dst, src []byte) error, error) {
	switch {
	case src == wire:
		return nil, nil
	case src == safetensors.F32 && wire == safetensors.BF16:
		return safetensors.ConvertF32ToBF16, nil
	case src == safetensors.F32 && wire == safetensors.F16:
		return safetensors.ConvertF32ToF16, nil
	case src == safetensors.BF16 && wire == safetensors.F32:
		return safetensors.ConvertBF16ToF32, nil
	case src == safetensors.F16 && wire == safetensors.F32:
		return safetensors.ConvertF16ToF32, nil
	}
	return nil, fmt.Errorf("no conversion from %s to %s", src, wire)
}

// check validates a layout against itself: sizes add up, pieces tile each
// chunk, conversions exist and non-packed counts match their dtype.
func check(chunks []Chunk) error {
	for k, c := range chunks {
		var off int64
		for _, p := range c.Pieces {
			if p.Offset != off {
				return fmt.Errorf("staging: chunk %d: tensor %q at offset %d, want %d (no padding)", k, p.Src.Name, p.Offset, off)
			}
			if p.Src.DType.ItemSize() == 0 || p.Wire.ItemSize() == 0 {
				return fmt.Errorf("staging: chunk %d: tensor %q: unknown dtype", k, p.Src.Name)
			}
			elems := p.Src.Size / int64(p.Src.DType.ItemSize())
			if elems*int64(p.Wire.ItemSize()) != p.Bytes {
				return fmt.Errorf("staging: chunk %d: tensor %q: %d bytes of %s on the wire, but %d elements in the file", k, p.Src.Name, p.Bytes, p.Wire, elems)
			}
			if _, err := converter(p.Src.DType, p.Wire); err != nil {
				return fmt.Errorf("staging: tensor %q: %w", p.Src.Name, err)
			}
			off += p.Bytes
		}
		if off != c.Bytes {
			return fmt.Errorf("staging: chunk %d: pieces hold %d bytes, chunk says %d", k, off, c.Bytes)
		}
		if !c.DType.Valid() || int64(c.Count)*int64(c.DType.Size()) != c.Bytes {
			return fmt.Errorf("staging: chunk %d: %d x %v is not %d bytes", k, c.Count, c.DType, c.Bytes)
		}
	}
	return nil
}

// MaxChunk is the size of the largest chunk: the smallest buffer that can
// carry the layout.
func MaxChunk(chunks []Chunk) int64 {
	var m int64
	for _, c := range chunks {
		m = max(m, c.Bytes)
	}
	return m
}
