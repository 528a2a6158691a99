package trainer

import (
	"fmt"
	"math/bits"
	"path/filepath"
)

// itemSizes are the bytes per element of every dtype a snapshot may hold,
// by torch attribute name.
var itemSizes = map[string]int64{
	"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
	"int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
	"float8_e4m3fn": 1, "float8_e5m2": 1,
}

// DTypeSize is the item size in bytes of a torch dtype name; ok is false
// for a dtype a snapshot may not hold.
func DTypeSize(dtype string) (size int64, ok bool) {
	size, ok = itemSizes[dtype]
	return size, ok
}

// Publish dtypes (PROTOCOL.md "publish"): float32 tensors are cast to it,
// unless it is DTypeKeep.
const (
	DTypeKeep     = "keep"
	DTypeBFloat16 = "bfloat16"
	DTypeFloat16  = "float16"
)

// Validate checks a snapshot's description before anything maps it: the IPC
// kind and its handle or path, the storage bounds, and the layout (names
// unique and non-empty, known dtypes, non-negative shapes, bytes matching
// shape and dtype, offsets ascending, aligned to the item size, not
// overlapping, within StorageBytes), and Refs when present (validateRefs).
// Its error names the field (in the reply's spelling), never a value of the
// trainer's text.
func (s *Snapshot) Validate() error {
	if s.Version == "" {
		return fmt.Errorf("field \"version\": empty")
	}
	switch s.IPC {
	case IPCCUDA:
		if len(s.Handle) == 0 {
			return fmt.Errorf("field \"handle\": empty")
		}
	case IPCFakeShm:
		if !filepath.IsAbs(s.Path) {
			return fmt.Errorf("field \"path\": not an absolute path")
		}
	default:
		return fmt.Errorf("field \"ipc\": want %q or %q", IPCCUDA, IPCFakeShm)
	}
	if s.StorageBytes <= 0 {
		return fmt.Errorf("field \"storage_bytes\": %d, want > 0", s.StorageBytes)
	}
	if s.StorageOffset < 0 {
		return fmt.Errorf("field \"storage_offset\": %d, want >= 0", s.StorageOffset)
	}
	if s.Device < 0 {
		return fmt.Errorf("field \"device\": %d, want >= 0", s.Device)
	}
	if len(s.Tensors) == 0 {
		return fmt.Errorf("field \"tensors\": empty")
	}
	seen := make(map[string]int, len(s.Tensors))
	var end int64 // where the previous tensor ended
	for i, t := range s.Tensors {
		field := fmt.Sprintf("tensors[%d]", i)
		if t.Name == "" {
			return fmt.Errorf("field \"%s.name\": empty", field)
		}
		if j, dup := seen[t.Name]; dup {
			return fmt.Errorf("field \"%s.name\": the same as tensors[%d].name", field, j)
		}
		seen[t.Name] = i
		size, ok := DTypeSize(t.DType)
		if !ok {
			return fmt.Errorf("field \"%s.dtype\": not a dtype a snapshot may hold", field)
		}
		// prod(shape) x size, refusing anything past StorageBytes so
		// the product cannot overflow.
		want := size
		for k, d := range t.Shape {
			if d < 0 {
				return fmt.Errorf("field \"%s.shape[%d]\": %d, want >= 0", field, k, d)
			}
			hi, lo := bits.Mul64(uint64(want), uint64(d))
			if hi != 0 || lo > uint64(s.StorageBytes) {
				return fmt.Errorf("field \"%s.shape\": more bytes than storage_bytes %d", field, s.StorageBytes)
			}
			want = int64(lo)
		}
		if t.Bytes != want {
			return fmt.Errorf("field \"%s.bytes\": %d, want %d (shape x %s's %d bytes)", field, t.Bytes, want, t.DType, size)
		}
		switch {
		case t.Offset < end:
			if i == 0 {
				return fmt.Errorf("field \"%s.offset\": %d, want >= 0", field, t.Offset)
			}
			return fmt.Errorf("field \"%s.offset\": %d, overlaps tensors[%d] (ends at %d)", field, t.Offset, i-1, end)
		case t.Offset%size != 0:
			return fmt.Errorf("field \"%s.offset\": %d, not a multiple of %s's item size %d", field, t.Offset, t.DType, size)
		case t.Offset > s.StorageBytes-t.Bytes:
			return fmt.Errorf("field \"%s.offset\": %d + bytes %d, past storage_bytes %d", field, t.Offset, t.Bytes, s.StorageBytes)
		}
		end = t.Offset + t.Bytes
	}
	return s.validateRefs()
}

// validateRefs checks Refs, when there are any: one per tensor, each
// with a counter handle of 1 to MaxRefCounterHandleBytes bytes, a
// non-negative offset, and an event handle of IPCEventHandleBytes or none
// (none only when no sync is required).
func (s *Snapshot) validateRefs() error {
	if s.Refs == nil {
		return nil
	}
	if len(s.Refs) != len(s.Tensors) {
		return fmt.Errorf("field \"ipc_refs\": %d for %d tensors, want one per tensor", len(s.Refs), len(s.Tensors))
	}
	for i, r := range s.Refs {
		field := fmt.Sprintf("ipc_refs[%d]", i)
		switch n := len(r.CounterHandle); {
		case n == 0:
			return fmt.Errorf("field \"%s.ref_counter_handle\": empty", field)
		case n > MaxRefCounterHandleBytes:
			return fmt.Errorf("field \"%s.ref_counter_handle\": %d bytes, want at most %d", field, n, MaxRefCounterHandleBytes)
		}
		if r.CounterOffset < 0 {
			return fmt.Errorf("field \"%s.ref_counter_offset\": %d, want >= 0", field, r.CounterOffset)
		}
		if r.EventHandle != nil && len(r.EventHandle) != IPCEventHandleBytes {
			return fmt.Errorf("field \"%s.event_handle\": %d bytes, want %d or null", field, len(r.EventHandle), IPCEventHandleBytes)
		}
		if r.EventSyncRequired && r.EventHandle == nil {
			return fmt.Errorf("field \"%s.event_sync_required\": true without an event_handle", field)
		}
	}
	return nil
}
