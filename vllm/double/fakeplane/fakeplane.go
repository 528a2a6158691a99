// Package fakeplane is a TEST DOUBLE of a vLLM server's NCCL data plane
// for the vLLM double, over nccltest.Fake: tests of the NCCL engine and
// end-to-end tests of a GPU worker running the fake move real bytes from
// the trainer's rank to the double through it.
package fakeplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// Receiver is a TEST DOUBLE of a vLLM server's NCCL data plane for
// vllm/double (double.Config.NCCLReceiver): every rank of the server is a
// real rank of the same nccltest.Fake the trainer uses, so the fake moves
// the trainer's bytes to it and refuses any collective whose count or
// dtype differ between ranks. It plans the wire sequence from update_info
// with its own few lines of spec section 6 (not with nccl/plan), records
// every tensor it received, and hands the double only the tensor its
// bigram model has.
type Receiver struct {
	F *nccltest.Fake

	stall atomic.Bool

	mu      sync.Mutex
	comms   []*nccl.Comm
	inits   []double.NCCLInit
	updates []map[string][]byte
}

// CloseComms aborts and closes the communicators of the last init.
func (r *Receiver) CloseComms() {
	r.mu.Lock()
	old := r.comms
	r.comms = nil
	r.mu.Unlock()
	for _, c := range old {
		c.Abort(errors.New("receiver: replaced"))
		c.Close(context.Background())
	}
}

// Init joins the group with every rank of the server (double.NCCLReceiver).
func (r *Receiver) Init(ctx context.Context, in double.NCCLInit) error {
	r.CloseComms()
	if r.stall.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	var id nccl.UniqueID
	copy(id[:], in.UniqueID)
	comms := make([]*nccl.Comm, len(in.Ranks))
	errs := make([]error, len(in.Ranks))
	var wg sync.WaitGroup
	for i, rank := range in.Ranks {
		// One fake device per rank, as one GPU per vLLM worker.
		wg.Go(func() { comms[i], errs[i] = nccl.NewComm(ctx, r.F, rank, in.WorldSize, rank, id) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, c := range comms {
			if c != nil {
				c.Close(context.Background())
			}
		}
		return err
	}
	r.mu.Lock()
	r.comms = comms
	r.inits = append(r.inits, in)
	r.mu.Unlock()
	return nil
}

var receiverDTypes = map[string]nccl.DataType{
	"int8": nccl.Int8, "uint8": nccl.Uint8, "int32": nccl.Int32, "int64": nccl.Int64,
	"float16": nccl.Float16, "float32": nccl.Float32, "float64": nccl.Float64, "bfloat16": nccl.Bfloat16,
	"float8_e4m3fn": nccl.Float8e4m3,
}

type receiverChunk struct {
	tensors []int
	bytes   int64
	dtype   nccl.DataType
	count   int
}

// receiverPlan is spec section 6, written down once more.
func receiverPlan(u double.NCCLUpdate) ([]receiverChunk, error) {
	var out []receiverChunk
	if !u.Packed {
		for i, n := range u.Bytes {
			dt, ok := receiverDTypes[u.DTypeNames[i]]
			if !ok {
				return nil, fmt.Errorf("receiver: no NCCL type for %s", u.DTypeNames[i])
			}
			out = append(out, receiverChunk{tensors: []int{i}, bytes: n, dtype: dt, count: int(n) / dt.Size()})
		}
		return out, nil
	}
	var cur receiverChunk
	for i, n := range u.Bytes {
		cur.tensors = append(cur.tensors, i)
		cur.bytes += n
		if cur.bytes > u.PackedBufferSizeBytes {
			out = append(out, cur)
			cur = receiverChunk{}
		}
	}
	if len(cur.tensors) > 0 {
		out = append(out, cur)
	}
	for i := range out {
		out[i].dtype, out[i].count = nccl.Uint8, int(out[i].bytes)
	}
	return out, nil
}

// Receive receives one update on every rank (double.NCCLReceiver).
func (r *Receiver) Receive(ctx context.Context, u double.NCCLUpdate) ([]double.Tensor, error) {
	r.mu.Lock()
	comms := r.comms
	r.mu.Unlock()
	chunks, err := receiverPlan(u)
	if err != nil {
		return nil, err
	}
	got := make([]map[string][]byte, len(comms))
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for i, c := range comms {
		wg.Go(func() { got[i], errs[i] = r.receiveRank(ctx, c, u, chunks) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	for i := 1; i < len(got); i++ {
		for name, b := range got[0] {
			if !bytes.Equal(got[i][name], b) {
				return nil, fmt.Errorf("receiver: ranks disagree on %s", name)
			}
		}
	}
	r.mu.Lock()
	r.updates = append(r.updates, got[0])
	r.mu.Unlock()
	var out []double.Tensor
	for i, name := range u.Names {
		if name == bigram.TensorName {
			out = append(out, double.Tensor{Name: name, DType: u.DTypeNames[i], Shape: u.Shapes[i], Data: got[0][name]})
		}
	}
	return out, nil
}

func (r *Receiver) receiveRank(ctx context.Context, c *nccl.Comm, u double.NCCLUpdate, chunks []receiverChunk) (map[string][]byte, error) {
	out := map[string][]byte{}
	for _, ch := range chunks {
		var buf nccl.DevPtr
		if err := c.Device().Do(ctx, func(api nccl.API) (err error) {
			buf, err = api.Malloc(int(max(ch.bytes, 1)))
			return err
		}); err != nil {
			return nil, err
		}
		err := c.Broadcast(ctx, buf, ch.count, ch.dtype)
		var data []byte
		if err == nil {
			data, err = r.F.DeviceBytes(buf, int(ch.bytes))
		}
		c.Device().Do(context.Background(), func(api nccl.API) error { return api.Free(buf) })
		if err != nil {
			return nil, err
		}
		var off int64
		for _, i := range ch.tensors {
			out[u.Names[i]] = data[off : off+u.Bytes[i]]
			off += u.Bytes[i]
		}
	}
	return out, nil
}

// Received is every update received: tensor name -> bytes.
func (r *Receiver) Received() []map[string][]byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]map[string][]byte(nil), r.updates...)
}

// Inits are the inits joined.
func (r *Receiver) Inits() []double.NCCLInit {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]double.NCCLInit(nil), r.inits...)
}

// Stall makes the next inits wait for their context instead of joining (on)
// or join again (off): a worker that reached the store but never joins NCCL.
func (r *Receiver) Stall(on bool) { r.stall.Store(on) }
