// Package ncclid encodes an NCCL unique id the two ways vLLM workers accept
// it: as the pickled vllm ctypes ncclUniqueId that StatelessProcessGroup
// publishes under the TCPStore key "broadcast_from/0/0", and as the RFC 4648
// base64 string of init_info.nccl_unique_id_b64 (newest D builds and E).
//
// Invariants: PickleIn produces exactly the protocol 4 stream CPython
// (<= 3.13) emits for <module>.ncclUniqueId, module being one of the two
// places vLLM's layouts keep pynccl_wrapper (Modules): a fixed prefix
// naming the module (111 bytes for the legacy module, 120 for the
// vllm.backends one), the 128 id bytes, a fixed 8-byte suffix; 247 or 256
// bytes in all. Unpickle accepts exactly those layouts with protocol byte 4
// or 5 and nothing else, reporting the first offending offset; it never
// executes or interprets other pickle opcodes.
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

// The modules a pickled ncclUniqueId names. vLLM's newer source layout moved
// vllm.distributed to vllm.backends.distributed; the legacy name resolves
// there only through a compatibility shim (a sys.modules alias, so both
// names unpickle to the same class while the shim exists).
const (
	// ModulePath is the legacy module (API generations A to D).
	ModulePath = "vllm.distributed.device_communicators.pynccl_wrapper"
	// BackendsModulePath is the module of the vllm.backends layout.
	BackendsModulePath = "vllm.backends.distributed.device_communicators.pynccl_wrapper"
	ClassName          = "ncclUniqueId"
)

// Modules are the module paths Unpickle accepts.
var Modules = []string{ModulePath, BackendsModulePath}

// PickleLen is the length of the legacy pickle (PickleIn with ModulePath).
const PickleLen = 247

// layout is the byte layout of the pickle naming one module.
type layout struct {
	module   string
	prefix   []byte // everything before the id bytes
	idOffset int
	total    int
}

func newLayout(module string) layout {
	// The stream after the frame header: 24 bytes of _ctypes._unpickle,
	// 2+len(module)+1, 2+len(ClassName)+3, 2 (dict), 2+Size, 8 (suffix).
	rest := 24 + 2 + len(module) + 1 + 2 + len(ClassName) + 3 + 2 + 2 + Size + len(suffix)
	var b []byte
	b = append(b, 0x80, 4)                                // PROTO 4
	b = append(b, 0x95)                                   // FRAME
	b = binary.LittleEndian.AppendUint64(b, uint64(rest)) // frame length: the rest of the stream
	b = append(b, 0x8c, 7)                                // SHORT_BINUNICODE
	b = append(b, "_ctypes"...)                           //
	b = append(b, 0x94, 0x8c, 9)                          // MEMOIZE, SHORT_BINUNICODE
	b = append(b, "_unpickle"...)                         //
	b = append(b, 0x94, 0x93, 0x94)                       // MEMOIZE, STACK_GLOBAL, MEMOIZE
	b = append(b, 0x8c, byte(len(module)))                // SHORT_BINUNICODE
	b = append(b, module...)                              //
	b = append(b, 0x94, 0x8c, byte(len(ClassName)))       // MEMOIZE, SHORT_BINUNICODE
	b = append(b, ClassName...)                           //
	b = append(b, 0x94, 0x93, 0x94)                       // MEMOIZE, STACK_GLOBAL, MEMOIZE
	b = append(b, 0x7d, 0x94)                             // EMPTY_DICT, MEMOIZE (instance __dict__)
	b = append(b, 0x43, Size)                             // SHORT_BINBYTES 128
	return layout{module: module, prefix: b, idOffset: len(b), total: len(b) + Size + len(suffix)}
}

// MEMOIZE, TUPLE2 (dict, bytes), MEMOIZE, TUPLE2 (class, state), MEMOIZE,
// REDUCE, MEMOIZE, STOP.
var suffix = []byte{0x94, 0x86, 0x94, 0x86, 0x94, 0x52, 0x94, 0x2e}

var layouts = func() map[string]layout {
	m := map[string]layout{}
	for _, mod := range Modules {
		m[mod] = newLayout(mod)
	}
	return m
}()

func init() {
	if l := layouts[ModulePath]; l.idOffset != 111 || l.total != PickleLen {
		panic(fmt.Sprintf("ncclid: legacy layout is %d+%d+%d bytes", l.idOffset, Size, len(suffix)))
	}
}

// Pickle returns the 247-byte protocol 4 pickle of the id naming the legacy
// module.
func Pickle(id ID) []byte {
	b, _ := PickleIn(id, ModulePath)
	return b
}

// PickleIn returns the protocol 4 pickle of the id naming module, one of
// Modules.
func PickleIn(id ID, module string) ([]byte, error) {
	l, ok := layouts[module]
	if !ok {
		return nil, fmt.Errorf("ncclid: pickle: module %q is not where vLLM keeps ncclUniqueId (want one of %v)", module, Modules)
	}
	out := make([]byte, 0, l.total)
	out = append(out, l.prefix...)
	out = append(out, id[:]...)
	return append(out, suffix...), nil
}

// Unpickle extracts the id from a pickle of exactly PickleIn's layout for
// one of Modules, with protocol 4 or 5.
func Unpickle(b []byte) (ID, error) {
	id, _, err := UnpickleModule(b)
	return id, err
}

// UnpickleModule is Unpickle, also returning the module the pickle names.
func UnpickleModule(b []byte) (ID, string, error) {
	// The module's length byte (offset 36) tells the layouts apart; an
	// unknown length is checked against the legacy layout to name the
	// first offending byte.
	l := layouts[ModulePath]
	if len(b) > 36 {
		for _, cand := range layouts {
			if int(b[36]) == len(cand.module) {
				l = cand
			}
		}
	}
	var id ID
	check := func(off int, want []byte) error {
		for i, w := range want {
			o := off + i
			if o >= len(b) {
				return fmt.Errorf("ncclid: unpickle: truncated at offset %d (%d bytes, want %d)", o, len(b), l.total)
			}
			if o == 1 {
				if b[1] != 4 && b[1] != 5 {
					return fmt.Errorf("ncclid: unpickle: offset 1: pickle protocol %d, want 4 or 5", b[1])
				}
				continue
			}
			if b[o] != w {
				return fmt.Errorf("ncclid: unpickle: offset %d: byte %#02x, want %#02x (%s)", o, b[o], w, l.what(o))
			}
		}
		return nil
	}
	if err := check(0, l.prefix); err != nil {
		return id, "", err
	}
	if len(b) < l.idOffset+Size {
		return id, "", fmt.Errorf("ncclid: unpickle: truncated at offset %d (%d bytes, want %d)", len(b), len(b), l.total)
	}
	copy(id[:], b[l.idOffset:l.idOffset+Size])
	if err := check(l.idOffset+Size, suffix); err != nil {
		return id, "", err
	}
	if len(b) != l.total {
		return id, "", fmt.Errorf("ncclid: unpickle: offset %d: %d trailing bytes after STOP", l.total, len(b)-l.total)
	}
	return id, l.module, nil
}

// what names the part of the layout at offset o, for error messages.
func (l layout) what(o int) string {
	modEnd := 35 + 2 + len(l.module)
	switch {
	case o < 2:
		return "PROTO"
	case o < 11:
		return "FRAME"
	case o < 35:
		return "_ctypes._unpickle global"
	case o < modEnd:
		return "module " + l.module
	case o < l.idOffset-4:
		return "class " + ClassName
	case o < l.idOffset-2:
		return "instance dict"
	case o < l.idOffset:
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
