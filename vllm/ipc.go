package vllm

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"regexp"
)

// The client side of vLLM's ipc weight-transfer backend: the trainer and
// the vLLM worker share a GPU, and update_info.ipc_handles_pickled hands
// the worker CUDA IPC handles of the trainer's tensors, as the pickle of
// what torch's reduce_tensor would have produced (spec section 8; the
// table in the ipc contract). The worker unpickles it, looks its own GPU
// UUID up in each dict and calls rebuild_cuda_tensor(*args).

// IPCStorage is the trainer's exported CUDA storage, as torch's
// storage._share_cuda_() describes it. Every tensor of one update lies in
// it.
type IPCStorage struct {
	// GPUUUID is the GPU's UUID, lowercase 8-4-4-4-12 hex without "GPU-":
	// the key the worker finds its own device by.
	GPUUUID string
	// Device is the trainer's device index (the worker overwrites it).
	Device int
	// Handle is torch's handle exactly as _share_cuda_()[1] gave it.
	Handle []byte
	// StorageBytes is the storage's size; StorageOffset its offset in the
	// cudaMalloc block the handle names.
	StorageBytes, StorageOffset int64
}

// IPCTensor is one C-contiguous tensor inside the IPCStorage, with its own
// share of the storage's ref counter: torch takes one slot per
// _share_cuda_() call, so each tensor needs the refs of its own call (one
// slot shared by several tensors would be released more than once).
type IPCTensor struct {
	Name  string  // for errors only: the pickle carries no names
	DType string  // torch attribute name: "bfloat16", "float32", ...
	Shape []int64 // [] for a scalar
	// Offset is in bytes from the storage start, a multiple of the
	// dtype's item size.
	Offset int64

	CounterHandle     []byte // _share_cuda_()[4]
	CounterOffset     int64  // _share_cuda_()[5]
	EventHandle       []byte // _share_cuda_()[6]: 64 bytes, or nil for None
	EventSyncRequired bool   // _share_cuda_()[7]
}

// ipcEventHandleBytes is the size of a cudaIpcEventHandle_t.
const ipcEventHandleBytes = 64

// ipcItemSizes are the bytes per element of the dtypes an ipc update may
// carry, by torch attribute name: the dtypes a trainer snapshot may hold
// (trainer.DTypeSize, the source of truth). vllm sits in the lowest layer
// and cannot import trainer or safetensors; a test holds this table equal
// to theirs.
var ipcItemSizes = map[string]int64{
	"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
	"int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
	"float8_e4m3fn": 1, "float8_e5m2": 1,
}

// IsGPUUUID reports whether s is a GPU UUID as vLLM's ipc backend keys
// handles by it: lowercase 8-4-4-4-12 hex without "GPU-", Python's
// str(uuid.UUID) of torch's device property.
func IsGPUUUID(s string) bool { return gpuUUIDPattern.MatchString(s) }

var gpuUUIDPattern = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// The globals the pickle names (the receiver's allow-list must hold them).
const (
	ipcRebuildModule, ipcRebuildName = "torch.multiprocessing.reductions", "rebuild_cuda_tensor"
	ipcStorageModule, ipcStorageName = "torch.storage", "TypedStorage"
)

// EncodeIPCHandles returns ipc_handles_pickled: the standard base64 of the
// protocol-3 pickle of a list with one {gpu_uuid: (rebuild_cuda_tensor,
// args)} per tensor, in order, where args is torch's 15-tuple for a CUDA
// tensor. It refuses, naming the tensor and field, a malformed GPU UUID, an
// empty handle, an unknown dtype, a negative dimension, a misaligned
// offset, a tensor outside the storage and an empty list. The output is a
// function of the input alone (no memo, no frames).
func EncodeIPCHandles(st IPCStorage, tensors []IPCTensor) (string, error) {
	if err := checkIPCStorage(st); err != nil {
		return "", fmt.Errorf("ipc_handles_pickled: storage: %w", err)
	}
	if len(tensors) == 0 {
		return "", fmt.Errorf("ipc_handles_pickled: no tensors")
	}
	var p pickler
	p.op(opProto, 3)
	p.op(opEmptyList, opMark)
	for i, t := range tensors {
		item, strides, err := checkIPCTensor(st, t)
		if err != nil {
			return "", fmt.Errorf("ipc_handles_pickled: tensor %d (%q): %w", i, t.Name, err)
		}
		p.op(opEmptyDict)
		p.str(st.GPUUUID)
		p.global(ipcRebuildModule, ipcRebuildName)
		// args, torch's reduce_tensor tuple; the numbers are its indices.
		p.op(opMark)
		p.global("torch", "Tensor") // 0 tensor_cls
		p.global("torch", "Size")   // 1 tensor_size: torch.Size((dims,)), a REDUCE
		p.ints(t.Shape)
		p.op(opTuple1, opReduce)
		p.ints(strides)                            // 2 tensor_stride, C-contiguous
		p.int(t.Offset / item)                     // 3 tensor_offset, in elements
		p.global(ipcStorageModule, ipcStorageName) // 4 storage_cls
		p.global("torch", t.DType)                 // 5 dtype
		p.int(int64(st.Device))                    // 6 storage_device
		p.bytes(st.Handle)                         // 7 storage_handle
		p.int(st.StorageBytes)                     // 8 storage_size_bytes
		p.int(st.StorageOffset)                    // 9 storage_offset_bytes
		p.bool(false)                              // 10 requires_grad
		p.bytes(t.CounterHandle)                   // 11 ref_counter_handle
		p.int(t.CounterOffset)                     // 12 ref_counter_offset
		if t.EventHandle == nil {                  // 13 event_handle
			p.op(opNone)
		} else {
			p.bytes(t.EventHandle)
		}
		p.bool(t.EventSyncRequired) // 14 event_sync_required
		p.op(opTuple)               // args
		p.op(opTuple2, opSetItem)   // (func, args) under the uuid
	}
	p.op(opAppends, opStop)
	return base64.StdEncoding.EncodeToString(p.b), nil
}

func checkIPCStorage(st IPCStorage) error {
	switch {
	case !IsGPUUUID(st.GPUUUID):
		return fmt.Errorf("gpu uuid is not lowercase 8-4-4-4-12 hex (without \"GPU-\")")
	case st.Device < 0:
		return fmt.Errorf("device %d is negative", st.Device)
	case len(st.Handle) == 0:
		return fmt.Errorf("handle is empty")
	case int64(len(st.Handle)) > math.MaxUint32:
		return fmt.Errorf("handle of %d bytes is too long", len(st.Handle))
	case st.StorageBytes < 0:
		return fmt.Errorf("storage bytes %d is negative", st.StorageBytes)
	case st.StorageOffset < 0:
		return fmt.Errorf("storage offset %d is negative", st.StorageOffset)
	}
	return nil
}

// checkIPCTensor checks t against st and returns its item size and its
// C-contiguous strides in elements.
func checkIPCTensor(st IPCStorage, t IPCTensor) (item int64, strides []int64, err error) {
	item, ok := ipcItemSizes[t.DType]
	if !ok {
		return 0, nil, fmt.Errorf("dtype %q is not one the ipc backend carries", t.DType)
	}
	// numel and strides as torch computes them: a zero dimension counts
	// as 1 in the strides of the dimensions before it.
	numel, stride := int64(1), int64(1)
	strides = make([]int64, len(t.Shape))
	for k := len(t.Shape) - 1; k >= 0; k-- {
		d := t.Shape[k]
		if d < 0 {
			return 0, nil, fmt.Errorf("shape %v has a negative dimension", t.Shape)
		}
		strides[k] = stride
		var over1, over2 bool
		numel, over1 = mulInt64(numel, d)
		if k > 0 {
			stride, over2 = mulInt64(stride, max(d, 1))
		}
		if over1 || over2 {
			return 0, nil, fmt.Errorf("shape %v overflows int64", t.Shape)
		}
	}
	size, over := mulInt64(numel, item)
	switch {
	case over:
		return 0, nil, fmt.Errorf("shape %v overflows int64 bytes", t.Shape)
	case t.Offset < 0:
		return 0, nil, fmt.Errorf("offset %d is negative", t.Offset)
	case t.Offset%item != 0:
		return 0, nil, fmt.Errorf("offset %d bytes is not a multiple of the %s item size %d", t.Offset, t.DType, item)
	case t.Offset > st.StorageBytes || size > st.StorageBytes-t.Offset:
		return 0, nil, fmt.Errorf("bytes [%d, %d) exceed the storage's %d bytes", t.Offset, uint64(t.Offset)+uint64(size), st.StorageBytes)
	case len(t.CounterHandle) == 0:
		return 0, nil, fmt.Errorf("ref counter handle is empty")
	case int64(len(t.CounterHandle)) > math.MaxUint32:
		return 0, nil, fmt.Errorf("ref counter handle of %d bytes is too long", len(t.CounterHandle))
	case t.CounterOffset < 0:
		return 0, nil, fmt.Errorf("ref counter offset %d is negative", t.CounterOffset)
	case t.EventHandle != nil && len(t.EventHandle) != ipcEventHandleBytes:
		return 0, nil, fmt.Errorf("event handle has %d bytes, want %d (or nil for None)", len(t.EventHandle), ipcEventHandleBytes)
	}
	return item, strides, nil
}

// mulInt64 multiplies non-negative a and b, reporting overflow.
func mulInt64(a, b int64) (int64, bool) {
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	return int64(lo), hi != 0 || lo > math.MaxInt64
}

// Pickle opcodes the writer uses (protocol 3, no memo): the ipc contract
// lists them, and the vLLM double's reader accepts exactly those and
// Python's.
const (
	opProto         = 0x80
	opGlobal        = 'c'
	opEmptyList     = ']'
	opEmptyDict     = '}'
	opEmptyTuple    = ')'
	opMark          = '('
	opAppends       = 'e'
	opSetItem       = 's'
	opTuple         = 't'
	opTuple1        = 0x85
	opTuple2        = 0x86
	opTuple3        = 0x87
	opReduce        = 'R'
	opBinInt1       = 'K'
	opBinInt2       = 'M'
	opBinInt        = 'J'
	opLong1         = 0x8a
	opBinUnicode    = 'X'
	opShortBinBytes = 'C'
	opBinBytes      = 'B'
	opNewTrue       = 0x88
	opNewFalse      = 0x89
	opNone          = 'N'
	opStop          = '.'
)

// pickler appends pickle opcodes, each spelled as CPython's protocol-3
// pickler spells the same value, so the bytes equal pickle.dumps's
// without its memo (and its APPEND for a one-item list).
type pickler struct{ b []byte }

func (p *pickler) op(ops ...byte) { p.b = append(p.b, ops...) }

// global is GLOBAL: module and name come from this file's constants and
// the dtype table, never from input, so they hold no newline.
func (p *pickler) global(module, name string) {
	p.b = append(p.b, opGlobal)
	p.b = append(p.b, module...)
	p.b = append(p.b, '\n')
	p.b = append(p.b, name...)
	p.b = append(p.b, '\n')
}

func (p *pickler) int(v int64) {
	switch {
	case v >= 0 && v <= 0xff:
		p.b = append(p.b, opBinInt1, byte(v))
	case v >= 0 && v <= 0xffff:
		p.b = binary.LittleEndian.AppendUint16(append(p.b, opBinInt2), uint16(v))
	case v >= math.MinInt32 && v <= math.MaxInt32:
		p.b = binary.LittleEndian.AppendUint32(append(p.b, opBinInt), uint32(int32(v)))
	default:
		// LONG1: the shortest little-endian two's complement, as
		// pickle.encode_long writes it.
		var le [8]byte
		binary.LittleEndian.PutUint64(le[:], uint64(v))
		n := 8
		for n > 1 && ((le[n-1] == 0 && le[n-2]&0x80 == 0) || (le[n-1] == 0xff && le[n-2]&0x80 != 0)) {
			n--
		}
		p.b = append(append(p.b, opLong1, byte(n)), le[:n]...)
	}
}

// ints is a tuple of ints.
func (p *pickler) ints(vs []int64) {
	if len(vs) == 0 {
		p.op(opEmptyTuple)
		return
	}
	if len(vs) > 3 {
		p.op(opMark)
	}
	for _, v := range vs {
		p.int(v)
	}
	switch len(vs) {
	case 1:
		p.op(opTuple1)
	case 2:
		p.op(opTuple2)
	case 3:
		p.op(opTuple3)
	default:
		p.op(opTuple)
	}
}

func (p *pickler) str(s string) {
	p.b = binary.LittleEndian.AppendUint32(append(p.b, opBinUnicode), uint32(len(s)))
	p.b = append(p.b, s...)
}

// bytes writes b, whose length the caller bounded to 32 bits.
func (p *pickler) bytes(b []byte) {
	if len(b) <= 0xff {
		p.b = append(p.b, opShortBinBytes, byte(len(b)))
	} else {
		p.b = binary.LittleEndian.AppendUint32(append(p.b, opBinBytes), uint32(len(b)))
	}
	p.b = append(p.b, b...)
}

func (p *pickler) bool(v bool) {
	if v {
		p.op(opNewTrue)
	} else {
		p.op(opNewFalse)
	}
}
