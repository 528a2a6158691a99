package ncclengine

import (
	"bytes"
	"encoding/binary"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

var updateGolden = flag.Bool("update", false, "rewrite testdata/snapshot_refusals.golden")

// snapTensor is one tensor a test trainer publishes.
type snapTensor struct {
	name  string
	dtype safetensors.DType
	shape []int64
	data  []byte
}

// snapTensors are the bigram weight (float32: the double loads it) and
// bfloat16, float32, int64 and uint8 tensors of awkward sizes, a
// zero-size one included; seed makes each publish's bytes differ. Largest
// item size first, as a packed checkpoint must be for vLLM to unpack it.
func snapTensors(seed int) []snapTensor {
	logits := make([]byte, 4*bigram.Vocab*bigram.Vocab)
	for i := 0; i < bigram.Vocab*bigram.Vocab; i++ {
		binary.LittleEndian.PutUint32(logits[4*i:], math.Float32bits(float32(math.Sin(float64(i*seed+3)))*2))
	}
	fill := func(n, k int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i*11 + k*29 + seed*7)
		}
		return b
	}
	return []snapTensor{
		{"extra.step", safetensors.I64, []int64{1}, fill(8, 1)},
		{bigram.TensorName, safetensors.F32, []int64{bigram.Vocab, bigram.Vocab}, logits},
		{"extra.f32", safetensors.F32, []int64{1023}, fill(4*1023, 2)},
		{"extra.3x5x7", safetensors.BF16, []int64{3, 5, 7}, fill(2*105, 3)},
		{"extra.empty", safetensors.BF16, []int64{0, 4}, nil},
		{"extra.4097", safetensors.BF16, []int64{4097}, fill(2*4097, 4)},
		{"extra.mask", safetensors.U8, []int64{17}, fill(17, 5)},
	}
}

// publish does what a resident trainer's publish does with a fake_shm
// snapshot (trainer/PROTOCOL.md): the tensors back to back in order, each
// at the next multiple of its item size, in the storage that starts
// storageOffset bytes into the file (the block), written in place so that
// a mapping of the file sees them. Every other byte of the file is 0xEE.
func publish(t *testing.T, path, version, owner string, storageOffset int64, ts []snapTensor) *trainer.Snapshot {
	t.Helper()
	s := &trainer.Snapshot{Version: version, IPC: trainer.IPCFakeShm, Path: path, StorageOffset: storageOffset, Owner: owner}
	var end int64
	for _, x := range ts {
		item := int64(x.dtype.ItemSize())
		off := (end + item - 1) / item * item
		s.Tensors = append(s.Tensors, trainer.Tensor{Name: x.name, DType: x.dtype.TorchName(), Shape: x.shape, Offset: off, Bytes: int64(len(x.data))})
		end = off + int64(len(x.data))
	}
	s.StorageBytes = end
	block := bytes.Repeat([]byte{0xEE}, int(storageOffset+end))
	for i, x := range ts {
		copy(block[storageOffset+s.Tensors[i].Offset:], x.data)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(block, 0); err != nil {
		t.Fatal(err)
	}
	return s
}

// checkpointOf writes ts as a safetensors checkpoint: the checkpoint path's
// twin of a snapshot.
func checkpointOf(t *testing.T, dir string, ts []snapTensor) string {
	t.Helper()
	var wt []safetensors.WriteTensor
	for _, x := range ts {
		wt = append(wt, safetensors.WriteTensor{Name: x.name, DType: x.dtype, Shape: x.shape, Data: x.data})
	}
	path := filepath.Join(dir, "twin.safetensors")
	if err := safetensors.Write(path, wt, nil); err != nil {
		t.Fatal(err)
	}
	return path
}

// withIPC gives the env's engine the fake as its IPC importer, as the GPU
// worker does with --fake-nccl.
func (e *env) withIPC() *env {
	e.tr.cfg.IPC = e.f
	return e
}

// publishUpdate broadcasts snap as the publish step of iteration iter does.
func (e *env) publishUpdate(snap *trainer.Snapshot, iter int, mod func(*transfer.UpdateRequest)) (transfer.UpdateResult, error) {
	return e.broadcast(e.ctx(), "", iter, func(req *transfer.UpdateRequest) {
		req.Checkpoint, req.Snapshot, req.Version = "", snap, snap.Version
		if mod != nil {
			mod(req)
		}
	})
}

// checkSnapshotBytes compares what a receiver got with ts, tensor by tensor.
func checkSnapshotBytes(t *testing.T, got map[string][]byte, ts []snapTensor) {
	t.Helper()
	if len(got) != len(ts) {
		t.Fatalf("received %d tensors, the snapshot has %d", len(got), len(ts))
	}
	for _, x := range ts {
		if !bytes.Equal(got[x.name], x.data) && len(x.data)+len(got[x.name]) > 0 {
			t.Fatalf("tensor %s: received %d bytes that differ from the snapshot's %d", x.name, len(got[x.name]), len(x.data))
		}
	}
}

// ipcMappings is how many fake_shm mappings the fake holds open.
func ipcMappings(f *nccltest.Fake) int {
	m := regexp.MustCompile(`(\d+) IPC mappings`).FindStringSubmatch(f.Leaks())
	if m == nil {
		return 0
	}
	var n int
	fmt.Sscan(m[1], &n)
	return n
}

// A resident trainer's snapshot reaches every server byte-exact straight
// from the mapped file, packed and not, on generations D and E with
// tensor-parallel servers; the second publish into the same buffer reuses
// the mapping and is what arrives.
func TestSnapshotBroadcast(t *testing.T) {
	for _, gen := range []double.Generation{double.GenD, double.GenE} {
		for _, packed := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/packed=%v", gen, packed), func(t *testing.T) {
				wt := pipelines.WeightTransfer{Packed: packed}
				if packed {
					wt.BufferBytes = 4096 // several chunks, tensors crossing T
				}
				e := newEnv(t, envConfig{gen: gen, worldSizes: []int{1, 2}, wt: wt}).withIPC()
				path := filepath.Join(t.TempDir(), "snapshot.shm")
				for iter := 1; iter <= 2; iter++ {
					ts := snapTensors(iter)
					snap := publish(t, path, fmt.Sprintf("run-1/iter-%d", iter), "pid-7/gen-1", 512, ts)
					out, err := e.publishUpdate(snap, iter, nil)
					if err != nil {
						t.Fatalf("publish %d: %v", iter, err)
					}
					if out.Source != transfer.SourceSnapshot || out.Opened != (iter == 1) || out.Initialized != (iter == 1) ||
						out.Tensors != len(ts) || out.Bytes != plainBytes(ts) {
						t.Fatalf("publish %d: result %+v", iter, out)
					}
					for i, s := range e.servers {
						got := s.rcv.Received()
						if len(got) != iter {
							t.Fatalf("server %d received %d updates after %d publishes", i, len(got), iter)
						}
						checkSnapshotBytes(t, got[iter-1], ts)
						if v := s.WeightVersion(); v != snap.Version {
							t.Fatalf("server %d weight version %q, want %q", i, v, snap.Version)
						}
					}
					if p := e.progress.Report(); p.Phase != "broadcast" || p.BytesTotal != out.Bytes || p.BytesSent != p.BytesTotal {
						t.Fatalf("publish %d: progress %+v", iter, p)
					}
				}
				if n := ipcMappings(e.f); n != 1 {
					t.Fatalf("%d mappings open after two publishes, want 1", n)
				}
				// Zero copy: no staging pipeline was built (the checkpoint
				// path keeps its pinned ring between broadcasts).
				if l := e.f.Leaks(); strings.Contains(l, "pinned") {
					t.Fatalf("pinned host memory allocated: %s", l)
				}
			})
		}
	}
}

func plainBytes(ts []snapTensor) int64 {
	var n int64
	for _, x := range ts {
		n += int64(len(x.data))
	}
	return n
}

// The servers cannot tell a snapshot from its checkpoint twin: the same
// requests with the same bodies, the same broadcasts (count and NCCL type
// each, packed or not) and the same bytes received.
func TestSnapshotMatchesCheckpointPath(t *testing.T) {
	port := regexp.MustCompile(`"master_port":\d+`)
	id := regexp.MustCompile(`"nccl_unique_id_b64":"[A-Za-z0-9+/=]+"`)
	type wire struct {
		count int
		dtype nccl.DataType
	}
	run := func(t *testing.T, gen double.Generation, wt pipelines.WeightTransfer, snapshot bool) ([]string, []wire) {
		e := newEnv(t, envConfig{gen: gen, worldSizes: []int{1}, wt: wt, record: true}).withIPC()
		ts := snapTensors(1)
		var err error
		if snapshot {
			_, err = e.publishUpdate(publish(t, filepath.Join(t.TempDir(), "s.shm"), "run-1/iter-1", "pid-1/gen-1", 0, ts), 1, nil)
		} else {
			_, err = e.broadcast(e.ctx(), checkpointOf(t, t.TempDir(), ts), 1, nil)
		}
		if err != nil {
			t.Fatal(err)
		}
		var lines []string
		for _, l := range e.servers[0].rec.Lines() {
			lines = append(lines, id.ReplaceAllString(port.ReplaceAllString(l, `"master_port":PORT`), `"nccl_unique_id_b64":"ID"`))
		}
		checkSnapshotBytes(t, e.servers[0].rcv.Received()[0], ts)
		var ws []wire
		for _, c := range e.f.Collectives(0) {
			if c.Op == "Broadcast" {
				ws = append(ws, wire{c.Count, c.DType})
			}
		}
		return lines, ws
	}
	for _, gen := range []double.Generation{double.GenC, double.GenD, double.GenE} {
		for _, wt := range []pipelines.WeightTransfer{{}, {Packed: true, BufferBytes: 4096, NumBuffers: 3}, {Packed: true}} {
			t.Run(fmt.Sprintf("%s/packed=%v/T=%d", gen, wt.Packed, wt.BufferBytes), func(t *testing.T) {
				ckLines, ckWire := run(t, gen, wt, false)
				snLines, snWire := run(t, gen, wt, true)
				if !slices.Equal(ckLines, snLines) {
					t.Fatalf("requests differ:\ncheckpoint:\n%s\nsnapshot:\n%s", strings.Join(ckLines, "\n"), strings.Join(snLines, "\n"))
				}
				if len(ckWire) == 0 || len(ckWire) != len(snWire) {
					t.Fatalf("%d broadcasts from the checkpoint, %d from the snapshot", len(ckWire), len(snWire))
				}
				for i := range ckWire {
					if ckWire[i].count != snWire[i].count || ckWire[i].dtype != snWire[i].dtype {
						t.Fatalf("broadcast %d: checkpoint %d x %v, snapshot %d x %v", i, ckWire[i].count, ckWire[i].dtype, snWire[i].count, snWire[i].dtype)
					}
				}
			})
		}
	}
}

// One mapping per trainer: reused while the owner and handle stay, closed
// and opened again for a restarted trainer (a new owner) or a new buffer (a
// new handle), closed by CloseSnapshot and by Close.
func TestSnapshotMappingLifetime(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, wt: pipelines.WeightTransfer{Packed: true}}).withIPC()
	dir := t.TempDir()
	first, grown := filepath.Join(dir, "a.shm"), filepath.Join(dir, "b.shm")
	steps := []struct {
		path, owner string
		opened      bool
	}{
		{first, "pid-1/gen-1", true},
		{first, "pid-1/gen-1", false},
		{first, "pid-2/gen-2", true},  // the trainer was restarted
		{grown, "pid-2/gen-2", true},  // its layout grew: a new buffer
		{grown, "pid-2/gen-2", false}, // and that one is reused
	}
	for i, st := range steps {
		ts := snapTensors(i + 1)
		out, err := e.publishUpdate(publish(t, st.path, fmt.Sprintf("v%d", i+1), st.owner, 64, ts), i+1, nil)
		if err != nil {
			t.Fatalf("step %d: %v", i+1, err)
		}
		if out.Opened != st.opened {
			t.Fatalf("step %d (%s, %s): opened %v, want %v", i+1, filepath.Base(st.path), st.owner, out.Opened, st.opened)
		}
		if n := ipcMappings(e.f); n != 1 {
			t.Fatalf("step %d: %d mappings open, want 1 (the old one closed)", i+1, n)
		}
		checkSnapshotBytes(t, e.servers[0].rcv.Received()[i], ts)
	}
	// Another run's trainer gets its own mapping, beside the first run's.
	out, err := e.publishUpdate(publish(t, filepath.Join(dir, "other.shm"), "w1", "pid-9/gen-1", 0, snapTensors(9)), 9, func(req *transfer.UpdateRequest) { req.RunID = "run-2" })
	if err != nil || !out.Opened {
		t.Fatalf("run 2: %+v, %v", out, err)
	}
	if n := ipcMappings(e.f); n != 2 {
		t.Fatalf("%d mappings open for two runs, want 2", n)
	}
	if err := e.tr.CloseSnapshot("run-1"); err != nil {
		t.Fatal(err)
	}
	if err := e.tr.CloseSnapshot("run-1"); err != nil {
		t.Fatalf("a second close: %v", err)
	}
	if n := ipcMappings(e.f); n != 1 {
		t.Fatalf("%d mappings open after closing run 1's, want 1", n)
	}
	// run-2's mapping is closed by Close (newEnv's cleanup checks the fake
	// has nothing left).
}

// The refusals of an update from a snapshot: each is BadInput, said before
// any server is called or anything is mapped, and worded as in
// testdata/snapshot_refusals.golden (go test -run TestSnapshotRefusals
// -update rewrites it).
func TestSnapshotRefusals(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "snapshot.shm")
	good := func() *trainer.Snapshot { return publish(t, path, "v1", "pid-1/gen-1", 0, snapTensors(1)) }
	zeroDim := append([]snapTensor{{"extra.scalar", safetensors.I64, []int64{}, make([]byte, 8)}}, snapTensors(1)...)
	cases := []struct {
		name   string
		packed bool
		noIPC  bool
		snap   func() *trainer.Snapshot
		mod    func(*transfer.UpdateRequest)
	}{
		{name: "no IPC importer", noIPC: true, snap: good},
		{name: "cuda handle on the fake", snap: func() *trainer.Snapshot {
			s := good()
			s.IPC, s.Path, s.Handle = trainer.IPCCUDA, "", append([]byte{2, 'c'}, make([]byte, 64)...)
			return s
		}},
		{name: "expandable segment handle", snap: func() *trainer.Snapshot {
			s := good()
			s.IPC, s.Path, s.Handle = trainer.IPCCUDA, "", []byte{2, 'e', 1, 2, 3}
			return s
		}},
		{name: "unknown ipc", snap: func() *trainer.Snapshot { s := good(); s.IPC = "rdma"; return s }},
		{name: "relative fake_shm path", snap: func() *trainer.Snapshot { s := good(); s.Path = "snapshot.shm"; return s }},
		{name: "non-contiguous packed chunk", packed: true, snap: func() *trainer.Snapshot {
			// Two float32 tensors 4 bytes apart: aligned in the chunk, but
			// not one range of the snapshot.
			s := good()
			s.Tensors = []trainer.Tensor{
				{Name: bigram.TensorName, DType: "float32", Shape: []int64{bigram.Vocab, bigram.Vocab}, Offset: 0, Bytes: 4 * bigram.Vocab * bigram.Vocab},
				{Name: "extra.f32", DType: "float32", Shape: []int64{2}, Offset: 4*bigram.Vocab*bigram.Vocab + 8, Bytes: 8},
			}
			s.StorageBytes = 4*bigram.Vocab*bigram.Vocab + 16
			return s
		}},
		{name: "tensor past the storage", snap: func() *trainer.Snapshot { s := good(); s.Tensors[6].Offset = s.StorageBytes - 8; return s }},
		{name: "negative offset", snap: func() *trainer.Snapshot { s := good(); s.Tensors[0].Offset = -8; return s }},
		{name: "bytes not the shape's", snap: func() *trainer.Snapshot { s := good(); s.Tensors[2].Shape = []int64{1024}; return s }},
		{name: "0-dim tensor packed", packed: true, snap: func() *trainer.Snapshot { return publish(t, path, "v1", "pid-1/gen-1", 0, zeroDim) }},
		{name: "float32 with dtype bfloat16", snap: good, mod: func(req *transfer.UpdateRequest) { req.DType = "bfloat16" }},
		{name: "unknown dtype", snap: good, mod: func(req *transfer.UpdateRequest) { req.DType = "fp8" }},
		{name: "another device", snap: func() *trainer.Snapshot { s := good(); s.Device = 3; return s }},
		{name: "no tensors", snap: func() *trainer.Snapshot { s := good(); s.Tensors = nil; return s }},
		{name: "checkpoint and snapshot", snap: good, mod: func(req *transfer.UpdateRequest) { req.Checkpoint = "/ckpt/model.safetensors" }},
	}
	var got strings.Builder
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			wt := pipelines.WeightTransfer{Packed: c.packed}
			e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, wt: wt})
			if !c.noIPC {
				e.withIPC()
			}
			_, err := e.publishUpdate(c.snap(), 1, c.mod)
			if kindOf(err) != transfer.BadInput {
				t.Fatalf("got %v, want BadInput", err)
			}
			e.assertNothingSent(t)
			if n := ipcMappings(e.f); n != 0 {
				t.Errorf("%d mappings left open", n)
			}
			fmt.Fprintf(&got, "%s: %s\n", c.name, err)
		})
	}
	golden := filepath.Join("testdata", "snapshot_refusals.golden")
	if *updateGolden {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(golden, []byte(got.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if got.String() != string(want) {
		t.Errorf("refusals differ from %s\n--- got\n%s--- want\n%s", golden, got.String(), want)
	}
}

// A server failing mid-update and NCCL failing mid-broadcast end a
// snapshot update as they end a checkpoint's: fast, every session closed
// with the version labelled failed, the communicator aborted and replaced
// by the next attempt. The mapping stays (the trainer owns the memory):
// the next attempt reuses it.
func TestSnapshotUpdateFailures(t *testing.T) {
	t.Run("update_weights 500", func(t *testing.T) {
		e := newEnv(t, envConfig{gen: double.GenC, worldSizes: []int{1, 1}, wt: pipelines.WeightTransfer{Packed: true, BufferBytes: 4096},
			faults: []double.Faults{{}, {ErrorRate: map[string]float64{"/update_weights": 1}}}}).withIPC()
		path := filepath.Join(t.TempDir(), "snapshot.shm")
		start := time.Now()
		_, err := e.publishUpdate(publish(t, path, "run-1/iter-1", "pid-1/gen-1", 0, snapTensors(1)), 1, nil)
		if err == nil || kindOf(err) != transfer.ServerFailed {
			t.Fatalf("got %v, want ServerFailed", err)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Fatalf("took %v: the communicator should be aborted at once", took)
		}
		for _, want := range []string{e.servers[1].url, "POST /update_weights: HTTP 500", "communicator was aborted", "update sessions closed"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error does not say %q: %v", want, err)
			}
		}
		for i, s := range e.servers {
			if e.requests(i, "POST /finish_weight_update") != 1 || s.WeightVersion() != "run-1/iter-1-failed" {
				t.Errorf("server %d: session not closed after the failure (version %q)", i, s.WeightVersion())
			}
		}
		if n := ipcMappings(e.f); n != 1 {
			t.Fatalf("%d mappings open after the failure, want the one kept", n)
		}
	})
	t.Run("NCCL fails mid-broadcast", func(t *testing.T) {
		e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, wt: pipelines.WeightTransfer{}}).withIPC()
		path := filepath.Join(t.TempDir(), "snapshot.shm")
		if _, err := e.publishUpdate(publish(t, path, "run-1/iter-1", "pid-1/gen-1", 0, snapTensors(1)), 1, nil); err != nil {
			t.Fatal(err)
		}
		next := len(e.f.Collectives(0))
		var once sync.Once
		e.f.OnCollective(func(c nccltest.Call) nccltest.Fault {
			fault := nccltest.Fault{}
			if c.Rank == 0 && c.Op == "Broadcast" && c.Index >= next+2 {
				once.Do(func() { fault = nccltest.Fault{Err: nccl.RemoteError, Delay: 5 * time.Millisecond} })
			}
			return fault
		})
		_, err := e.publishUpdate(publish(t, path, "run-1/iter-2", "pid-1/gen-1", 0, snapTensors(2)), 2, nil)
		if kindOf(err) != transfer.NCCLFailed || !strings.Contains(err.Error(), "injected by the fake") || !regexp.MustCompile(`snapshot broadcast \d of 7 \(\d+ bytes, tensor "`).MatchString(err.Error()) {
			t.Fatalf("got %v, want NCCLFailed naming the broadcast and NCCL's reason", err)
		}
		if v := e.servers[0].WeightVersion(); v != "run-1/iter-2-failed" {
			t.Fatalf("weight version %q after the failure", v)
		}
		e.f.OnCollective(nil)
		ts := snapTensors(3)
		out, err := e.publishUpdate(publish(t, path, "run-1/iter-3", "pid-1/gen-1", 0, ts), 3, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !out.Initialized || out.Opened {
			t.Fatalf("after the failure: %+v, want a new group on the same mapping", out)
		}
		got := e.servers[0].rcv.Received()
		checkSnapshotBytes(t, got[len(got)-1], ts)
	})
}

// The trainer's snapshot kinds are nccl's import kinds (two copies of the
// strings, so that the control worker, which imports trainer, needs no
// cgo).
func TestSnapshotKindsAreNCCLKinds(t *testing.T) {
	if trainer.IPCCUDA != nccl.IPCCUDA || trainer.IPCFakeShm != nccl.IPCFakeShm {
		t.Fatalf("trainer's kinds %q, %q differ from nccl's %q, %q", trainer.IPCCUDA, trainer.IPCFakeShm, nccl.IPCCUDA, nccl.IPCFakeShm)
	}
}
