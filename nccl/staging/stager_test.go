package staging

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/safetensors"
)

// testTensor describes a tensor of the test checkpoint.
type testTensor struct {
	name  string
	dtype safetensors.DType
	shape []int64
}

// writeCheckpoint writes tensors with deterministic, distinct contents
// (float tensors hold finite values, so conversions are exact to check).
func writeCheckpoint(t testing.TB, dir string, tensors []testTensor) *safetensors.Checkpoint {
	t.Helper()
	var wt []safetensors.WriteTensor
	for i, tt := range tensors {
		n := int64(1)
		for _, d := range tt.shape {
			n *= d
		}
		data := make([]byte, n*int64(tt.dtype.ItemSize()))
		switch tt.dtype {
		case safetensors.F32:
			for j := int64(0); j < n; j++ {
				binary.LittleEndian.PutUint32(data[4*j:], math.Float32bits(float32(i)+float32(j)*0.001-7))
			}
		default:
			for j := range data {
				data[j] = byte(i*31 + j*7 + j/251)
			}
		}
		wt = append(wt, safetensors.WriteTensor{Name: tt.name, DType: tt.dtype, Shape: tt.shape, Data: data})
	}
	path := filepath.Join(dir, "model.safetensors")
	if err := safetensors.Write(path, wt, nil); err != nil {
		t.Fatal(err)
	}
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	return ck
}

var mixed = []testTensor{
	{"embed", safetensors.BF16, []int64{64, 33}},
	{"one", safetensors.BF16, []int64{1}},
	{"three", safetensors.F32, []int64{3}},
	{"odd", safetensors.BF16, []int64{4097}},
	{"scalar", safetensors.I64, nil},
	{"norm", safetensors.F32, []int64{129}},
	{"big", safetensors.BF16, []int64{3000}},
	{"mask", safetensors.U8, []int64{17}},
	{"empty", safetensors.BF16, []int64{0, 4}},
	{"last", safetensors.F16, []int64{5, 5}},
}

// oracleTypes is vLLM's ncclDataTypeEnum.from_torch, written down again.
var oracleTypes = map[safetensors.DType]nccl.DataType{
	safetensors.I8: nccl.Int8, safetensors.U8: nccl.Uint8, safetensors.I32: nccl.Int32, safetensors.I64: nccl.Int64,
	safetensors.F16: nccl.Float16, safetensors.F32: nccl.Float32, safetensors.F64: nccl.Float64, safetensors.BF16: nccl.Bfloat16,
}

// oracle is this test's own reading of spec section 6 (independent of the
// planner): the wire sequence as chunks, with optional F32->BF16.
func oracle(t testing.TB, ck *safetensors.Checkpoint, packed bool, threshold int64, toBF16 bool) []Chunk {
	t.Helper()
	var chunks []Chunk
	var cur Chunk
	flush := func() {
		if len(cur.Pieces) > 0 {
			cur.DType, cur.Count = nccl.Uint8, int(cur.Bytes)
			chunks = append(chunks, cur)
		}
		cur = Chunk{}
	}
	for _, ti := range ck.Tensors() {
		wire := ti.DType
		if toBF16 && wire == safetensors.F32 {
			wire = safetensors.BF16
		}
		size := ti.Size / int64(ti.DType.ItemSize()) * int64(wire.ItemSize())
		if !packed {
			dt, ok := oracleTypes[wire]
			if !ok {
				t.Fatalf("%s cannot go non-packed", wire)
			}
			chunks = append(chunks, Chunk{Pieces: []Piece{{Src: ti, Wire: wire, Bytes: size}}, Bytes: size, DType: dt, Count: int(size) / wire.ItemSize()})
			continue
		}
		cur.Pieces = append(cur.Pieces, Piece{Src: ti, Wire: wire, Offset: cur.Bytes, Bytes: size})
		cur.Bytes += size
		if cur.Bytes > threshold {
			flush()
		}
	}
	flush()
	return chunks
}

// wireBytes is what chunk c must carry.
func wireBytes(t testing.TB, ck *safetensors.Checkpoint, c Chunk) []byte {
	t.Helper()
	var out []byte
	for _, p := range c.Pieces {
		b, err := ck.Bytes(p.Src)
		if err != nil {
			t.Fatal(err)
		}
		if p.Wire != p.Src.DType {
			conv := make([]byte, p.Bytes)
			if err := safetensors.ConvertF32ToBF16(conv, b); err != nil {
				t.Fatal(err)
			}
			b = conv
		}
		out = append(out, b...)
	}
	return out
}

type env struct {
	fake *nccltest.Fake
	comm *nccl.Comm
	pipe *Stager
}

func setup(t *testing.T, cfg nccltest.Config, bufBytes int64, opts Options) *env {
	t.Helper()
	cfg.VirtualPeers, cfg.KeepData = true, true
	f := nccltest.NewFake(cfg)
	id, _ := f.GetUniqueID()
	c, err := nccl.NewComm(context.Background(), f, 0, 2, 0, id)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewStager(context.Background(), c.Device(), bufBytes, opts)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{fake: f, comm: c, pipe: p}
	t.Cleanup(func() {
		if err := p.Close(context.Background()); err != nil {
			t.Errorf("close pipeline: %v", err)
		}
		c.Close(context.Background())
		if l := f.Leaks(); l != "" {
			t.Errorf("leaked %s", l)
		}
	})
	return e
}

// checkWire asserts the exact broadcast sequence after the warm-up.
func checkWire(t *testing.T, f *nccltest.Fake, ck *safetensors.Checkpoint, want []Chunk) {
	t.Helper()
	got := f.Collectives(0)
	if len(got) == 0 || got[0].Op != "AllReduce" {
		t.Fatal("no warm-up all-reduce first")
	}
	got = got[1:]
	if len(got) != len(want) {
		t.Fatalf("%d broadcasts, want %d", len(got), len(want))
	}
	for k, w := range want {
		g := got[k]
		if g.Op != "Broadcast" || g.Root != 0 || g.DType != w.DType || g.Count != w.Count || int64(g.Bytes) != w.Bytes {
			t.Fatalf("broadcast %d: %s %d x %v (%d bytes) root %d, want %d x %v (%d bytes) root 0", k, g.Op, g.Count, g.DType, g.Bytes, g.Root, w.Count, w.DType, w.Bytes)
		}
		if !bytes.Equal(g.Data, wireBytes(t, ck, w)) {
			t.Fatalf("broadcast %d (%s): wrong bytes", k, firstName(w))
		}
	}
}

func TestBroadcastPackedWireSequence(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	for _, threshold := range []int64{1, 1000, 4226, 8192, 1 << 30} {
		t.Run(fmt.Sprint("T=", threshold), func(t *testing.T) {
			chunks := oracle(t, ck, true, threshold, false)
			// Small OpDelay: copies and broadcasts really run out of step.
			e := setup(t, nccltest.Config{OpDelay: 200 * time.Microsecond}, MaxChunk(chunks), Options{CopyWorkers: 3, SplitBytes: 1000})
			res, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks)
			if err != nil {
				t.Fatal(err)
			}
			checkWire(t, e.fake, ck, chunks)
			if res.Bytes != ck.TotalBytes() || res.Chunks != len(chunks) || res.Tensors != len(mixed) {
				t.Errorf("result %v", res)
			}
			if res.Wall <= 0 || res.H2D <= 0 || res.Broadcast <= 0 {
				t.Errorf("timings missing: %v", res)
			}
		})
	}
}

func TestBroadcastNonPackedWireSequence(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, false, 0, false)
	var sent []int64
	e := setup(t, nccltest.Config{OpDelay: 100 * time.Microsecond}, MaxChunk(chunks), Options{Buffers: 3,
		Progress: func(n int64) { sent = append(sent, n) }})
	if _, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks); err != nil {
		t.Fatal(err)
	}
	checkWire(t, e.fake, ck, chunks)
	// Progress counts every completed broadcast once, in order.
	var want []int64
	var total int64
	for _, c := range chunks {
		total += c.Bytes
		want = append(want, total)
	}
	if fmt.Sprint(sent) != fmt.Sprint(want) {
		t.Errorf("progress %v, want %v", sent, want)
	}
	// The per-tensor dtypes are the tensors' own, e.g. the I64 scalar.
	for _, c := range e.fake.Collectives(0)[1:] {
		if c.DType == nccl.Int64 && c.Count != 1 {
			t.Errorf("scalar sent as %d x int64", c.Count)
		}
	}
}

func TestBroadcastConvertsF32ToBF16(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	for _, packed := range []bool{false, true} {
		chunks := oracle(t, ck, packed, 5000, true)
		e := setup(t, nccltest.Config{}, MaxChunk(chunks), Options{SplitBytes: 64})
		if _, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks); err != nil {
			t.Fatal(err)
		}
		checkWire(t, e.fake, ck, chunks)
		if !packed {
			for _, c := range e.fake.Collectives(0)[1:] {
				if c.DType == nccl.Float32 {
					t.Fatal("an F32 tensor went out unconverted")
				}
			}
		}
	}
}

// instrumented records which tensors were read, so that a test can see how
// far ahead of the wire the host copies are.
type instrumented struct {
	Source
	mu    sync.Mutex
	reads map[string]bool
	read  chan string
}

func (s *instrumented) Bytes(t safetensors.TensorInfo) ([]byte, error) {
	s.mu.Lock()
	s.reads[t.Name] = true
	s.mu.Unlock()
	select {
	case s.read <- t.Name:
	default:
	}
	return s.Source.Bytes(t)
}

func (s *instrumented) has(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reads[name]
}

func TestOverlapAndLookahead(t *testing.T) {
	tensors := make([]testTensor, 8)
	for i := range tensors {
		tensors[i] = testTensor{fmt.Sprintf("t%d", i), safetensors.BF16, []int64{512}}
	}
	ck := writeCheckpoint(t, t.TempDir(), tensors)
	chunks := oracle(t, ck, false, 0, false) // one tensor per chunk
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprint("buffers=", n), func(t *testing.T) {
			e := setup(t, nccltest.Config{}, MaxChunk(chunks), Options{Buffers: n})
			src := &instrumented{Source: ck, reads: map[string]bool{}, read: make(chan string, 100)}
			// Hold broadcast 0 (collective 1; 0 is the warm-up) until the
			// test has seen how far the host got.
			release := make(chan struct{})
			var overlapped, ranAhead atomic.Bool
			e.fake.OnCollective(func(c nccltest.Call) nccltest.Fault {
				if c.Op == "Broadcast" && c.Index == 1 {
					// Overlap: chunk 1 is staged while chunk 0 is on the wire.
					deadline := time.After(2 * time.Second)
					for !src.has("t1") {
						select {
						case <-src.read:
						case <-deadline:
							<-release
							return nccltest.Fault{}
						}
					}
					overlapped.Store(true)
					time.Sleep(50 * time.Millisecond) // let the host run as far as it may
					ranAhead.Store(src.has(fmt.Sprintf("t%d", n+1)))
					<-release
				}
				return nccltest.Fault{}
			})
			done := make(chan error, 1)
			go func() {
				_, err := e.pipe.Broadcast(context.Background(), e.comm, src, chunks)
				done <- err
			}()
			time.Sleep(100 * time.Millisecond)
			close(release)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if !overlapped.Load() {
				t.Error("chunk 1 was not staged while chunk 0 was being broadcast")
			}
			if ranAhead.Load() {
				t.Errorf("with %d buffers the host read chunk %d while chunk 0 was still on the wire", n, n+1)
			}
			if !src.has(fmt.Sprintf("t%d", n)) {
				t.Errorf("with %d buffers chunk %d should have been staged early", n, n)
			}
			checkWire(t, e.fake, ck, chunks)
		})
	}
}

func TestStageOnly(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, true, 2000, false)
	f := nccltest.NewFake(nccltest.Config{OpDelay: 100 * time.Microsecond})
	dev, err := nccl.OpenDevice(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	p, err := NewStager(context.Background(), dev, MaxChunk(chunks), Options{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := p.Stage(context.Background(), ck, chunks)
	if err != nil {
		t.Fatal(err)
	}
	if res.Bytes != ck.TotalBytes() || res.H2D <= 0 || res.Broadcast != 0 {
		t.Errorf("result %v", res)
	}
	// The last chunk is in its device buffer.
	last := len(chunks) - 1
	got, err := f.DeviceBytes(p.devb[last%len(p.devb)], int(chunks[last].Bytes))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, wireBytes(t, ck, chunks[last])) {
		t.Error("device buffer does not hold the last chunk")
	}
	if n := len(f.Calls()); n != 0 {
		t.Errorf("stage-only made %d NCCL calls", n)
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

func TestCancelAbortsAndPoisons(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, false, 0, false)
	e := setup(t, nccltest.Config{}, MaxChunk(chunks), Options{})
	e.fake.OnCollective(func(c nccltest.Call) nccltest.Fault { return nccltest.Fault{Stall: c.Index == 3} })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := e.pipe.Broadcast(ctx, e.comm, ck, chunks)
	if !errors.Is(err, nccl.ErrAborted) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want an aborted communicator and the deadline", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("took %v after a 100ms deadline", d)
	}
	if !strings.Contains(err.Error(), "chunk ") {
		t.Errorf("error does not say which chunk: %v", err)
	}
	calls := e.fake.Calls()
	if calls[len(calls)-1].Op != "CommAbort" {
		t.Error("communicator not aborted")
	}
	// Poisoned: a second transfer fails fast; the pipeline itself is fine.
	n := len(e.fake.Calls())
	if _, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks); !errors.Is(err, nccl.ErrAborted) {
		t.Fatalf("second broadcast on a poisoned comm: %v", err)
	}
	if len(e.fake.Calls()) != n {
		t.Error("a poisoned communicator reached NCCL")
	}
	if _, err := e.pipe.Stage(context.Background(), ck, chunks); err != nil {
		t.Fatalf("pipeline unusable after an aborted broadcast: %v", err)
	}
	t.Logf("error: %v", err)
}

func TestAsyncErrorMidTransfer(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, false, 0, false)
	e := setup(t, nccltest.Config{}, MaxChunk(chunks), Options{})
	e.fake.OnCollective(func(c nccltest.Call) nccltest.Fault {
		if c.Index == 4 {
			return nccltest.Fault{Err: nccl.RemoteError, Delay: 5 * time.Millisecond}
		}
		return nccltest.Fault{}
	})
	_, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks)
	if !errors.Is(err, nccl.RemoteError) || !errors.Is(err, nccl.ErrAborted) {
		t.Fatalf("got %v", err)
	}
}

func TestBufferAndMemoryChecks(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, false, 0, false)
	e := setup(t, nccltest.Config{}, MaxChunk(chunks)-1, Options{})
	if _, err := e.pipe.Stage(context.Background(), ck, chunks); err == nil || !strings.Contains(err.Error(), "cannot be split") {
		t.Fatalf("undersized buffers: %v", err)
	}

	f := nccltest.NewFake(nccltest.Config{DeviceMemory: 300 << 20})
	dev, _ := nccl.OpenDevice(f, 0)
	defer dev.Close()
	_, err := NewStager(context.Background(), dev, 64<<20, Options{Buffers: 2})
	if err == nil || !strings.Contains(err.Error(), "free") {
		t.Fatalf("want a free-memory error, got %v", err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s after a failed New", l)
	}

	bad := append([]Chunk(nil), chunks...)
	bad[1].Count++
	if _, err := e.pipe.Stage(context.Background(), ck, bad); err == nil {
		t.Fatal("inconsistent chunk accepted")
	}
}

// A real in-process receiver on another fake device: the bytes arrive, and
// a receiver that dies mid-transfer ends the trainer's broadcast with an
// error rather than a hang.
func TestReceiverGetsBytesAndDeathIsAnError(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, true, 3000, false)
	for _, dieAfter := range []int{-1, 1} {
		t.Run(fmt.Sprint("die after ", dieAfter), func(t *testing.T) {
			f := nccltest.NewFake(nccltest.Config{Devices: 3, OpDelay: 50 * time.Microsecond})
			id, _ := f.GetUniqueID()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			type got struct {
				data [][]byte
				err  error
			}
			results := make(chan got, 2)
			for rank := 1; rank <= 2; rank++ {
				go func() {
					var g got
					defer func() { results <- g }()
					c, err := nccl.NewComm(ctx, f, rank, 3, rank, id)
					if err != nil {
						g.err = err
						return
					}
					defer c.Close(ctx)
					for k, ch := range chunks {
						if rank == 2 && k == dieAfter {
							c.Abort(errors.New("receiver killed"))
							g.err = errors.New("died on purpose")
							return
						}
						var p nccl.DevPtr
						_ = c.Device().Do(ctx, func(api nccl.API) error { p, err = api.Malloc(int(max(ch.Bytes, 1))); return err })
						err := c.Broadcast(ctx, p, ch.Count, ch.DType)
						b, _ := f.DeviceBytes(p, int(ch.Bytes))
						_ = c.Device().Do(ctx, func(api nccl.API) error { return api.Free(p) })
						if err != nil {
							g.err = err
							return
						}
						g.data = append(g.data, b)
					}
				}()
			}
			c, err := nccl.NewComm(ctx, f, 0, 3, 0, id)
			if err != nil {
				t.Fatal(err)
			}
			p, err := NewStager(ctx, c.Device(), MaxChunk(chunks), Options{})
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.Broadcast(ctx, c, ck, chunks)
			for i := 0; i < 2; i++ {
				g := <-results
				if dieAfter < 0 {
					if g.err != nil {
						t.Fatalf("receiver: %v", g.err)
					}
					for k, ch := range chunks {
						if !bytes.Equal(g.data[k], wireBytes(t, ck, ch)) {
							t.Fatalf("receiver got wrong bytes in chunk %d", k)
						}
					}
				}
			}
			if dieAfter < 0 && err != nil {
				t.Fatal(err)
			}
			if dieAfter >= 0 && !errors.Is(err, nccl.RemoteError) {
				t.Fatalf("trainer after a receiver died: %v, want ncclRemoteError", err)
			}
			if err := p.Close(ctx); err != nil {
				t.Fatal(err)
			}
			c.Close(ctx)
			if l := f.Leaks(); l != "" {
				t.Errorf("leaked %s", l)
			}
		})
	}
}

// A host copy waiting for a pinned slot whose copy is queued behind a
// broadcast that cannot finish learns of the peer's death from the
// communicator's asynchronous error; it does not wait for a deadline (there
// is none here).
func TestSlotWaitSeesAsyncError(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	chunks := oracle(t, ck, true, 4226, false)
	if len(chunks) < 3 {
		t.Fatalf("want 3+ chunks, got %d", len(chunks))
	}
	// Two 256-byte slots: chunk 3's windows queue behind broadcast 1.
	e := setup(t, nccltest.Config{}, MaxChunk(chunks), Options{Buffers: 2, WindowBytes: 256, PinnedBytes: 512})
	e.fake.OnCollective(func(c nccltest.Call) nccltest.Fault {
		if c.Index == 1 { // the first broadcast (0 is the warm-up)
			return nccltest.Fault{Err: nccl.RemoteError, Delay: 30 * time.Millisecond}
		}
		return nccltest.Fault{}
	})
	done := make(chan error, 1)
	go func() {
		_, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, nccl.RemoteError) || !errors.Is(err, nccl.ErrAborted) {
			t.Fatalf("got %v, want ncclRemoteError and an aborted communicator", err)
		}
		t.Logf("error: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the transfer hung after the peer's asynchronous error")
	}
	if _, err := e.pipe.Stage(context.Background(), ck, chunks); err != nil {
		t.Fatalf("pipeline unusable after the failed broadcast: %v", err)
	}
}
