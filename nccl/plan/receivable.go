package plan

import (
	"fmt"
	"strings"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

// maxListed is how many offending tensors an error names before it says
// "and N more": enough to see the pattern, short enough to read.
const maxListed = 10

// CheckPackedReceivable refuses a packed layout that vLLM's packed consumer
// cannot unpack. vLLM splits each received uint8 chunk by tensor sizes and
// calls .contiguous().view(dtype).view(*shape) on each piece, which fails
//
//   - for a 0-dim tensor (shape []): view() with no sizes is a TypeError;
//   - for a tensor whose byte offset within its chunk is not a multiple of
//     its dtype's item size: torch's view(dtype) raises "storage_offset must
//     be divisible by N", zero-size tensors included (the offset check does
//     not look at the element count).
//
// Zero-size tensors with a non-empty shape ([0, 4]) at an aligned offset
// are fine. The error names every offending tensor (the first maxListed,
// then how many more) with its shape, dtype, chunk, offset and reason, and
// suggests non-packed transfer, where each tensor is its own buffer.
// tensors and chunks are a Packed layout of a list that passed Validate.
func CheckPackedReceivable(tensors []Tensor, chunks []PackedChunk) error {
	var bad []string
	for ci, c := range chunks {
		for k, i := range c.Tensors {
			if i < 0 || i >= len(tensors) || k >= len(c.Offsets) {
				return fmt.Errorf("plan: packed chunk %d names tensor %d of %d", ci, i, len(tensors))
			}
			t, off := tensors[i], c.Offsets[k]
			var why []string
			if len(t.Shape) == 0 {
				why = append(why, "it is 0-dim (vLLM's view(*shape) gets no sizes)")
			}
			d, _ := safetensors.DTypeFromTorch(t.DType) // unknown: ItemSize 0, Validate's error
			if item := int64(d.ItemSize()); item > 1 && off%item != 0 {
				why = append(why, fmt.Sprintf("its offset is not a multiple of its item size %d (torch: storage_offset must be divisible by %d)", item, item))
			}
			if len(why) > 0 {
				bad = append(bad, fmt.Sprintf("%q (shape %v, %s, offset %d in chunk %d): %s",
					t.Name, fmtShape(t.Shape), t.DType, off, ci, strings.Join(why, " and ")))
			}
		}
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("plan: vLLM cannot unpack %s of this packed transfer: %s; set weight_transfer.packed to false (one broadcast per tensor)",
		plural(len(bad), "tensor"), list(bad))
}

// CheckNCCLVersion refuses broadcasts of an NCCL data type that the loaded
// library, of version ncclVersion (ncclGetVersion's number), does not have
// (the fp8 types before NCCL 2.24): such an ncclBroadcast fails only once
// the update is under way, with every receiver waiting for it. It names the
// library's version, the offending tensors (the first maxListed) and the ways
// out. bs is NonPacked(tensors).
func CheckNCCLVersion(tensors []Tensor, bs []Broadcast, ncclVersion int) error {
	var bad []string
	need := 0
	for _, b := range bs {
		if v := b.DType.MinVersion(); v > ncclVersion {
			if b.Tensor < 0 || b.Tensor >= len(tensors) {
				return fmt.Errorf("plan: broadcast names tensor %d of %d", b.Tensor, len(tensors))
			}
			t := tensors[b.Tensor]
			bad = append(bad, fmt.Sprintf("%q (%s as %v)", t.Name, t.DType, b.DType))
			need = max(need, v)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("plan: the loaded NCCL %s cannot broadcast %s non-packed, which needs NCCL %s or later: %s; point %s at a newer libnccl or set weight_transfer.packed to true (packed chunks are uint8)",
		nccl.VersionString(ncclVersion), plural(len(bad), "tensor"), nccl.VersionString(need), list(bad), nccl.EnvNCCLLib)
}

// list joins items, the first maxListed of them, then "and N more".
func list(items []string) string {
	if len(items) <= maxListed {
		return strings.Join(items, "; ")
	}
	return strings.Join(items[:maxListed], "; ") + fmt.Sprintf("; and %d more", len(items)-maxListed)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// fmtShape prints a 0-dim shape as [] whether it is nil or empty.
func fmtShape(s []int64) string {
	if len(s) == 0 {
		return "[]"
	}
	return fmt.Sprint(s)
}
