package double

import (
	"context"
	"encoding/json"

	"math"
	"math/bits"

	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// NCCLReceiver is the NCCL data plane the double does not have. The double
// performs the control plane itself (TCPStore rendezvous, metadata
// validation); a receiver, e.g. one built on rlflow's nccl package in a GPU
// test, joins the communicator and receives the broadcasts.
//
// Init is called once per successful init_weight_transfer_engine, after the
// rendezvous, and must take part in the group's ncclCommInitRank and warm-up
// all-reduce for the ranks given. Receive is called once per valid
// update_weights and must receive every tensor, in order, exactly as the
// spec's data-plane layout describes (packed or not); it returns the
// tensors, which the double then loads (only "bigram.logits", F32
// [128,128], is a weight it knows; any other name fails the update after
// the bytes were received, as vLLM's load_weights would). Both must honour
// ctx: it ends when the HTTP request does.
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

// NCCLUpdate is one update_weights' metadata, packed settings resolved
// (from init_info on D, update_info on B/C, vLLM's defaults otherwise).
type NCCLUpdate struct {
	Names                 []string
	DTypeNames            []string
	Shapes                [][]int64
	Bytes                 []int64 // per tensor: prod(shape) × itemsize
	Packed                bool
	PackedBufferSizeBytes int64
	PackedNumBuffers      int
}

// Tensor is one received tensor.
type Tensor struct {
	Name  string
	DType string // torch name, as in dtype_names
	Shape []int64
	Data  []byte
}

// ncclDTypes are the torch dtypes that map to an ncclDataType_t (spec
// section 3); vLLM cannot broadcast any other.
var ncclDTypes = map[string]bool{
	"int8": true, "uint8": true, "int32": true, "uint32": true, "int64": true, "uint64": true,
	"float16": true, "float32": true, "float64": true, "bfloat16": true,
}

// ncclMetadata validates update_info's NCCL metadata.
func (s *Server) ncclMetadata(info map[string]json.RawMessage, init *NCCLInit) (NCCLUpdate, error) {
	names, _ := get[[]string](info, "names")
	dtypes, _ := get[[]string](info, "dtype_names")
	shapes, _ := get[[][]int64](info, "shapes")
	if len(names) != len(dtypes) || len(names) != len(shapes) {
		return NCCLUpdate{}, workerError("ValueError: update_info lists differ in length: %d names, %d dtype_names, %d shapes",
			len(names), len(dtypes), len(shapes))
	}
	u := NCCLUpdate{Names: names, DTypeNames: dtypes, Shapes: shapes, Bytes: make([]int64, len(names))}
	seen := make(map[string]bool, len(names))
	for i, name := range names {
		if seen[name] {
			return NCCLUpdate{}, workerError("ValueError: update_info.names repeats %q", name)
		}
		seen[name] = true
		dt, err := safetensors.DTypeFromTorch(dtypes[i])
		if err != nil || !ncclDTypes[dtypes[i]] {
			return NCCLUpdate{}, workerError("ValueError: tensor %q: dtype %q has no NCCL data type", name, dtypes[i])
		}
		n, ok := tensorBytes(shapes[i], int64(dt.ItemSize()))
		if !ok {
			return NCCLUpdate{}, workerError("ValueError: tensor %q: shape %v is too large", name, shapes[i])
		}
		u.Bytes[i] = n
	}
	if s.cfg.Generation.packedInInit() {
		u.Packed, u.PackedBufferSizeBytes, u.PackedNumBuffers = init.Packed, init.PackedBufferSizeBytes, init.PackedNumBuffers
	} else {
		u.Packed, _ = get[bool](info, "packed")
		u.PackedBufferSizeBytes, _ = get[int64](info, "packed_buffer_size_bytes")
		u.PackedNumBuffers, _ = get[int](info, "packed_num_buffers")
	}
	if u.PackedBufferSizeBytes < 0 || u.PackedNumBuffers < 0 {
		return NCCLUpdate{}, workerError("ValueError: packed_buffer_size_bytes and packed_num_buffers must be positive")
	}
	if u.Packed {
		if u.PackedBufferSizeBytes == 0 {
			u.PackedBufferSizeBytes = defaultPackedBufferSize
		}
		if u.PackedNumBuffers == 0 {
			u.PackedNumBuffers = defaultPackedNumBuffers
		}
	}
	return u, nil
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
		return nil, workerError("RuntimeError: weight transfer engine is not initialized; call init_weight_transfer_engine first")
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
	var m *bigram.Model
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
