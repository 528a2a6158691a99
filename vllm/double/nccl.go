package double

import (
	"context"
	"encoding/json"
	"math"
	"math/bits"
	"sort"
	"strings"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// NCCLReceiver is the NCCL data plane the double does not have. The double
// performs the control plane itself (TCPStore rendezvous, metadata
// validation); a receiver, e.g. one built on rlflow's nccl package in a GPU
// test, joins the communicator and receives the broadcasts.
//
// Init is called once per successful init_weight_transfer_engine (on A:
// init_weight_transfer), after the rendezvous, and must take part in the
// group's ncclCommInitRank and warm-up all-reduce for the ranks given.
// Receive is called once per valid update_weights and must receive every
// tensor, in order, exactly as the spec's data-plane layout describes
// (packed or not); it returns the tensors, which the double then loads
// (only "bigram.logits", F32 [128,128], is a weight it knows; any other
// name fails the update after the bytes were received, as vLLM's
// load_weights would). Both must honour ctx: it ends when the HTTP
// request does.
type NCCLReceiver interface {
	Init(ctx context.Context, init NCCLInit) error
	Receive(ctx context.Context, update NCCLUpdate) ([]Tensor, error)
}

// NCCLInit is what a worker knows after the rendezvous.
type NCCLInit struct {
	UniqueID      []byte // the 128-byte ncclUniqueId rank 0 published
	MasterAddress string // "" when the id came as nccl_unique_id_b64
	MasterPort    int
	Ranks         []int // this server's ranks: rank_offset .. rank_offset+W-1
	WorldSize     int   // the whole group, trainer included
	// Packed settings from init_info (generations D and E).
	Packed                bool
	PackedBufferSizeBytes int64
	PackedNumBuffers      int
}

// NCCLUpdate is one update_weights' metadata, packed settings resolved:
// from init_info on D and E, update_info on B and C, vLLM's defaults (1 GiB,
// 2 buffers) for what they leave out; on A, whose update_info has only
// packed, the chunk size is min(2% of Config.GPUMemoryBytes, 5 GiB) and
// the buffers 2, as A's packed consumer derived them.
type NCCLUpdate struct {
	Names                 []string
	DTypeNames            []string
	Shapes                [][]int64
	Bytes                 []int64 // per tensor: prod(shape) × itemsize
	Packed                bool
	PackedBufferSizeBytes int64
	PackedNumBuffers      int
	// NCCLDataTypes is, when not Packed, the ncclDataType_t vLLM's worker
	// receives each tensor's broadcast with (ncclDataTypes); nil when
	// Packed, where every chunk is one ncclUint8 broadcast.
	NCCLDataTypes []nccl.DataType
}

// Tensor is one received tensor.
type Tensor struct {
	Name  string
	DType string // torch name, as in dtype_names
	Shape []int64
	Data  []byte
}

// ncclDataTypes is vLLM's ncclDataTypeEnum.from_torch: the torch dtypes a
// worker receives in a non-packed broadcast, each with its ncclDataType_t
// (spec sections 3 and 8: float8_e4m3fn is NCCL type 10). vLLM raises on
// every other dtype, uint32, uint64 and float8_e5m2 included although NCCL
// has types for them; packed updates carry any dtype as bytes.
var ncclDataTypes = map[string]nccl.DataType{
	"int8": nccl.Int8, "uint8": nccl.Uint8, "int32": nccl.Int32, "int64": nccl.Int64,
	"float16": nccl.Float16, "float32": nccl.Float32, "float64": nccl.Float64, "bfloat16": nccl.Bfloat16,
	"float8_e4m3fn": nccl.Float8e4m3,
}

// nonPackedDTypes lists ncclDataTypes' keys for error messages.
var nonPackedDTypes = func() string {
	names := make([]string, 0, len(ncclDataTypes))
	for n := range ncclDataTypes {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}()

// A's packed chunk size: min(int(total GPU memory * 0.02), 5 GiB), the
// rule of its packed_tensor module (it took no packed_buffer_size_bytes).
const (
	packedGPUMemoryRatio = 0.02
	packedChunkCap       = 5 << 30
)

// packedChunkFromGPU is A's packed chunk size for a GPU of mem bytes.
func packedChunkFromGPU(mem int64) int64 {
	return min(int64(float64(mem)*packedGPUMemoryRatio), packedChunkCap)
}

// ncclMetadata validates update_info's NCCL metadata: non-packed tensors
// need a dtype vLLM maps to an NCCL type; packed ones any dtype the double
// can size (they travel as bytes).
func (s *Server) ncclMetadata(info map[string]json.RawMessage, init *NCCLInit) (NCCLUpdate, error) {
	names, _ := get[[]string](info, "names")
	dtypes, _ := get[[]string](info, "dtype_names")
	shapes, _ := get[[][]int64](info, "shapes")
	if len(names) != len(dtypes) || len(names) != len(shapes) {
		return NCCLUpdate{}, workerError("ValueError: update_info lists differ in length: %d names, %d dtype_names, %d shapes",
			len(names), len(dtypes), len(shapes))
	}
	u := NCCLUpdate{Names: names, DTypeNames: dtypes, Shapes: shapes, Bytes: make([]int64, len(names))}
	if err := s.packedSettings(&u, info, init); err != nil {
		return NCCLUpdate{}, err
	}
	if !u.Packed {
		u.NCCLDataTypes = make([]nccl.DataType, len(names))
	}
	seen := make(map[string]bool, len(names))
	for i, name := range names {
		if seen[name] {
			return NCCLUpdate{}, workerError("ValueError: update_info.names repeats %q", name)
		}
		seen[name] = true
		nt, mapped := ncclDataTypes[dtypes[i]]
		dt, err := safetensors.DTypeFromTorch(dtypes[i])
		switch {
		case !u.Packed && !mapped:
			return NCCLUpdate{}, workerError("ValueError: tensor %q: dtype %q has no NCCL data type in a non-packed broadcast (vLLM maps only %s; a packed update carries any dtype as bytes)",
				name, dtypes[i], nonPackedDTypes)
		case err != nil:
			return NCCLUpdate{}, workerError("ValueError: tensor %q: dtype %q is not a torch dtype the vLLM double knows the item size of", name, dtypes[i])
		}
		if !u.Packed {
			u.NCCLDataTypes[i] = nt
		}
		n, ok := tensorBytes(shapes[i], int64(dt.ItemSize()))
		if !ok {
			return NCCLUpdate{}, workerError("ValueError: tensor %q: shape %v is too large", name, shapes[i])
		}
		u.Bytes[i] = n
	}
	return u, nil
}

// packedSettings resolves u's packed settings for the server's generation.
func (s *Server) packedSettings(u *NCCLUpdate, info map[string]json.RawMessage, init *NCCLInit) error {
	g := s.cfg.Generation
	switch {
	case g.packedInInit():
		u.Packed, u.PackedBufferSizeBytes, u.PackedNumBuffers = init.Packed, init.PackedBufferSizeBytes, init.PackedNumBuffers
	case g.packedSizeFromGPU():
		if u.Packed, _ = get[bool](info, "packed"); u.Packed {
			u.PackedBufferSizeBytes, u.PackedNumBuffers = packedChunkFromGPU(s.cfg.GPUMemoryBytes), defaultPackedNumBuffers
		}
		return nil
	default:
		u.Packed, _ = get[bool](info, "packed")
		u.PackedBufferSizeBytes, _ = get[int64](info, "packed_buffer_size_bytes")
		u.PackedNumBuffers, _ = get[int](info, "packed_num_buffers")
	}
	if u.PackedBufferSizeBytes < 0 || u.PackedNumBuffers < 0 {
		return workerError("ValueError: packed_buffer_size_bytes and packed_num_buffers must be positive")
	}
	if u.Packed {
		if u.PackedBufferSizeBytes == 0 {
			u.PackedBufferSizeBytes = defaultPackedBufferSize
		}
		if u.PackedNumBuffers == 0 {
			u.PackedNumBuffers = defaultPackedNumBuffers
		}
	}
	return nil
}

// tensorBytes is prod(shape) × item with overflow checks (prod([]) = 1).
func tensorBytes(shape []int64, item int64) (int64, bool) {
	n := uint64(item)
	for _, d := range shape {
		if d < 0 {
			return 0, false
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, false
		}
		n = lo
	}
	return int64(n), true
}

// receiveNCCL validates an update against the current init and receives it
// through the receiver, if there is one.
func (s *Server) receiveNCCL(ctx context.Context, info map[string]json.RawMessage) (*bigram.Model, error) {
	s.mu.Lock()
	init := s.wstate.init
	s.mu.Unlock()
	if init == nil {
		return nil, workerError("RuntimeError: weight transfer engine is not initialized; call %s first", strings.TrimPrefix(s.cfg.Generation.initPath(), "/"))
	}
	u, err := s.ncclMetadata(info, init)
	if err != nil {
		return nil, err
	}
	if s.cfg.NCCLReceiver == nil {
		var total int64
		for _, b := range u.Bytes {
			total += b
		}
		return nil, workerError("double: no NCCL data plane: the update_info metadata is valid (%d tensors, %d bytes) but the double cannot receive NCCL broadcasts; configure Config.NCCLReceiver or use the disk backend",
			len(u.Names), total)
	}
	tensors, err := s.cfg.NCCLReceiver.Receive(ctx, u)
	if err != nil {
		return nil, workerError("RuntimeError: NCCL receive failed: %v", err)
	}
	return loadTensors(tensors)
}

// loadTensors is vLLM's load_weights on the bigram model: every received
// tensor must be bigram.logits (F32 [128, 128]); the last one wins.
func loadTensors(tensors []Tensor) (*bigram.Model, error) {
	var m *bigram.Model
	var err error
	for _, t := range tensors {
		if t.Name != bigram.TensorName {
			return nil, workerError("KeyError: 'unexpected weight %s: the bigram model has only %s'", t.Name, bigram.TensorName)
		}
		if m, err = bigram.FromTensor(t.DType, t.Shape, t.Data); err != nil {
			return nil, workerError("ValueError: %v", err)
		}
	}
	if m == nil {
		return nil, workerError("ValueError: the update carried no %s tensor", bigram.TensorName)
	}
	return m, nil
}
