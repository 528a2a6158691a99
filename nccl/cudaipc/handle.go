// Package cudaipc maps device memory that another process on the same host
// exported with CUDA IPC (cudaIpcGetMemHandle) into this process, through
// the CUDA runtime that package nccl already dlopen'd. It is the importer
// side of issue 18's zero-copy hand-off: a PyTorch trainer exports the
// storage of its parameters, the GPU worker opens the handles and reads the
// bytes in place (to broadcast them, or to snapshot them with one
// device-to-device copy).
//
// Invariants:
//
//   - A handle names a whole cudaMalloc block, not a tensor: PyTorch's
//     caching allocator carves many storages out of one block, so several
//     tensors arrive with the same handle and different byte offsets. A
//     process opens each distinct handle once and shares the mapping.
//   - Open and Close run on a thread whose current device is the handle's
//     device: inside nccl.Device.Do. The mapping belongs to that device's
//     primary context and is valid on every thread of the process.
//   - The exporter must keep the memory alive until Close: CUDA does not
//     keep a block alive for its importers.
package cudaipc

import (
	"errors"
	"fmt"
)

// MemHandleBytes is sizeof(cudaIpcMemHandle_t) (CUDA_IPC_HANDLE_SIZE).
const MemHandleBytes = 64

// MemHandle is the 64 opaque bytes of a cudaIpcMemHandle_t.
type MemHandle [MemHandleBytes]byte

// The framing of PyTorch's shareable handle (c10 CUDACachingAllocator
// shareIpcHandle, the second element of storage._share_cuda_()): one
// version byte, one type byte, then the payload. A handle of exactly
// MemHandleBytes bytes is the raw cudaIpcMemHandle_t that torch wrote
// before the framing existed, and torch still accepts it.
const (
	torchTypeCudaMalloc        = 'c' // payload: one cudaIpcMemHandle_t of the block's base
	torchTypeExpandableSegment = 'e' // payload: cuMem file-descriptor handles of segment pages
	// torchMaxVersion is the newest framing whose 'c' payload is known:
	// torch up to 2.12 writes 2; 2.13 writes 3 with the same 'c' payload.
	torchMaxVersion = 3
)

// ErrExpandableSegment is ParseTorchHandle's answer for storage from
// PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=
// expandable_segments:True): those are cuMem allocations shared through
// file descriptors, which cudaIpcOpenMemHandle cannot open.
var ErrExpandableSegment = errors.New("cudaipc: storage from an expandable segment (PYTORCH_CUDA_ALLOC_CONF expandable_segments:True), not a cudaMalloc block; export with expandable_segments:False")

// ParseTorchHandle extracts the cudaIpcMemHandle_t from the handle bytes
// PyTorch produces for a CUDA storage (element 1 of
// storage._share_cuda_(), handle of reductions.rebuild_cuda_tensor). The
// handle is of the block's base: add the storage's byte offset (element 3)
// to the opened pointer. The error names the problem, never the bytes.
func ParseTorchHandle(b []byte) (MemHandle, error) {
	var h MemHandle
	if len(b) == MemHandleBytes {
		copy(h[:], b)
		return h, nil
	}
	if len(b) < 2 {
		return h, fmt.Errorf("cudaipc: torch handle of %d bytes: want %d (raw) or a version and a type byte then the payload", len(b), MemHandleBytes)
	}
	version, typ := b[0], b[1]
	switch {
	case version == 0 || version > torchMaxVersion:
		return h, fmt.Errorf("cudaipc: torch handle version %d: only 1..%d are known", version, torchMaxVersion)
	case typ == torchTypeExpandableSegment:
		return h, ErrExpandableSegment
	case typ != torchTypeCudaMalloc:
		return h, fmt.Errorf("cudaipc: torch handle type byte %#x: want 'c' (a cudaMalloc block)", typ)
	case len(b) != 2+MemHandleBytes:
		return h, fmt.Errorf("cudaipc: torch handle of type 'c' has %d bytes: want %d", len(b), 2+MemHandleBytes)
	}
	copy(h[:], b[2:])
	return h, nil
}
