package trainer

// The snapshot a resident trainer publishes (PROTOCOL.md, "publish"): the
// description the GPU worker validates and maps before broadcasting from it.
// The NCCL engine reads it (transfer.UpdateRequest.Snapshot); this package is
// its one definition.

// The IPC kinds of a snapshot: the same strings as nccl.IPCCUDA and
// nccl.IPCFakeShm (the control worker, which imports this package, must not
// depend on nccl's cgo; a test of the NCCL engine holds them equal).
const (
	// IPCCUDA: Handle holds torch's shareable handle of a cudaMalloc block.
	IPCCUDA = "cuda"
	// IPCFakeShm: Path names a shared file standing in for device memory.
	// A TEST DOUBLE: only nccltest.Fake opens it.
	IPCFakeShm = "fake_shm"
)

// Snapshot is one published version of the trainer's weights in device
// memory another process (the trainer) owns until it is released.
type Snapshot struct {
	Version string
	IPC     string // IPCCUDA or IPCFakeShm
	Handle  []byte // IPCCUDA: torch's handle bytes (cudaipc.ParseTorchHandle)
	Path    string // IPCFakeShm: the shared file
	// StorageBytes is the size of the snapshot's storage (every tensor
	// lies within it); StorageOffset is where it starts from the base of
	// the block the handle names.
	StorageBytes  int64
	StorageOffset int64
	Device        int
	GPUUUID       string
	Tensors       []Tensor
	// Owner names the process that exported it (pid and generation): an
	// opened mapping is reused only for the same owner and handle.
	Owner string
	// Iteration is the trainer's iteration when it published (the last
	// it trained; 0 before any): what the weights are.
	Iteration int
	// SnapshotSeconds is how long the trainer was blocked copying.
	SnapshotSeconds float64
	// Refs are the tensors' CUDA IPC ref-counter slots, one per entry of
	// Tensors in that order (the reply's ipc_refs), when the publish asked
	// for them (PublishRequest.IPCRefs); nil otherwise.
	Refs []IPCRef
}

// MaxRefCounterHandleBytes bounds IPCRef.CounterHandle: torch's handle is
// the name of a shared-memory file ("/torch_<pid>_<random>_<n>").
const MaxRefCounterHandleBytes = 256

// IPCEventHandleBytes is the size of a cudaIpcEventHandle_t.
const IPCEventHandleBytes = 64

// IPCRef is one tensor's share of the snapshot's storage as torch exports
// it: the fields 4 to 7 of its own storage._share_cuda_() call, which
// vLLM's ipc backend hands to torch's rebuild_cuda_tensor. Every tensor
// has its own ref-counter slot: the receiver releases one per tensor (a
// slot shared by N tensors would be released N times).
type IPCRef struct {
	// CounterHandle names torch's ref-counter file (_share_cuda_()[4]),
	// CounterOffset the slot in it ([5]).
	CounterHandle []byte
	CounterOffset int64
	// EventHandle is the cudaIpcEventHandle_t the receiver waits on ([6]:
	// IPCEventHandleBytes, or nil when torch gave None);
	// EventSyncRequired says whether it must ([7]).
	EventHandle       []byte
	EventSyncRequired bool
}

// Tensor is one tensor of a snapshot, in state-dict order.
type Tensor struct {
	Name  string
	DType string // torch attribute name: bfloat16, float32, ...
	Shape []int64
	// Offset is in bytes from the snapshot's start (StorageOffset into
	// the block); Bytes is prod(Shape) x the dtype's item size.
	Offset, Bytes int64
}

// ShareHandle is what names the snapshot's block to a process that opens
// it as torch's rebuild_cuda_tensor does: torch's own handle bytes
// (IPCCUDA), or, for the TEST DOUBLE's fake_shm, the shared file's path
// (which the vLLM double's FileIPC opens).
func (s *Snapshot) ShareHandle() []byte {
	if s.IPC == IPCFakeShm {
		return []byte(s.Path)
	}
	return s.Handle
}

// Bytes is the snapshot's extent: the end of its last tensor.
func (s *Snapshot) Bytes() int64 {
	var end int64
	for _, t := range s.Tensors {
		end = max(end, t.Offset+t.Bytes)
	}
	return end
}
