// Package ncclid encodes an NCCL unique id the two ways vLLM workers accept
// it: as the pickled vllm ctypes ncclUniqueId that StatelessProcessGroup
// publishes under the TCPStore key "broadcast_from/0/0", and as the RFC 4648
// base64 string of Gen D's init_info.nccl_unique_id_b64.
//
// Invariants: Pickle always produces exactly the 247-byte protocol 4 stream
// CPython (<= 3.13) emits for
// vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId: a fixed
// 111-byte prefix, the 128 id bytes, a fixed 8-byte suffix. Unpickle accepts
// exactly that layout with protocol byte 4 or 5 and nothing else, reporting
// the first offending offset; it never executes or interprets other pickle
// opcodes.
package ncclid

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
)

// Size is the size of ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
const Size = 128

// ID is the opaque ncclUniqueId.
type ID [Size]byte

// PickleLen is the length of the pickled id.
const PickleLen = idOffset + Size + 8

// ModulePath and ClassName name the Python class the pickle refers to.
const (
	ModulePath = "vllm.distributed.device_communicators.pynccl_wrapper"
	ClassName  = "ncclUniqueId"
)

// idOffset is where the id bytes start in the pickle.
const idOffset = 111

var prefix = func() []byte {
	var b []byte
	b = append(b, 0x80, 4)                          // PROTO 4
	b = append(b, 0x95)                             // FRAME
	b = binary.LittleEndian.AppendUint64(b, 236)    // frame length: the rest of the stream
	b = append(b, 0x8c, 7)                          // SHORT_BINUNICODE
	b = append(b, "_ctypes"...)                     //
	b = append(b, 0x94, 0x8c, 9)                    // MEMOIZE, SHORT_BINUNICODE
	b = append(b, "_unpickle"...)                   //
	b = append(b, 0x94, 0x93, 0x94)                 // MEMOIZE, STACK_GLOBAL, MEMOIZE
	b = append(b, 0x8c, byte(len(ModulePath)))      // SHORT_BINUNICODE (52 bytes)
	b = append(b, ModulePath...)                    //
	b = append(b, 0x94, 0x8c, byte(len(ClassName))) // MEMOIZE, SHORT_BINUNICODE
	b = append(b, ClassName...)                     //
	b = append(b, 0x94, 0x93, 0x94)                 // MEMOIZE, STACK_GLOBAL, MEMOIZE
	b = append(b, 0x7d, 0x94)                       // EMPTY_DICT, MEMOIZE (instance __dict__)
	b = append(b, 0x43, Size)                       // SHORT_BINBYTES 128
	return b
}()

// MEMOIZE, TUPLE2 (dict, bytes), MEMOIZE, TUPLE2 (class, state), MEMOIZE,
// REDUCE, MEMOIZE, STOP.
var suffix = []byte{0x94, 0x86, 0x94, 0x86, 0x94, 0x52, 0x94, 0x2e}

func init() {
	if len(prefix) != idOffset || len(suffix) != 8 || PickleLen != 247 {
		panic(fmt.Sprintf("ncclid: layout is %d+%d+%d bytes", len(prefix), Size, len(suffix)))
	}
}

// Pickle returns the 247-byte protocol 4 pickle of the id.
func Pickle(id ID) []byte {
	out := make([]byte, 0, PickleLen)
	out = append(out, prefix...)
	out = append(out, id[:]...)
	return append(out, suffix...)
}

// Unpickle extracts the id from a pickle of exactly Pickle's layout, with
// protocol 4 or 5.
func Unpickle(b []byte) (ID, error) {
	var id ID
	check := func(off int, want []byte) error {
		for i, w := range want {
			o := off + i
			if o >= len(b) {
				return fmt.Errorf("ncclid: unpickle: truncated at offset %d (%d bytes, want %d)", o, len(b), PickleLen)
			}
			if o == 1 {
				if b[1] != 4 && b[1] != 5 {
					return fmt.Errorf("ncclid: unpickle: offset 1: pickle protocol %d, want 4 or 5", b[1])
				}
				continue
			}
			if b[o] != w {
				return fmt.Errorf("ncclid: unpickle: offset %d: byte %#02x, want %#02x (%s)", o, b[o], w, what(o))
			}
		}
		return nil
	}
	if err := check(0, prefix); err != nil {
		return id, err
	}
	if len(b) < idOffset+Size {
		return id, fmt.Errorf("ncclid: unpickle: truncated at offset %d (%d bytes, want %d)", len(b), len(b), PickleLen)
	}
	copy(id[:], b[idOffset:idOffset+Size])
	if err := check(idOffset+Size, suffix); err != nil {
		return id, err
	}
	if len(b) != PickleLen {
		return id, fmt.Errorf("ncclid: unpickle: offset %d: %d trailing bytes after STOP", PickleLen, len(b)-PickleLen)
	}
	return id, nil
}

// what names the part of the layout at offset o, for error messages.
func what(o int) string {
	switch {
	case o < 2:
		return "PROTO"
	case o < 11:
		return "FRAME"
	case o < 35:
		return "_ctypes._unpickle global"
	case o < 90:
		return "module " + ModulePath
	case o < 107:
		return "class " + ClassName
	case o < 109:
		return "instance dict"
	case o < 111:
		return "SHORT_BINBYTES 128"
	default:
		return "tuple/REDUCE/STOP suffix"
	}
}

// EncodeB64 is the standard (RFC 4648, padded) base64 of the 128 id bytes.
func EncodeB64(id ID) string {
	return base64.StdEncoding.EncodeToString(id[:])
}

// DecodeB64 parses EncodeB64's output; it must decode to exactly 128 bytes.
func DecodeB64(s string) (ID, error) {
	var id ID
	b, err := base64.StdEncoding.Strict().DecodeString(s)
	if err != nil {
		return id, fmt.Errorf("ncclid: decode base64: %w", err)
	}
	if len(b) != Size {
		return id, fmt.Errorf("ncclid: decode base64: %d bytes, want %d", len(b), Size)
	}
	copy(id[:], b)
	return id, nil
}
