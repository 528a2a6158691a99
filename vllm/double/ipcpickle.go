package double

// The restricted reader of vLLM's ipc_handles_pickled (shared contract:
// the ipc spec's "The pickle" section). It is a pickle virtual machine for
// exactly the objects vLLM's ipc backend pickles: a list with one
// {gpu_uuid: (rebuild_cuda_tensor, args)} dict per tensor, args being
// torch's 15-tuple for a CUDA tensor. It never imports or calls anything:
// globals are names checked against an allow-list, and the one REDUCE it
// evaluates is torch.Size(tuple_of_ints).
//
// Invariants: it accepts the opcodes rlflow's Go writer emits (protocol 3,
// no memo) and those CPython's pickle.dumps emits for the same objects with
// protocols 3, 4 and 5, and nothing else; every refusal is an
// *IPCPickleError naming the byte offset of the opcode that made the bad
// value; every size it reads is bounded before it allocates; no input makes
// it panic (FuzzReadIPCHandles).

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/rlflow/rlflow/safetensors"
)

// Bounds of the reader. vLLM has none; the double's keep a hostile body
// from costing more than a few hundred MB.
const (
	MaxIPCTensors     = 1 << 16 // entries of the top-level list
	MaxIPCUUIDs       = 64      // GPU UUIDs in one tensor's dict
	MaxIPCDims        = 64      // dimensions of a tensor (size and stride)
	MaxIPCStringBytes = 1024    // one str (UUIDs, global names)
	MaxIPCBytesLen    = 4096    // one bytes (handles; a fake_shm handle is a path)
	maxIPCTuple       = 64      // items of a tuple built with MARK
	maxIPCValues      = 1 << 22 // values made by the whole stream
	maxIPCMemo        = 1 << 20 // memo entries
)

// IPCRebuildFunc is the only callable an ipc handle may name.
const IPCRebuildFunc = "torch.multiprocessing.reductions.rebuild_cuda_tensor"

// IPCHandle is one tensor's entry of ipc_handles: (func, args) per GPU
// UUID, in the dict's order (what vLLM lists as "Available UUIDs"). UUIDs
// are unique (a repeated key replaces the earlier value, as in Python).
type IPCHandle []IPCHandleEntry

// IPCHandleEntry is one {gpu_uuid: (func, args)} item.
type IPCHandleEntry struct {
	UUID    string
	Rebuild IPCRebuild
}

// Find returns the entry for uuid.
func (h IPCHandle) Find(uuid string) (IPCRebuild, bool) {
	for _, e := range h {
		if e.UUID == uuid {
			return e.Rebuild, true
		}
	}
	return IPCRebuild{}, false
}

// UUIDs lists the handle's GPU UUIDs in order.
func (h IPCHandle) UUIDs() []string {
	out := make([]string, len(h))
	for i, e := range h {
		out[i] = e.UUID
	}
	return out
}

// IPCRebuild is one (func, args) pair: torch's
// rebuild_cuda_tensor(*args), argument by argument (ipc spec table).
type IPCRebuild struct {
	Func         string  // IPCRebuildFunc
	TensorClass  string  // args[0]: "torch.Tensor" or "torch._tensor.Tensor"
	Size         []int64 // args[1]: torch.Size's dims (empty for a scalar), each >= 0
	Stride       []int64 // args[2]: in elements, one per dim, each >= 0
	TensorOffset int64   // args[3]: in elements of DType from the storage's start, >= 0
	StorageClass string  // args[4]: "torch.storage.TypedStorage", "torch.UntypedStorage" or "torch.storage.UntypedStorage"
	DType        string  // args[5]: torch attribute name ("bfloat16")
	Device       int64   // args[6]: the sender's device index (vLLM overwrites it)
	// StorageHandle is args[7], torch's handle bytes (a fake_shm handle: a
	// file path); StorageBytes (args[8]) and StorageOffset (args[9], the
	// storage's offset in the block the handle names) are >= 0.
	StorageHandle []byte
	StorageBytes  int64
	StorageOffset int64
	RequiresGrad  bool // args[10]
	// The producer's ref-counter slot (args[11], args[12] >= 0) and event
	// (args[13]: nil for None; args[14]).
	RefCounterHandle  []byte
	RefCounterOffset  int64
	EventHandle       []byte
	EventSyncRequired bool
}

// IPCPickleError is a refusal of the reader: the byte offset of the opcode
// that made the offending value (or of the offending opcode) and why.
type IPCPickleError struct {
	Offset int
	Op     string // the opcode's name at Offset ("" past the end)
	Msg    string
}

func (e *IPCPickleError) Error() string {
	if e.Op == "" {
		return fmt.Sprintf("ipc pickle: offset %d: %s", e.Offset, e.Msg)
	}
	return fmt.Sprintf("ipc pickle: offset %d (%s): %s", e.Offset, e.Op, e.Msg)
}

// DecodeIPCHandlesPickled decodes update_info.ipc_handles_pickled: standard
// base64 (padded, as Python's base64.b64encode writes it), then
// ReadIPCHandles.
func DecodeIPCHandlesPickled(b64 string) ([]IPCHandle, error) {
	raw, err := base64.StdEncoding.Strict().DecodeString(b64)
	if err != nil {
		return nil, fmt.Errorf("ipc_handles_pickled is not standard base64: %w", err)
	}
	h, err := ReadIPCHandles(raw)
	if err != nil {
		return nil, fmt.Errorf("ipc_handles_pickled: %w", err)
	}
	return h, nil
}

// ReadIPCHandles reads the pickle of vLLM's ipc_handles (see the file
// comment for what it accepts).
func ReadIPCHandles(pickled []byte) ([]IPCHandle, error) {
	r := &pickleReader{data: pickled, memo: map[uint32]*pyObj{}}
	top, err := r.run()
	if err != nil {
		return nil, err
	}
	return r.handles(top)
}

// Opcodes the reader knows, with their pickletools names.
const (
	opMark            = '('
	opStop            = '.'
	opBinInt          = 'J'
	opBinInt1         = 'K'
	opBinInt2         = 'M'
	opNone            = 'N'
	opReduce          = 'R'
	opBinUnicode      = 'X'
	opAppend          = 'a'
	opGlobal          = 'c'
	opEmptyDict       = '}'
	opAppends         = 'e'
	opBinGet          = 'h'
	opLongBinGet      = 'j'
	opEmptyList       = ']'
	opBinPut          = 'q'
	opLongBinPut      = 'r'
	opSetItem         = 's'
	opTuple           = 't'
	opEmptyTuple      = ')'
	opSetItems        = 'u'
	opBinBytes        = 'B'
	opShortBinBytes   = 'C'
	opProto           = 0x80
	opTuple1          = 0x85
	opTuple2          = 0x86
	opTuple3          = 0x87
	opNewTrue         = 0x88
	opNewFalse        = 0x89
	opLong1           = 0x8a
	opShortBinUnicode = 0x8c
	opBinUnicode8     = 0x8d
	opBinBytes8       = 0x8e
	opStackGlobal     = 0x93
	opMemoize         = 0x94
	opFrame           = 0x95
)

var opNames = map[byte]string{
	opMark: "MARK", opStop: "STOP", opBinInt: "BININT", opBinInt1: "BININT1", opBinInt2: "BININT2",
	opNone: "NONE", opReduce: "REDUCE", opBinUnicode: "BINUNICODE", opAppend: "APPEND", opGlobal: "GLOBAL",
	opEmptyDict: "EMPTY_DICT", opAppends: "APPENDS", opBinGet: "BINGET", opLongBinGet: "LONG_BINGET",
	opEmptyList: "EMPTY_LIST", opBinPut: "BINPUT", opLongBinPut: "LONG_BINPUT", opSetItem: "SETITEM",
	opTuple: "TUPLE", opEmptyTuple: "EMPTY_TUPLE", opSetItems: "SETITEMS", opBinBytes: "BINBYTES",
	opShortBinBytes: "SHORT_BINBYTES", opProto: "PROTO", opTuple1: "TUPLE1", opTuple2: "TUPLE2",
	opTuple3: "TUPLE3", opNewTrue: "NEWTRUE", opNewFalse: "NEWFALSE", opLong1: "LONG1",
	opShortBinUnicode: "SHORT_BINUNICODE", opBinUnicode8: "BINUNICODE8", opBinBytes8: "BINBYTES8",
	opStackGlobal: "STACK_GLOBAL", opMemoize: "MEMOIZE", opFrame: "FRAME",
}

// pyKind is the Python type of a value on the reader's stack.
type pyKind uint8

const (
	pyNone pyKind = iota
	pyBool
	pyInt
	pyStr
	pyBytes
	pyTuple
	pyList
	pyDict
	pyGlobal
	pySize // torch.Size, the result of the one allowed REDUCE
)

// globalKind is what an allowed global is.
type globalKind uint8

const (
	gRebuild globalKind = iota + 1
	gTensorClass
	gSizeClass
	gStorageClass
	gDType
)

// ipcGlobals is the allow-list: (module, qualname) -> kind; the dtypes are
// torch.<name> for every dtype rlflow knows (safetensors' table).
var ipcGlobals = func() map[[2]string]globalKind {
	m := map[[2]string]globalKind{
		{"torch.multiprocessing.reductions", "rebuild_cuda_tensor"}: gRebuild,
		{"torch", "Tensor"}:                 gTensorClass,
		{"torch._tensor", "Tensor"}:         gTensorClass,
		{"torch", "Size"}:                   gSizeClass,
		{"torch.storage", "TypedStorage"}:   gStorageClass,
		{"torch", "UntypedStorage"}:         gStorageClass,
		{"torch.storage", "UntypedStorage"}: gStorageClass,
	}
	for _, d := range safetensors.DTypes() {
		m[[2]string{"torch", d.TorchName()}] = gDType
	}
	return m
}()

// pyObj is one value. Lists and dicts are mutable and may be shared
// through the memo, as in Python; nothing here walks values recursively,
// so a cycle cannot loop.
type pyObj struct {
	kind  pyKind
	off   int    // offset of the opcode that made it
	n     int64  // int; bool (0, 1)
	s     string // str; global: module + "." + name
	name  string // global: the qualname
	g     globalKind
	b     []byte   // bytes (aliases the input)
	items []*pyObj // tuple, list, torch.Size dims; dict: key, value, key, value...
}

func (o *pyObj) typeName() string {
	switch o.kind {
	case pyNone:
		return "None"
	case pyBool:
		return "bool"
	case pyInt:
		return "int"
	case pyStr:
		return "str"
	case pyBytes:
		return "bytes"
	case pyTuple:
		return fmt.Sprintf("a %d-tuple", len(o.items))
	case pyList:
		return "list"
	case pyDict:
		return "dict"
	case pyGlobal:
		return "global " + o.s
	}
	return "torch.Size"
}

type pickleReader struct {
	data     []byte
	pos      int // next byte to read
	op       int // offset of the opcode being run
	stack    []*pyObj
	marks    []int // stack lengths at each MARK
	memo     map[uint32]*pyObj
	values   int
	frameEnd int
}

// fail refuses at the opcode being run.
func (r *pickleReader) fail(format string, args ...any) error {
	return r.failAt(r.op, format, args...)
}

func (r *pickleReader) failAt(off int, format string, args ...any) error {
	var op string
	if off < len(r.data) {
		op = opNames[r.data[off]]
		if op == "" {
			op = fmt.Sprintf("opcode %#02x", r.data[off])
		}
	}
	return &IPCPickleError{Offset: off, Op: op, Msg: fmt.Sprintf(format, args...)}
}

// read takes n operand bytes of the running opcode.
func (r *pickleReader) read(n int) ([]byte, error) {
	if n < 0 || n > len(r.data)-r.pos {
		return nil, r.fail("truncated: needs %d operand bytes, %d left", n, len(r.data)-r.pos)
	}
	b := r.data[r.pos : r.pos+n]
	r.pos += n
	return b, nil
}

// readLen reads a width-byte little-endian length and bounds it by limit
// (and by what is left) before anything is allocated.
func (r *pickleReader) readLen(width int, limit int, what string) (int, error) {
	b, err := r.read(width)
	if err != nil {
		return 0, err
	}
	var n uint64
	switch width {
	case 1:
		n = uint64(b[0])
	case 4:
		n = uint64(binary.LittleEndian.Uint32(b))
	default:
		n = binary.LittleEndian.Uint64(b)
	}
	if n > uint64(limit) {
		return 0, r.fail("%s of %d bytes exceeds the double's limit of %d", what, n, limit)
	}
	return int(n), nil
}

func (r *pickleReader) push(o *pyObj) error {
	r.values++
	if r.values > maxIPCValues {
		return r.fail("more than %d values", maxIPCValues)
	}
	if len(r.stack) >= MaxIPCTensors+maxIPCTuple {
		return r.fail("stack deeper than %d", MaxIPCTensors+maxIPCTuple)
	}
	o.off = r.op
	r.stack = append(r.stack, o)
	return nil
}

func (r *pickleReader) pop() (*pyObj, error) {
	if len(r.stack) == 0 || (len(r.marks) > 0 && len(r.stack) == r.marks[len(r.marks)-1]) {
		return nil, r.fail("stack underflow")
	}
	o := r.stack[len(r.stack)-1]
	r.stack = r.stack[:len(r.stack)-1]
	return o, nil
}

func (r *pickleReader) top() (*pyObj, error) {
	if len(r.stack) == 0 || (len(r.marks) > 0 && len(r.stack) == r.marks[len(r.marks)-1]) {
		return nil, r.fail("stack underflow")
	}
	return r.stack[len(r.stack)-1], nil
}

// popMark removes the items above the last MARK and the MARK.
func (r *pickleReader) popMark() ([]*pyObj, error) {
	if len(r.marks) == 0 {
		return nil, r.fail("no MARK to pop to")
	}
	m := r.marks[len(r.marks)-1]
	r.marks = r.marks[:len(r.marks)-1]
	items := append([]*pyObj(nil), r.stack[m:]...)
	r.stack = r.stack[:m]
	return items, nil
}

// run executes the stream up to STOP and returns the one value it left.
func (r *pickleReader) run() (*pyObj, error) {
	if len(r.data) < 2 || r.data[0] != opProto {
		return nil, r.failAt(0, "not a pickle of protocol 3, 4 or 5: it must start with PROTO")
	}
	for {
		if r.pos >= len(r.data) {
			return nil, r.failAt(len(r.data), "truncated: no STOP")
		}
		r.op = r.pos
		code := r.data[r.pos]
		r.pos++
		done, err := r.step(code)
		if err != nil {
			return nil, err
		}
		if done {
			break
		}
	}
	if r.pos != len(r.data) {
		return nil, r.failAt(r.pos, "trailing bytes after STOP (%d)", len(r.data)-r.pos)
	}
	if len(r.marks) > 0 || len(r.stack) != 1 {
		return nil, r.fail("STOP leaves %d value(s) and %d MARK(s) on the stack, want one value", len(r.stack), len(r.marks))
	}
	return r.stack[0], nil
}

// step runs one opcode; true at STOP.
func (r *pickleReader) step(code byte) (bool, error) {
	switch code {
	case opProto:
		b, err := r.read(1)
		if err != nil {
			return false, err
		}
		if r.op != 0 {
			return false, r.fail("PROTO is allowed only at offset 0")
		}
		if b[0] < 3 || b[0] > 5 {
			return false, r.fail("pickle protocol %d, want 3, 4 or 5", b[0])
		}
	case opFrame:
		// CPython's C unpickler only checks that the frame is there.
		b, err := r.read(8)
		if err != nil {
			return false, err
		}
		n := binary.LittleEndian.Uint64(b)
		if n > uint64(len(r.data)-r.pos) {
			return false, r.fail("a frame of %d bytes, only %d left", n, len(r.data)-r.pos)
		}
		if r.frameEnd > r.op {
			return false, r.fail("a new FRAME before the previous one (ending at offset %d) ends", r.frameEnd)
		}
		r.frameEnd = r.pos + int(n)
	case opStop:
		return true, nil
	case opMark:
		if len(r.marks) >= MaxIPCDims {
			return false, r.fail("MARKs nested deeper than %d", MaxIPCDims)
		}
		r.marks = append(r.marks, len(r.stack))
	case opNone:
		return false, r.push(&pyObj{kind: pyNone})
	case opNewTrue, opNewFalse:
		v := int64(0)
		if code == opNewTrue {
			v = 1
		}
		return false, r.push(&pyObj{kind: pyBool, n: v})
	case opBinInt1, opBinInt2, opBinInt:
		width := map[byte]int{opBinInt1: 1, opBinInt2: 2, opBinInt: 4}[code]
		b, err := r.read(width)
		if err != nil {
			return false, err
		}
		var v int64
		switch width {
		case 1:
			v = int64(b[0])
		case 2:
			v = int64(binary.LittleEndian.Uint16(b))
		default:
			v = int64(int32(binary.LittleEndian.Uint32(b)))
		}
		return false, r.push(&pyObj{kind: pyInt, n: v})
	case opLong1:
		n, err := r.readLen(1, 8, "a LONG1 int (64-bit at most)")
		if err != nil {
			return false, err
		}
		b, err := r.read(n)
		if err != nil {
			return false, err
		}
		var u uint64
		for i := n - 1; i >= 0; i-- {
			u = u<<8 | uint64(b[i])
		}
		v := int64(u)
		if n > 0 && n < 8 && b[n-1]&0x80 != 0 { // sign-extend two's complement
			v = int64(u | ^uint64(0)<<(8*n))
		}
		return false, r.push(&pyObj{kind: pyInt, n: v})
	case opShortBinUnicode, opBinUnicode, opBinUnicode8:
		n, err := r.readLen(map[byte]int{opShortBinUnicode: 1, opBinUnicode: 4, opBinUnicode8: 8}[code], MaxIPCStringBytes, "a str")
		if err != nil {
			return false, err
		}
		b, err := r.read(n)
		if err != nil {
			return false, err
		}
		if !utf8.Valid(b) {
			return false, r.fail("a str that is not UTF-8")
		}
		return false, r.push(&pyObj{kind: pyStr, s: string(b)})
	case opShortBinBytes, opBinBytes, opBinBytes8:
		n, err := r.readLen(map[byte]int{opShortBinBytes: 1, opBinBytes: 4, opBinBytes8: 8}[code], MaxIPCBytesLen, "a bytes object")
		if err != nil {
			return false, err
		}
		b, err := r.read(n)
		if err != nil {
			return false, err
		}
		return false, r.push(&pyObj{kind: pyBytes, b: b})
	case opEmptyTuple:
		return false, r.push(&pyObj{kind: pyTuple, items: []*pyObj{}})
	case opEmptyList:
		return false, r.push(&pyObj{kind: pyList})
	case opEmptyDict:
		return false, r.push(&pyObj{kind: pyDict})
	case opTuple1, opTuple2, opTuple3:
		n := int(code-opTuple1) + 1
		items := make([]*pyObj, n)
		for i := n - 1; i >= 0; i-- {
			o, err := r.pop()
			if err != nil {
				return false, err
			}
			items[i] = o
		}
		return false, r.push(&pyObj{kind: pyTuple, items: items})
	case opTuple:
		items, err := r.popMark()
		if err != nil {
			return false, err
		}
		if len(items) > maxIPCTuple {
			return false, r.fail("a tuple of %d items; the double's limit is %d", len(items), maxIPCTuple)
		}
		return false, r.push(&pyObj{kind: pyTuple, items: items})
	case opAppend, opAppends:
		return false, r.appends(code)
	case opSetItem, opSetItems:
		return false, r.setItems(code)
	case opGlobal:
		mod, err := r.line()
		if err != nil {
			return false, err
		}
		name, err := r.line()
		if err != nil {
			return false, err
		}
		return false, r.global(mod, name)
	case opStackGlobal:
		name, err := r.pop()
		if err != nil {
			return false, err
		}
		mod, err := r.pop()
		if err != nil {
			return false, err
		}
		if mod.kind != pyStr || name.kind != pyStr {
			return false, r.fail("STACK_GLOBAL of %s and %s, want two str", mod.typeName(), name.typeName())
		}
		return false, r.global(mod.s, name.s)
	case opReduce:
		return false, r.reduce()
	case opMemoize, opBinPut, opLongBinPut:
		return false, r.put(code)
	case opBinGet, opLongBinGet:
		var idx uint32
		if code == opBinGet {
			b, err := r.read(1)
			if err != nil {
				return false, err
			}
			idx = uint32(b[0])
		} else {
			b, err := r.read(4)
			if err != nil {
				return false, err
			}
			idx = binary.LittleEndian.Uint32(b)
		}
		o, ok := r.memo[idx]
		if !ok {
			return false, r.fail("memo index %d was never stored", idx)
		}
		if len(r.stack) >= MaxIPCTensors+maxIPCTuple {
			return false, r.fail("stack deeper than %d", MaxIPCTensors+maxIPCTuple)
		}
		r.values++
		if r.values > maxIPCValues {
			return false, r.fail("more than %d values", maxIPCValues)
		}
		r.stack = append(r.stack, o) // the same object, as in Python
	default:
		if name := opNames[code]; name != "" {
			return false, r.fail("internal: opcode %s has no case", name)
		}
		return false, r.fail("opcode %#02x is not one the ipc handles' pickle uses", code)
	}
	return false, nil
}

// line reads one newline-terminated GLOBAL operand.
func (r *pickleReader) line() (string, error) {
	rest := r.data[r.pos:]
	i := bytes.IndexByte(rest[:min(len(rest), MaxIPCStringBytes+1)], '\n')
	if i < 0 {
		if len(rest) > MaxIPCStringBytes {
			return "", r.fail("a GLOBAL name longer than the double's limit of %d bytes", MaxIPCStringBytes)
		}
		return "", r.fail("truncated: a GLOBAL name without its newline")
	}
	r.pos += i + 1
	if !utf8.Valid(rest[:i]) {
		return "", r.fail("a GLOBAL name that is not UTF-8")
	}
	return string(rest[:i]), nil
}

func (r *pickleReader) global(mod, name string) error {
	g, ok := ipcGlobals[[2]string{mod, name}]
	if !ok {
		return r.fail("global %q is not allowed (only rebuild_cuda_tensor, torch.Tensor, torch.Size, the storage classes and torch dtypes)", clip(mod+"."+name))
	}
	return r.push(&pyObj{kind: pyGlobal, s: mod + "." + name, name: name, g: g})
}

// reduce evaluates the one allowed call: torch.Size((d0, d1, ...)).
func (r *pickleReader) reduce() error {
	args, err := r.pop()
	if err != nil {
		return err
	}
	fn, err := r.pop()
	if err != nil {
		return err
	}
	if fn.kind != pyGlobal || fn.g != gSizeClass {
		return r.fail("REDUCE of %s: only torch.Size may be called", fn.typeName())
	}
	if args.kind != pyTuple || len(args.items) != 1 || args.items[0].kind != pyTuple {
		return r.fail("REDUCE of torch.Size on %s, want a 1-tuple holding the tuple of dims", args.typeName())
	}
	dims := args.items[0].items
	if len(dims) > MaxIPCDims {
		return r.fail("torch.Size of %d dims; the double's limit is %d", len(dims), MaxIPCDims)
	}
	for i, d := range dims {
		if d.kind != pyInt || d.n < 0 {
			return r.fail("torch.Size dim %d is %s, want an int >= 0", i, describePy(d))
		}
	}
	return r.push(&pyObj{kind: pySize, items: dims})
}

func (r *pickleReader) appends(code byte) error {
	var items []*pyObj
	if code == opAppend {
		o, err := r.pop()
		if err != nil {
			return err
		}
		items = []*pyObj{o}
	} else {
		var err error
		if items, err = r.popMark(); err != nil {
			return err
		}
	}
	l, err := r.top()
	if err != nil {
		return err
	}
	if l.kind != pyList {
		return r.fail("append to %s, want a list", l.typeName())
	}
	if len(l.items)+len(items) > MaxIPCTensors {
		return r.fail("a list of more than %d items (the double's limit of tensors)", MaxIPCTensors)
	}
	l.items = append(l.items, items...)
	return nil
}

func (r *pickleReader) setItems(code byte) error {
	var kv []*pyObj
	if code == opSetItem {
		v, err := r.pop()
		if err != nil {
			return err
		}
		k, err := r.pop()
		if err != nil {
			return err
		}
		kv = []*pyObj{k, v}
	} else {
		var err error
		if kv, err = r.popMark(); err != nil {
			return err
		}
		if len(kv)%2 != 0 {
			return r.fail("SETITEMS with an odd number (%d) of keys and values", len(kv))
		}
	}
	d, err := r.top()
	if err != nil {
		return err
	}
	if d.kind != pyDict {
		return r.fail("set an item of %s, want a dict", d.typeName())
	}
	for i := 0; i < len(kv); i += 2 {
		k := kv[i]
		if k.kind != pyStr {
			return r.fail("dict key %s, want a str (a GPU UUID)", describePy(k))
		}
		replaced := false
		for j := 0; j < len(d.items); j += 2 {
			if d.items[j].s == k.s { // Python keeps the first position, the last value
				d.items[j+1], replaced = kv[i+1], true
			}
		}
		if !replaced {
			if len(d.items)/2 >= MaxIPCUUIDs {
				return r.fail("a dict of more than %d GPU UUIDs", MaxIPCUUIDs)
			}
			d.items = append(d.items, k, kv[i+1])
		}
	}
	return nil
}

func (r *pickleReader) put(code byte) error {
	var idx uint32
	switch code {
	case opMemoize:
		idx = uint32(len(r.memo))
	case opBinPut:
		b, err := r.read(1)
		if err != nil {
			return err
		}
		idx = uint32(b[0])
	default:
		b, err := r.read(4)
		if err != nil {
			return err
		}
		idx = binary.LittleEndian.Uint32(b)
	}
	o, err := r.top()
	if err != nil {
		return err
	}
	if _, ok := r.memo[idx]; !ok && len(r.memo) >= maxIPCMemo {
		return r.fail("more than %d memo entries", maxIPCMemo)
	}
	r.memo[idx] = o
	return nil
}

// describePy is a value for error messages: its type, and an int's value.
func describePy(o *pyObj) string {
	if o.kind == pyInt {
		return fmt.Sprintf("int %d", o.n)
	}
	return o.typeName()
}

// handles converts the stream's value to the typed result.
func (r *pickleReader) handles(top *pyObj) ([]IPCHandle, error) {
	if top.kind != pyList {
		return nil, r.failAt(top.off, "the pickled ipc_handles is %s, want a list", top.typeName())
	}
	out := make([]IPCHandle, len(top.items))
	for i, d := range top.items {
		if d.kind != pyDict {
			return nil, r.failAt(d.off, "ipc_handles[%d] is %s, want a dict of GPU UUID to (func, args)", i, d.typeName())
		}
		h := make(IPCHandle, 0, len(d.items)/2)
		for j := 0; j < len(d.items); j += 2 {
			uuid := d.items[j].s
			rb, err := r.rebuild(fmt.Sprintf("ipc_handles[%d][%q]", i, clip(uuid)), d.items[j+1])
			if err != nil {
				return nil, err
			}
			h = append(h, IPCHandleEntry{UUID: uuid, Rebuild: rb})
		}
		out[i] = h
	}
	return out, nil
}

// ipcArgNames name rebuild_cuda_tensor's parameters, for error messages.
var ipcArgNames = [15]string{"tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls",
	"dtype", "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
	"requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required"}

// rebuild converts one (func, args) pair; at names it in errors.
func (r *pickleReader) rebuild(at string, pair *pyObj) (IPCRebuild, error) {
	var rb IPCRebuild
	if pair.kind != pyTuple || len(pair.items) != 2 {
		return rb, r.failAt(pair.off, "%s is %s, want (func, args)", at, pair.typeName())
	}
	fn, args := pair.items[0], pair.items[1]
	if fn.kind != pyGlobal || fn.g != gRebuild {
		return rb, r.failAt(fn.off, "%s func is %s, want %s", at, fn.typeName(), IPCRebuildFunc)
	}
	rb.Func = fn.s
	if args.kind != pyTuple || len(args.items) != len(ipcArgNames) {
		return rb, r.failAt(args.off, "%s args is %s, want the 15-tuple of rebuild_cuda_tensor", at, args.typeName())
	}
	a := args.items
	var err error
	bad := func(i int, want string) error {
		return r.failAt(a[i].off, "%s args[%d] (%s) is %s, want %s", at, i, ipcArgNames[i], describePy(a[i]), want)
	}
	global := func(i int, g globalKind, want string) (string, error) {
		if a[i].kind != pyGlobal || a[i].g != g {
			return "", bad(i, want)
		}
		return a[i].s, nil
	}
	nonNeg := func(i int) (int64, error) {
		if a[i].kind != pyInt || a[i].n < 0 {
			return 0, bad(i, "an int >= 0")
		}
		return a[i].n, nil
	}
	boolean := func(i int) (bool, error) {
		if a[i].kind != pyBool {
			return false, bad(i, "a bool")
		}
		return a[i].n == 1, nil
	}
	byteStr := func(i int) ([]byte, error) {
		if a[i].kind != pyBytes {
			return nil, bad(i, "bytes")
		}
		return bytes.Clone(a[i].b), nil
	}
	if rb.TensorClass, err = global(0, gTensorClass, "the global torch.Tensor"); err != nil {
		return rb, err
	}
	if a[1].kind != pySize {
		return rb, bad(1, "a torch.Size")
	}
	rb.Size = ints(a[1].items)
	if a[2].kind != pyTuple || len(a[2].items) != len(rb.Size) {
		return rb, bad(2, fmt.Sprintf("a tuple of %d ints (one per dim)", len(rb.Size)))
	}
	for _, s := range a[2].items {
		if s.kind != pyInt || s.n < 0 {
			return rb, bad(2, "a tuple of ints >= 0")
		}
	}
	rb.Stride = ints(a[2].items)
	if rb.TensorOffset, err = nonNeg(3); err != nil {
		return rb, err
	}
	if rb.StorageClass, err = global(4, gStorageClass, "the global torch.storage.TypedStorage or UntypedStorage"); err != nil {
		return rb, err
	}
	if _, err = global(5, gDType, "a torch dtype global"); err != nil {
		return rb, err
	}
	rb.DType = a[5].name
	if a[6].kind != pyInt {
		return rb, bad(6, "an int")
	}
	rb.Device = a[6].n
	if rb.StorageHandle, err = byteStr(7); err != nil {
		return rb, err
	}
	if rb.StorageBytes, err = nonNeg(8); err != nil {
		return rb, err
	}
	if rb.StorageOffset, err = nonNeg(9); err != nil {
		return rb, err
	}
	if rb.RequiresGrad, err = boolean(10); err != nil {
		return rb, err
	}
	if rb.RefCounterHandle, err = byteStr(11); err != nil {
		return rb, err
	}
	if rb.RefCounterOffset, err = nonNeg(12); err != nil {
		return rb, err
	}
	if a[13].kind != pyNone {
		if a[13].kind != pyBytes {
			return rb, bad(13, "bytes or None")
		}
		rb.EventHandle = bytes.Clone(a[13].b)
	}
	if rb.EventSyncRequired, err = boolean(14); err != nil {
		return rb, err
	}
	return rb, nil
}

// ints copies checked int values (never nil, so a scalar's size is []).
func ints(items []*pyObj) []int64 {
	out := make([]int64, len(items))
	for i, o := range items {
		out[i] = o.n
	}
	return out
}

// pyStrList is Python's repr of a list of str, as vLLM's messages print one.
func pyStrList(items []string) string {
	quoted := make([]string, len(items))
	for i, s := range items {
		quoted[i] = pyRepr(s)
	}
	return "[" + strings.Join(quoted, ", ") + "]"
}
