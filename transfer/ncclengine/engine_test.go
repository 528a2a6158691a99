package ncclengine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/gpuhealth/gpuhealthtest"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"github.com/rlflow/rlflow/vllm/double/fakeplane"
)

// server is one vLLM double with its receiver.
type server struct {
	*double.Server
	url string
	rcv *fakeplane.Receiver
	rec *testutil.Recorder // every request, when envConfig.record
}

type env struct {
	t       *testing.T
	f       *nccltest.Fake
	tr      *Engine
	servers []*server
	target  transfer.Target
	// progress is the last request's.
	progress *transfer.Progress
}

type envConfig struct {
	gen        double.Generation
	worldSizes []int // per server (TP)
	wt         pipelines.WeightTransfer
	faults     []double.Faults // per server, optional
	monitor    gpuhealth.Monitor
	record     bool // keep every request each server gets
}

func newEnv(t *testing.T, cfg envConfig) *env {
	t.Helper()
	e := &env{t: t, f: nccltest.NewFake(nccltest.Config{Devices: 8, DeviceMemory: 64 << 20})}
	for i, ws := range cfg.worldSizes {
		r := &fakeplane.Receiver{F: e.f}
		dc := double.Config{Generation: cfg.gen, Backend: double.BackendNCCL, DevMode: true, WorldSize: ws,
			NCCLReceiver: r, RendezvousTimeout: 10 * time.Second, Seed: uint64(i + 1)}
		if i < len(cfg.faults) {
			dc.Faults = cfg.faults[i]
		}
		d, err := double.New(dc)
		if err != nil {
			t.Fatal(err)
		}
		var h http.Handler = d.Handler()
		var rec *testutil.Recorder
		if cfg.record {
			rec = &testutil.Recorder{}
			h = rec.Wrap(h)
		}
		hs := httptest.NewServer(h)
		t.Cleanup(func() {
			hs.Close()
			d.Close()
			r.CloseComms()
		})
		c, err := vllm.New(hs.URL, vllm.Options{Generation: vllm.Generation(cfg.gen)})
		if err != nil {
			t.Fatal(err)
		}
		e.servers = append(e.servers, &server{Server: d, url: hs.URL, rcv: r, rec: rec})
		e.target.Fleet = append(e.target.Fleet, c)
		e.target.Pins = append(e.target.Pins, vllm.Generation(cfg.gen))
	}
	e.target.Settings = cfg.wt
	e.target.Settings.Backend = pipelines.BackendNCCL
	e.target.RunID = "run-1"
	tr, err := New(Config{
		API: e.f, Device: 0, Advertise: "127.0.0.1", Monitor: cfg.monitor,
		Staging: staging.Options{DeviceMargin: 1 << 20},
		Comm:    []nccl.CommOption{nccl.WithPollInterval(20*time.Microsecond, time.Millisecond)},
	})
	if err != nil {
		t.Fatal(err)
	}
	e.tr = tr
	t.Cleanup(func() {
		tr.Close()
		for _, s := range e.servers {
			s.rcv.CloseComms()
		}
		if l := e.f.Leaks(); l != "" {
			t.Errorf("leaked %s", l)
		}
	})
	return e
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	e.t.Cleanup(cancel)
	return ctx
}

// init initialises the group as the init_transfer activity does, with
// the registry's default timeout.
func (e *env) init(ctx context.Context, mod func(*transfer.InitRequest)) (transfer.InitResult, error) {
	e.progress = &transfer.Progress{}
	req := transfer.InitRequest{Target: e.target, Timeout: vllm.DefaultInitTimeout, Progress: e.progress}
	if mod != nil {
		mod(&req)
	}
	return e.tr.Init(ctx, req)
}

// broadcast sends ckpt as the broadcast activity of iteration iter does,
// with its defaults (version run-1/iter-<n>, dtype keep).
func (e *env) broadcast(ctx context.Context, ckpt string, iter int, mod func(*transfer.UpdateRequest)) (transfer.UpdateResult, error) {
	e.progress = &transfer.Progress{}
	req := transfer.UpdateRequest{Target: e.target, Checkpoint: ckpt, DType: "keep", Version: fmt.Sprintf("run-1/iter-%d", iter),
		InitTimeout: vllm.DefaultInitTimeout, Progress: e.progress}
	if mod != nil {
		mod(&req)
	}
	return e.tr.Update(ctx, req)
}

// kindOf is the transfer.Kind of an engine's error, 0 for another error.
func kindOf(err error) transfer.Kind {
	var te *transfer.Error
	if errors.As(err, &te) {
		return te.Kind
	}
	return 0
}

func (e *env) requests(i int, route string) int { return e.servers[i].Stats().Requests[route] }

// writeCheckpoint writes the bigram weight plus tensors of awkward sizes
// and dtypes; seed makes each iteration's bytes different.
func writeCheckpoint(t *testing.T, dir string, seed int) string {
	t.Helper()
	logits := make([]byte, 4*bigram.Vocab*bigram.Vocab)
	for i := 0; i < bigram.Vocab*bigram.Vocab; i++ {
		binary.LittleEndian.PutUint32(logits[4*i:], math.Float32bits(float32(math.Sin(float64(i*seed+1)))*2))
	}
	fill := func(n int, k int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i*7 + k*31 + seed*13)
		}
		return b
	}
	f32 := make([]byte, 4*1023)
	for i := 0; i < 1023; i++ {
		binary.LittleEndian.PutUint32(f32[4*i:], math.Float32bits(float32(i*seed)*0.01-3))
	}
	path := filepath.Join(dir, fmt.Sprintf("ckpt-%d.safetensors", seed))
	err := safetensors.Write(path, []safetensors.WriteTensor{
		// Largest item size first, so that every tensor starts at an offset
		// its item size divides in any packed chunk, and no 0-dim tensor:
		// what vLLM's packed unpacking can view (plan.CheckPackedReceivable).
		{Name: "extra.scalar", DType: safetensors.I64, Shape: []int64{1}, Data: fill(8, 2)},
		{Name: bigram.TensorName, DType: safetensors.F32, Shape: []int64{bigram.Vocab, bigram.Vocab}, Data: logits},
		{Name: "extra.f32", DType: safetensors.F32, Shape: []int64{1023}, Data: f32},
		{Name: "extra.3x5x7", DType: safetensors.BF16, Shape: []int64{3, 5, 7}, Data: fill(2*105, 1)},
		{Name: "extra.empty", DType: safetensors.BF16, Shape: []int64{0, 4}, Data: nil},
		{Name: "extra.4097", DType: safetensors.BF16, Shape: []int64{4097}, Data: fill(2*4097, 4)},
		{Name: "extra.mask", DType: safetensors.U8, Shape: []int64{17}, Data: fill(17, 3)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// checkBytes compares what a receiver got with the checkpoint, tensor by
// tensor (F32 tensors converted with wire when it is not nil).
func checkBytes(t *testing.T, path string, got map[string][]byte, toBF16 bool) {
	t.Helper()
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if len(got) != len(ck.Tensors()) {
		t.Fatalf("received %d tensors, the checkpoint has %d", len(got), len(ck.Tensors()))
	}
	for _, ti := range ck.Tensors() {
		want, err := ck.Bytes(ti)
		if err != nil {
			t.Fatal(err)
		}
		if toBF16 && ti.DType == safetensors.F32 {
			conv := make([]byte, len(want)/2)
			if err := safetensors.ConvertF32ToBF16(conv, want); err != nil {
				t.Fatal(err)
			}
			want = conv
		}
		if !bytes.Equal(got[ti.Name], want) {
			t.Fatalf("tensor %s: received %d bytes that differ from the checkpoint's %d", ti.Name, len(got[ti.Name]), len(want))
		}
	}
}

// ---- tests ----

func TestInitThenBroadcastTwice(t *testing.T) {
	for _, gen := range []double.Generation{double.GenB, double.GenC, double.GenD, double.GenE} {
		for _, sizes := range [][]int{{1}, {1, 2}} {
			for _, packed := range []bool{true, false} {
				name := fmt.Sprintf("%s/servers=%v/packed=%v", gen, sizes, packed)
				t.Run(name, func(t *testing.T) {
					wt := pipelines.WeightTransfer{Packed: packed}
					if packed {
						wt.BufferBytes = 4096 // several chunks, tensors crossing T
					}
					e := newEnv(t, envConfig{gen: gen, worldSizes: sizes, wt: wt})
					ctx := e.ctx()
					out, err := e.init(ctx, nil)
					if err != nil {
						t.Fatal(err)
					}
					world := 1
					for _, s := range sizes {
						world += s
					}
					if out.WorldSize != world || !strings.HasSuffix(out.Group, "#1") || !strings.HasPrefix(out.Group, "run-1@") {
						t.Fatalf("init output %+v", out)
					}
					// Cumulative rank offsets: the second server's TP ranks follow the first's.
					offset := 1
					for i, s := range e.servers {
						in := s.rcv.Inits()
						if len(in) != 1 || in[0].WorldSize != world || in[0].Ranks[0] != offset || len(in[0].Ranks) != sizes[i] {
							t.Fatalf("server %d init %+v, want ranks from %d, world %d", i, in, offset, world)
						}
						if (gen == double.GenD || gen == double.GenE) && in[0].Packed != packed {
							t.Fatalf("generation %s: init_info packed %v, want %v", gen, in[0].Packed, packed)
						}
						// E gets the unique id in init_info (no TCPStore, no
						// pickle); the others read the legacy pickle.
						wantModule := ncclid.ModulePath
						if gen == double.GenE {
							wantModule = ""
						}
						if got := s.PickleModule(); got != wantModule {
							t.Fatalf("server %d: pickle module %q, want %q", i, got, wantModule)
						}
						wantMethod := MethodTCPStore
						if gen == double.GenE {
							wantMethod = MethodUniqueID
						}
						if out.Methods[i] != wantMethod {
							t.Fatalf("init methods %v, want %s for server %d", out.Methods, wantMethod, i)
						}
						offset += sizes[i]
					}
					dir := t.TempDir()
					for iter := 1; iter <= 2; iter++ {
						path := writeCheckpoint(t, dir, iter)
						bo, err := e.broadcast(ctx, path, iter, nil)
						if err != nil {
							t.Fatalf("broadcast %d: %v", iter, err)
						}
						if bo.Initialized || bo.Tensors != 7 || bo.Group != out.Group {
							t.Fatalf("broadcast %d output %+v", iter, bo)
						}
						version := fmt.Sprintf("run-1/iter-%d", iter)
						for i, s := range e.servers {
							got := s.rcv.Received()
							if len(got) != iter {
								t.Fatalf("server %d received %d updates after %d broadcasts", i, len(got), iter)
							}
							checkBytes(t, path, got[iter-1], false)
							if gen != double.GenB && s.WeightVersion() != version {
								t.Fatalf("server %d weight version %q, want %q", i, s.WeightVersion(), version)
							}
						}
					}
					// One rendezvous for the init and both broadcasts.
					for i := range e.servers {
						if n := e.requests(i, "POST /init_weight_transfer_engine"); n != 1 {
							t.Fatalf("server %d saw %d inits, want 1", i, n)
						}
					}
					if last := e.progress.Report(); last.Phase != "broadcast" || last.BytesTotal == 0 || last.BytesSent != last.BytesTotal || last.Group != out.Group {
						t.Fatalf("the last broadcast's progress %+v", last)
					}
				})
			}
		}
	}
}

func TestBroadcastInitialisesOnFirstUse(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, wt: pipelines.WeightTransfer{Packed: true}})
	path := writeCheckpoint(t, t.TempDir(), 1)
	out, err := e.broadcast(e.ctx(), path, 1, func(req *transfer.UpdateRequest) { req.Version = "v1" })
	if err != nil {
		t.Fatal(err)
	}
	if !out.Initialized || e.servers[0].WeightVersion() != "v1" || out.Bytes == 0 {
		t.Fatalf("%+v, server version %q", out, e.servers[0].WeightVersion())
	}
	checkBytes(t, path, e.servers[0].rcv.Received()[0], false)
}

func TestPoisonedGroupIsReinitialised(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenC, worldSizes: []int{1, 1}, wt: pipelines.WeightTransfer{Packed: true, BufferBytes: 4096}})
	ctx := e.ctx()
	dir := t.TempDir()
	if _, err := e.broadcast(ctx, writeCheckpoint(t, dir, 1), 1, nil); err != nil {
		t.Fatal(err)
	}
	// NCCL fails asynchronously in the middle of the next transfer, as when
	// a socket closes.
	var once sync.Once
	next := len(e.f.Collectives(0)) // the index of the next broadcast's first chunk
	e.f.OnCollective(func(c nccltest.Call) nccltest.Fault {
		fault := nccltest.Fault{}
		if c.Rank == 0 && c.Op == "Broadcast" && c.Index >= next+1 {
			once.Do(func() { fault = nccltest.Fault{Err: nccl.RemoteError, Delay: 5 * time.Millisecond} })
		}
		return fault
	})
	start := time.Now()
	_, err := e.broadcast(ctx, writeCheckpoint(t, dir, 2), 2, nil)
	if kindOf(err) != transfer.NCCLFailed || !strings.Contains(err.Error(), "injected by the fake") {
		t.Fatalf("broadcast with an NCCL failure: %v, want NCCLFailed with NCCL's own reason", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("failure took %v", d)
	}
	t.Logf("error: %v", err)
	e.f.OnCollective(nil)
	path := writeCheckpoint(t, dir, 3)
	out, err := e.broadcast(ctx, path, 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !out.Initialized {
		t.Fatal("the broadcast after an NCCL failure reused the poisoned group")
	}
	for i, s := range e.servers {
		got := s.rcv.Received()
		checkBytes(t, path, got[len(got)-1], false)
		if n := e.requests(i, "POST /init_weight_transfer_engine"); n != 2 {
			t.Fatalf("server %d: %d inits, want 2", i, n)
		}
		// The failed attempt closed its sessions: the next start succeeded.
		if s.WeightVersion() != "run-1/iter-3" {
			t.Fatalf("server %d version %q", i, s.WeightVersion())
		}
	}
}

func TestUpdateWeights500AbortsAtOnce(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenC, worldSizes: []int{1, 1}, wt: pipelines.WeightTransfer{Packed: true, BufferBytes: 4096},
		faults: []double.Faults{{}, {ErrorRate: map[string]float64{"/update_weights": 1}}}})
	ctx := e.ctx()
	if _, err := e.init(ctx, nil); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := e.broadcast(ctx, writeCheckpoint(t, t.TempDir(), 1), 1, nil)
	took := time.Since(start)
	if err == nil {
		t.Fatal("broadcast succeeded although update_weights answered 500")
	}
	t.Logf("error after %v: %v", took, err)
	if took > 5*time.Second {
		t.Fatalf("took %v: the communicator should be aborted at once", took)
	}
	msg := err.Error()
	for _, want := range []string{e.servers[1].url, "POST /update_weights: HTTP 500", "injected fault", "communicator was aborted", "update sessions closed"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error does not say %q: %s", want, msg)
		}
	}
	if kindOf(err) != transfer.ServerFailed {
		t.Errorf("want ServerFailed: %v", err)
	}
	aborted := false
	for _, c := range e.f.Calls() {
		aborted = aborted || (c.Op == "CommAbort" && c.Rank == 0)
	}
	if !aborted {
		t.Error("rank 0's communicator was not aborted")
	}
	// Neither server is left mid-update, and neither claims the new
	// version.
	for i, s := range e.servers {
		if e.requests(i, "POST /finish_weight_update") != 1 || s.WeightVersion() != "run-1/iter-1-failed" {
			t.Errorf("server %d: session not closed after the failure (version %q)", i, s.WeightVersion())
		}
	}
}

func TestCancelMidBroadcast(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, wt: pipelines.WeightTransfer{Packed: true, BufferBytes: 4096}})
	ctx := e.ctx()
	dir := t.TempDir()
	stalled := make(chan struct{})
	var once sync.Once
	e.f.OnCollective(func(c nccltest.Call) nccltest.Fault {
		if c.Rank == 0 && c.Op == "Broadcast" && c.Index == 2 { // the second chunk
			once.Do(func() { close(stalled) })
			return nccltest.Fault{Stall: true}
		}
		return nccltest.Fault{}
	})
	bctx, cancel := context.WithCancel(ctx)
	go func() {
		<-stalled
		cancel()
	}()
	start := time.Now()
	_, err := e.broadcast(bctx, writeCheckpoint(t, dir, 1), 1, nil)
	took := time.Since(start) // includes the init
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want the cancellation", err)
	}
	if took > 5*time.Second {
		t.Fatalf("returned %v after the start", took)
	}
	e.f.OnCollective(nil)
	path := writeCheckpoint(t, dir, 2)
	out, err := e.broadcast(ctx, path, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !out.Initialized {
		t.Fatal("the group aborted by the cancellation was reused")
	}
	got := e.servers[0].rcv.Received()
	checkBytes(t, path, got[len(got)-1], false)
}

func TestConversionAndALoadFailureAfterTheBytes(t *testing.T) {
	// dtype bfloat16 narrows every F32 tensor, the bigram weight included,
	// which the double's model then refuses to load: the bytes all arrived,
	// the update fails with the server's reason.
	e := newEnv(t, envConfig{gen: double.GenC, worldSizes: []int{1}, wt: pipelines.WeightTransfer{}})
	ctx := e.ctx()
	path := writeCheckpoint(t, t.TempDir(), 1)
	_, err := e.broadcast(ctx, path, 1, func(req *transfer.UpdateRequest) { req.DType = "bfloat16" })
	if kindOf(err) != transfer.ServerFailed {
		t.Fatalf("got %v, want ServerFailed", err)
	}
	if !strings.Contains(err.Error(), "want F32") || !strings.Contains(err.Error(), e.servers[0].url) {
		t.Fatalf("error does not carry the server's reason: %v", err)
	}
	got := e.servers[0].rcv.Received()
	if len(got) != 1 {
		t.Fatalf("%d updates received", len(got))
	}
	checkBytes(t, path, got[0], true)
	if e.requests(0, "POST /finish_weight_update") != 1 {
		t.Error("session not closed after the failed load")
	}
	if _, err := e.broadcast(ctx, path, 2, nil); err != nil {
		t.Fatalf("the next broadcast: %v", err)
	}
}

func TestBadInputs(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}})
	ctx := e.ctx()
	dir := t.TempDir()
	good := writeCheckpoint(t, dir, 1)
	cases := map[string]struct {
		mod  func(*transfer.UpdateRequest)
		want string
	}{
		"missing checkpoint":  {func(req *transfer.UpdateRequest) { req.Checkpoint = filepath.Join(dir, "nope") }, "no such file"},
		"relative checkpoint": {func(req *transfer.UpdateRequest) { req.Checkpoint = filepath.Base(good) }, "not an absolute path"},
		"dtype":               {func(req *transfer.UpdateRequest) { req.DType = "float8" }, "dtype \"float8\""},
		"no init timeout":     {func(req *transfer.UpdateRequest) { req.InitTimeout = 0 }, "init timeout"},
	}
	for name, tc := range cases {
		_, err := e.broadcast(ctx, good, 1, tc.mod)
		if kindOf(err) != transfer.BadInput || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want BadInput saying %q", name, err, tc.want)
		}
	}

	noAddr, err := New(Config{API: e.f})
	if err != nil {
		t.Fatal(err)
	}
	_, err = noAddr.Update(ctx, transfer.UpdateRequest{Target: e.target, Checkpoint: good, Version: "v", InitTimeout: time.Second})
	if kindOf(err) != transfer.BadInput || !strings.Contains(err.Error(), "--advertise") {
		t.Fatalf("no master address: %v", err)
	}
	_, err = noAddr.Init(ctx, transfer.InitRequest{Target: e.target, Timeout: time.Second})
	if kindOf(err) != transfer.BadInput {
		t.Fatalf("init without a master address: %v", err)
	}
}

func TestHealthInHeartbeatsAndMemoryCheck(t *testing.T) {
	mon := gpuhealthtest.NewMonitor(gpuhealth.DeviceInfo{Index: 0, Name: "Fake H200", MemoryTotal: 64 << 30, MemoryFree: 60 << 30})
	one := uint64(1)
	mon.SetHealth(gpuhealth.Health{Device: 0, ECCUncorrected: &one, XIDs: []uint64{79}})
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, monitor: mon})
	ctx := e.ctx()
	path := writeCheckpoint(t, t.TempDir(), 1)
	if _, err := e.broadcast(ctx, path, 1, nil); err != nil {
		t.Fatal(err)
	}
	h, ok := e.progress.Report().Health.(*gpuhealth.Health)
	if !ok || !strings.Contains(strings.Join(h.Problems, ";"), "XID errors 79") {
		t.Fatalf("the progress report's health %#v does not carry the device's XID", e.progress.Report().Health)
	}
	// Too little free memory for the buffers: refused before allocating,
	// naming the device.
	mon.SetHealth(gpuhealth.Health{Device: 0, Name: "Fake H200", MemoryTotal: 64 << 30, MemoryFree: 1 << 20})
	_, err := e.broadcast(ctx, path, 2, func(req *transfer.UpdateRequest) {
		req.Settings = pipelines.WeightTransfer{Backend: pipelines.BackendNCCL, Packed: true, BufferBytes: 1 << 30}
	})
	if err == nil || !strings.Contains(err.Error(), "Fake H200") || !strings.Contains(err.Error(), "free") {
		t.Fatalf("got %v, want the free-memory check", err)
	}
}

// A server left mid-update by a trainer that is gone (its session still
// open) does not make every later attempt fail on "already open": a fresh
// group closes the stale session and starts again.
func TestStaleSessionOfADeadTrainerIsClosed(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}, wt: pipelines.WeightTransfer{Packed: true}})
	ctx := e.ctx()
	if err := e.target.Fleet[0].StartWeightUpdate(ctx); err != nil { // the dead trainer's session
		t.Fatal(err)
	}
	path := writeCheckpoint(t, t.TempDir(), 1)
	out, err := e.broadcast(ctx, path, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !out.Initialized || e.servers[0].WeightVersion() != "run-1/iter-1" {
		t.Fatalf("%+v, server version %q", out, e.servers[0].WeightVersion())
	}
	if n := e.requests(0, "POST /start_weight_update"); n != 3 {
		t.Fatalf("%d starts, want 3 (the stale one, the refused one, the retry)", n)
	}
	checkBytes(t, path, e.servers[0].rcv.Received()[0], false)
	// On a group that was already in use, an open session is not ours to
	// close: the attempt fails.
	if err := e.target.Fleet[0].StartWeightUpdate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.broadcast(ctx, path, 2, nil); err == nil || !strings.Contains(err.Error(), "already open") {
		t.Fatalf("got %v, want the server's refusal", err)
	}
}

func TestInitDeadlineWhenAWorkerNeverJoins(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenC, worldSizes: []int{1, 1}})
	e.servers[1].rcv.Stall(true)
	start := time.Now()
	_, err := e.init(e.ctx(), func(req *transfer.InitRequest) { req.Timeout = 300 * time.Millisecond })
	took := time.Since(start)
	if k := kindOf(err); (k != transfer.NCCLFailed && k != transfer.ServerFailed) || !strings.Contains(err.Error(), "init did not complete within 300ms") {
		t.Fatalf("got %v, want a transport error naming the init deadline", err)
	}
	if took > 5*time.Second {
		t.Fatalf("init gave up after %v", took)
	}
	t.Logf("error after %v: %v", took, err)
	// The half-built group is not kept: the next broadcast initialises.
	e.servers[1].rcv.Stall(false)
	out, err := e.broadcast(e.ctx(), writeCheckpoint(t, t.TempDir(), 1), 1, nil)
	if err != nil || !out.Initialized {
		t.Fatalf("%+v %v", out, err)
	}
}

func TestAnotherRunOnTheSameServersRetiresTheGroup(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}})
	ctx := e.ctx()
	path := writeCheckpoint(t, t.TempDir(), 1)
	if _, err := e.init(ctx, nil); err != nil {
		t.Fatal(err)
	}
	// Run 2 takes the server over: vLLM keeps one communicator, so run 1's
	// group is dead and must not be used again.
	if _, err := e.broadcast(ctx, path, 1, func(req *transfer.UpdateRequest) { req.RunID = "run-2" }); err != nil {
		t.Fatal(err)
	}
	out, err := e.broadcast(ctx, path, 2, nil)
	if err != nil || !out.Initialized {
		t.Fatalf("run 1 after run 2 took its server: %+v %v", out, err)
	}
	if n := e.requests(0, "POST /init_weight_transfer_engine"); n != 3 {
		t.Fatalf("%d inits, want 3", n)
	}
}

// A GPU that cannot be selected (gone, hidden, broken) is DeviceLost on
// init and on a broadcast alike: no retry on this worker can mend it, so
// the step must move to another GPU worker (the activities turn it into
// GPUWorkerLost, which the interpreter routes).
func TestUnusableDeviceIsDeviceLost(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenD, worldSizes: []int{1}})
	lost, err := New(Config{API: e.f, Device: 42, Advertise: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer lost.Close()
	ctx := e.ctx()
	_, err = lost.Init(ctx, transfer.InitRequest{Target: e.target, Timeout: 5 * time.Second})
	if kindOf(err) != transfer.DeviceLost || !strings.Contains(err.Error(), "select device 42") {
		t.Errorf("init on a missing device: %v, want DeviceLost naming it", err)
	}
	path := writeCheckpoint(t, t.TempDir(), 1)
	_, err = lost.Update(ctx, transfer.UpdateRequest{Target: e.target, Checkpoint: path, Version: "v", InitTimeout: 5 * time.Second})
	if kindOf(err) != transfer.DeviceLost {
		t.Errorf("broadcast on a missing device: %v, want DeviceLost", err)
	}
}

// weight_transfer.rendezvous forces one way for every server: a TCPStore
// pickle for E names the vllm.backends module of E's layout, and unique_id
// is refused for a generation without nccl_unique_id_b64.
func TestRendezvousSetting(t *testing.T) {
	e := newEnv(t, envConfig{gen: double.GenE, worldSizes: []int{1, 2}, wt: pipelines.WeightTransfer{Rendezvous: pipelines.RendezvousTCPStore}})
	out, err := e.init(e.ctx(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range e.servers {
		if got := s.PickleModule(); got != ncclid.BackendsModulePath {
			t.Fatalf("server %d: pickle module %q, want %q", i, got, ncclid.BackendsModulePath)
		}
	}
	if want := []string{MethodTCPStore, MethodTCPStore}; !slices.Equal(out.Methods, want) {
		t.Fatalf("methods %v, want %v", out.Methods, want)
	}

	c := newEnv(t, envConfig{gen: double.GenC, worldSizes: []int{1}, wt: pipelines.WeightTransfer{Rendezvous: pipelines.RendezvousUniqueID}})
	_, err = c.init(c.ctx(), nil)
	if kindOf(err) != transfer.BadInput || !strings.Contains(err.Error(), "has no init_info.nccl_unique_id_b64") {
		t.Fatalf("unique_id on C: %v", err)
	}
	if n := c.requests(0, "POST /init_weight_transfer_engine"); n != 0 {
		t.Fatalf("%d init calls reached the server", n)
	}
}

// TestNCCLRequestSequences pins, per API generation and packing, the exact
// requests and bodies of an init and one broadcast: where the packed
// settings go (update_info on A-C, init_info on D and E), how the unique id
// travels (TCPStore on A-D, nccl_unique_id_b64 on E), sessions and
// versions (C-E), A's own route names.
func TestNCCLRequestSequences(t *testing.T) {
	const (
		worldSize = "GET /get_world_size?include_dp=true"
		start     = "POST /start_weight_update {}"
		finish    = `POST /finish_weight_update {"weight_version":"run-1/iter-1"}`
		tcpInit   = `{"init_info":{"master_address":"127.0.0.1","master_port":PORT,"rank_offset":1,"world_size":2`
		b64Init   = `{"init_info":{"rank_offset":1,"world_size":2`
		meta      = `"names":["bigram.logits","extra.one","extra.3x5x7"],"dtype_names":["float32","int64","bfloat16"],"shapes":[[128,128],[1],[3,5,7]]`
		packedD   = `,"packed":true,"packed_buffer_size_bytes":4096,"packed_num_buffers":2`
	)
	tests := []struct {
		gen    double.Generation
		packed bool
		want   []string
	}{
		{double.GenA, false, []string{worldSize, "POST /init_weight_transfer " + tcpInit + "}}",
			`POST /update_weights {"update_info":{` + meta + `}}`, "POST /finalize_weight_update {}"}},
		// A chooses its packed chunk size from its own GPU memory: the
		// trainer cannot lay out the same chunks, so packed is refused
		// before the init is sent.
		{double.GenA, true, []string{worldSize}},
		{double.GenB, false, []string{worldSize, "POST /init_weight_transfer_engine " + tcpInit + "}}",
			`POST /update_weights {"update_info":{` + meta + `}}`}},
		{double.GenB, true, []string{worldSize, "POST /init_weight_transfer_engine " + tcpInit + "}}",
			`POST /update_weights {"update_info":{` + meta + packedD + `}}`}},
		{double.GenC, true, []string{worldSize, "POST /init_weight_transfer_engine " + tcpInit + "}}",
			start, `POST /update_weights {"update_info":{` + meta + packedD + `}}`, finish}},
		{double.GenD, false, []string{worldSize, "POST /init_weight_transfer_engine " + tcpInit + "}}",
			start, `POST /update_weights {"update_info":{` + meta + `}}`, finish}},
		{double.GenD, true, []string{worldSize, "POST /init_weight_transfer_engine " + tcpInit + packedD + "}}",
			start, `POST /update_weights {"update_info":{` + meta + `}}`, finish}},
		{double.GenE, false, []string{worldSize, "POST /init_weight_transfer_engine " + b64Init + `,"nccl_unique_id_b64":"ID"}}`,
			start, `POST /update_weights {"update_info":{` + meta + `}}`, finish}},
		{double.GenE, true, []string{worldSize, "POST /init_weight_transfer_engine " + b64Init + packedD + `,"nccl_unique_id_b64":"ID"}}`,
			start, `POST /update_weights {"update_info":{` + meta + `}}`, finish}},
	}
	port := regexp.MustCompile(`"master_port":\d+`)
	id := regexp.MustCompile(`"nccl_unique_id_b64":"[A-Za-z0-9+/=]+"`)
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s/packed=%v", tc.gen, tc.packed), func(t *testing.T) {
			wt := pipelines.WeightTransfer{Packed: tc.packed}
			if tc.packed {
				wt.BufferBytes, wt.NumBuffers = 4096, 2
			}
			e := newEnv(t, envConfig{gen: tc.gen, worldSizes: []int{1}, wt: wt, record: true})
			ctx := e.ctx()
			_, err := e.init(ctx, nil)
			if tc.gen == double.GenA && tc.packed {
				if kindOf(err) != transfer.BadInput || !strings.Contains(err.Error(), "speaks API generation A, which chooses its packed chunk size") {
					t.Fatalf("packed on A: %v", err)
				}
				if got := e.servers[0].rec.Lines(); !slices.Equal(got, tc.want) {
					t.Fatalf("requests %q, want %q", got, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			ckpt := filepath.Join(t.TempDir(), "small.safetensors")
			if err := safetensors.Write(ckpt, []safetensors.WriteTensor{
				{Name: bigram.TensorName, DType: safetensors.F32, Shape: []int64{bigram.Vocab, bigram.Vocab}, Data: make([]byte, 4*bigram.Vocab*bigram.Vocab)},
				{Name: "extra.one", DType: safetensors.I64, Shape: []int64{1}, Data: make([]byte, 8)},
				{Name: "extra.3x5x7", DType: safetensors.BF16, Shape: []int64{3, 5, 7}, Data: make([]byte, 210)},
			}, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := e.broadcast(ctx, ckpt, 1, nil); err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, l := range e.servers[0].rec.Lines() {
				got = append(got, id.ReplaceAllString(port.ReplaceAllString(l, `"master_port":PORT`), `"nccl_unique_id_b64":"ID"`))
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("requests:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}
