package ncclengine

import (
	"encoding/binary"
	"math"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// writeTensors writes the bigram weight (which the vLLM double loads) and
// extra tensors to dir/name.
func writeTensors(t *testing.T, dir, name string, extra ...safetensors.WriteTensor) string {
	t.Helper()
	logits := make([]byte, 4*bigram.Vocab*bigram.Vocab)
	for i := 0; i < bigram.Vocab*bigram.Vocab; i++ {
		binary.LittleEndian.PutUint32(logits[4*i:], math.Float32bits(float32(math.Cos(float64(i)))))
	}
	path := filepath.Join(dir, name)
	ts := append([]safetensors.WriteTensor{{Name: bigram.TensorName, DType: safetensors.F32, Shape: []int64{bigram.Vocab, bigram.Vocab}, Data: logits}}, extra...)
	if err := safetensors.Write(path, ts, nil); err != nil {
		t.Fatal(err)
	}
	return path
}

func bytesOf(n int, k byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i)*3 + k
	}
	return b
}

// broadcasts counts the data broadcasts the fake NCCL saw (the warm-up is
// an all-reduce, not counted).
func broadcasts(f *nccltest.Fake) int {
	n := 0
	for _, c := range f.Calls() {
		if c.Op == "Broadcast" {
			n++
		}
	}
	return n
}

// assertNothingSent: no update session opened, no update_weights, no
// broadcast, no tensor received, no byte counted.
func (e *env) assertNothingSent(t *testing.T) {
	t.Helper()
	for i, s := range e.servers {
		for _, route := range []string{"POST /start_weight_update", "POST /update_weights"} {
			if n := e.requests(i, route); n != 0 {
				t.Errorf("server %d saw %d %s", i, n, route)
			}
		}
		if got := s.rcv.Received(); len(got) != 0 {
			t.Errorf("server %d received %d updates", i, len(got))
		}
	}
	if n := broadcasts(e.f); n != 0 {
		t.Errorf("the fake NCCL saw %d broadcasts", n)
	}
	if p := e.progress.Report(); p.BytesSent != 0 {
		t.Errorf("progress says %d bytes sent", p.BytesSent)
	}
}

// TestPackedUnreceivableRefusedBeforeSending: a packed checkpoint that vLLM's
// unpacking cannot view (a 0-dim tensor, a float32 at an odd offset) is
// refused as BadInput naming both tensors, before any update session or
// broadcast, whether the broadcast initialises the group or finds it
// ready; the group then carries a receivable checkpoint byte-exact.
func TestPackedUnreceivableRefusedBeforeSending(t *testing.T) {
	for _, initFirst := range []bool{false, true} {
		name := "broadcast-initialises"
		if initFirst {
			name = "group-initialised"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1, 2}, wt: pipelines.WeightTransfer{Packed: true, BufferBytes: 1 << 20}})
			ctx := e.ctx()
			if initFirst {
				if _, err := e.init(ctx, nil); err != nil {
					t.Fatal(err)
				}
			}
			dir := t.TempDir()
			bad := writeTensors(t, dir, "bad.safetensors",
				safetensors.WriteTensor{Name: "step", DType: safetensors.I64, Shape: []int64{}, Data: bytesOf(8, 1)},
				safetensors.WriteTensor{Name: "mask", DType: safetensors.U8, Shape: []int64{3}, Data: bytesOf(3, 2)},
				safetensors.WriteTensor{Name: "scale", DType: safetensors.F32, Shape: []int64{2}, Data: bytesOf(8, 3)},
			)
			_, err := e.broadcast(ctx, bad, 1, nil)
			if kindOf(err) != transfer.BadInput {
				t.Fatalf("error of kind %v, want BadInput: %v", kindOf(err), err)
			}
			off := int64(4 * bigram.Vocab * bigram.Vocab)
			for _, want := range []string{
				"broadcast refused, nothing sent: plan: vLLM cannot unpack 2 tensors of this packed transfer",
				`"step" (shape [], int64, offset ` + strconv.FormatInt(off, 10) + ` in chunk 0): it is 0-dim`,
				`"scale" (shape [2], float32, offset ` + strconv.FormatInt(off+11, 10) + ` in chunk 0): its offset is not a multiple of its item size 4`,
				"set weight_transfer.packed to false",
			} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q lacks %q", err, want)
				}
			}
			e.assertNothingSent(t)

			good := writeTensors(t, dir, "good.safetensors",
				safetensors.WriteTensor{Name: "step", DType: safetensors.I64, Shape: []int64{1}, Data: bytesOf(8, 1)},
				safetensors.WriteTensor{Name: "scale", DType: safetensors.F32, Shape: []int64{2}, Data: bytesOf(8, 3)},
				safetensors.WriteTensor{Name: "empty", DType: safetensors.BF16, Shape: []int64{0, 4}},
				safetensors.WriteTensor{Name: "mask", DType: safetensors.U8, Shape: []int64{3}, Data: bytesOf(3, 2)},
			)
			if _, err := e.broadcast(ctx, good, 2, nil); err != nil {
				t.Fatalf("a receivable checkpoint after the refusal: %v", err)
			}
			for i, s := range e.servers {
				got := s.rcv.Received()
				if len(got) != 1 {
					t.Fatalf("server %d received %d updates, want 1", i, len(got))
				}
				checkBytes(t, good, got[0], false)
			}
		})
	}
}

// oldNCCL is the fake NCCL reporting a library older than 2.24, which has
// no fp8 types.
type oldNCCL struct{ *nccltest.Fake }

func (oldNCCL) NCCLVersion() (int, error) { return 22304, nil }

// TestFP8NonPackedNeedsNCCL224: with a loaded NCCL older than 2.24, a
// non-packed fp8 tensor is refused as BadInput naming the library's version
// and the tensor, before any session or broadcast (ncclBroadcast would
// fail on type 10 mid-update).
func TestFP8NonPackedNeedsNCCL224(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}})
	old, err := New(Config{
		API: oldNCCL{e.f}, Device: 0, Advertise: "127.0.0.1",
		Staging: staging.Options{DeviceMargin: 1 << 20},
		Comm:    []nccl.CommOption{nccl.WithPollInterval(20*time.Microsecond, time.Millisecond)},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { old.Close() })
	e.tr = old
	path := writeTensors(t, t.TempDir(), "fp8.safetensors",
		safetensors.WriteTensor{Name: "w.fp8", DType: safetensors.F8E4M3, Shape: []int64{3, 5}, Data: bytesOf(15, 4)})
	_, err = e.broadcast(e.ctx(), path, 1, nil)
	if kindOf(err) != transfer.BadInput || !strings.Contains(err.Error(), "the loaded NCCL 2.23.4 cannot broadcast 1 tensor non-packed, which needs NCCL 2.24.0 or later: \"w.fp8\" (float8_e4m3fn as ncclFloat8e4m3)") {
		t.Fatalf("error of kind %v: %v", kindOf(err), err)
	}
	e.assertNothingSent(t)
}

// TestFP8NonPackedLayout: an F8_E4M3 tensor is laid out as one broadcast of
// ncclFloat8e4m3 (type 10, what vLLM's from_torch maps float8_e4m3fn to)
// with count = bytes, and the engine lets it through on NCCL 2.28. (The
// vLLM double refuses fp8 dtype_names, so the bytes are checked end to end
// by the GPU test against receiver.py: TestGPUFP8NonPacked.)
func TestFP8NonPackedLayout(t *testing.T) {
	path := writeTensors(t, t.TempDir(), "fp8.safetensors",
		safetensors.WriteTensor{Name: "w.fp8", DType: safetensors.F8E4M3, Shape: []int64{3, 5}, Data: bytesOf(15, 4)},
		safetensors.WriteTensor{Name: "w.e5m2", DType: safetensors.F8E5M2, Shape: []int64{2}, Data: bytesOf(2, 5)})
	ck, err := transfer.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if _, err := staging.Plan(ck.Tensors(), false, 0, nil); err == nil || !strings.Contains(err.Error(), `"float8_e5m2" has no NCCL type in vLLM's non-packed path`) {
		t.Fatalf("float8_e5m2 non-packed: %v", err)
	}
	u, err := staging.Plan(ck.Tensors()[:2], false, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	fp8 := u.Chunks[1]
	if fp8.Pieces[0].Src.Name != "w.fp8" || fp8.DType != nccl.Float8e4m3 || int(fp8.DType) != 10 || fp8.Count != 15 || fp8.Bytes != 15 {
		t.Fatalf("fp8 chunk %+v", fp8)
	}
	e := &Engine{cfg: Config{API: nccltest.NewFake(nccltest.Config{})}}
	if err := e.checkReceivable(u.Tensors, packing{}); err != nil {
		t.Fatalf("NCCL 2.28.3: %v", err)
	}
	if err := (&Engine{cfg: Config{API: oldNCCL{nccltest.NewFake(nccltest.Config{})}}}).checkReceivable(u.Tensors, packing{}); kindOf(err) != transfer.BadInput {
		t.Fatalf("NCCL 2.23.4: %v", err)
	}
}
