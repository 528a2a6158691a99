package ncclengine

// The GPU test of the engine: real NCCL and CUDA through nccl.Load, rank 0 in
// this process, and every vLLM server played by tests/gpu/receiver.py
// --http (a vLLM-like HTTP front doing a worker's real TCPStore
// rendezvous, NCCL init, warm-up and broadcasts), placed by gputest.Place:
// with one GPU (or RLFLOW_GPU_PLACEMENT=single) all on one GPU with a
// distinct NCCL_HOSTID per process; with at least as many GPUs as ranks
// server i (rank i) on GPU i, no NCCL_HOSTID, NCCL_NVLS_ENABLE=0. It
// skips, naming what is missing,
// where NCCL or the CUDA runtime cannot be loaded or no GPU is visible.
// nccl/GPU.md has the command.
//
// Environment: RLFLOW_GPU_DIR (checkpoints, default $TMPDIR/rlflow-gpu),
// RLFLOW_GPU_LOGS (process logs, default ./gpu-logs), RLFLOW_GPU_SCRIPTS
// (directory of receiver.py), RLFLOW_PYTHON (default python3),
// RLFLOW_GPU_DEVICE (single placement's device, default 0),
// RLFLOW_GPU_PLACEMENT (single|spread), RECEIVER_NCCL_LIB (receiver's NCCL).
//
// TestGPUTransferToHTTPReceivers drives servers of API generation D (the
// TCPStore rendezvous and the pickled id); TestGPUTransferGenE the same
// cycle with generation E servers (the unique id in
// init_info.nccl_unique_id_b64), mixed D + E groups, and E servers forced
// onto the TCPStore, whose pickle then names the vllm.backends module.

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm"
)

// genCheckpoint writes (or reuses) a ~0.4 GiB decoder-shaped checkpoint
// with awkward tensors; seed makes the bytes of each iteration differ.
func genCheckpoint(t *testing.T, seed int) string {
	t.Helper()
	dir := os.Getenv("RLFLOW_GPU_DIR")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "rlflow-gpu")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, fmt.Sprintf("transfer-%d.safetensors", seed))
	const sig = "gpu-transfer-v1"
	if f, err := safetensors.Open(path); err == nil {
		ok := f.Metadata()["rlflow_gen"] == sig
		f.Close()
		if ok {
			return path
		}
	}
	var wt []safetensors.WriteTensor
	for i, s := range gputest.DecoderSpecs(1024, 2816, 32000, 12) {
		data := make([]byte, s.Bytes())
		gputest.XorshiftFill(data, uint64(seed), i)
		wt = append(wt, safetensors.WriteTensor{Name: s.Name, DType: s.DType, Shape: s.Shape, Data: data})
	}
	if err := safetensors.Write(path, wt, map[string]string{"rlflow_gen": sig}); err != nil {
		t.Fatal(err)
	}
	return path
}

// digests is what a receiver must report for path: SHA-256 per tensor.
func digests(t *testing.T, path string) map[string]string {
	t.Helper()
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := map[string]string{}
	for _, ti := range ck.Tensors() {
		b, err := ck.Bytes(ti)
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		out[ti.Name] = hex.EncodeToString(sum[:])
	}
	return out
}

// httpReceiver is one receiver.py --http process.
type httpReceiver struct {
	url  string
	cmd  *exec.Cmd
	done chan struct{}
}

// startReceiver starts server i (0-based) speaking generation D.
func startReceiver(ctx context.Context, t *testing.T, pl gputest.Placement, i int) *httpReceiver {
	t.Helper()
	return startReceiverAPI(ctx, t, pl, i, vllm.GenD)
}

// startReceiverAPI starts server i (0-based) speaking generation api (C, D
// or E: receiver.py --api). receiver.py --http serves one rank, so the
// fleet's cumulative rank offsets make server i rank i+1: it runs on
// pl.Device(i+1), with NCCL_HOSTID=rlflow-worker<i+1> in single placement.
func startReceiverAPI(ctx context.Context, t *testing.T, pl gputest.Placement, i int, api vllm.Generation) *httpReceiver {
	t.Helper()
	py := gputest.Python()
	port := testutil.FreePort(t)
	args := []string{gputest.Script(t, "receiver.py"), "--http", strconv.Itoa(port), "--api", string(api), "--device", strconv.Itoa(pl.Device(i + 1)), "--deadline", "600", "--update-deadline", "30"}
	cmd := exec.Command(py, args...)
	env := pl.ProcEnv(fmt.Sprintf("rlflow-worker%d", i+1))
	cmd.Env = append(append(os.Environ(), env...), "PYTHONUNBUFFERED=1")
	logPath := filepath.Join(gputest.LogDir(t, "gpu-logs"), strings.NewReplacer("/", "_").Replace(t.Name())+fmt.Sprintf(".server%d.log", i+1))
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(logf, "$ %s%s %s\n", strings.Join(append(env, ""), " "), py, strings.Join(args, " "))
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &httpReceiver{url: fmt.Sprintf("http://127.0.0.1:%d", port), cmd: cmd, done: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		once := sync.Once{}
		for sc.Scan() {
			fmt.Fprintln(logf, "stdout:", sc.Text())
			if strings.HasPrefix(sc.Text(), "READY") {
				once.Do(func() { close(ready) })
			}
		}
		cmd.Wait()
		logf.Close()
		close(r.done)
	}()
	t.Cleanup(func() {
		select {
		case <-r.done:
		default:
			cmd.Process.Signal(syscall.SIGKILL)
			<-r.done
		}
	})
	select {
	case <-ready:
	case <-r.done:
		t.Fatalf("receiver %d exited before READY (see %s)", i+1, logPath)
	case <-ctx.Done():
		t.Fatalf("receiver %d: no READY: %v (see %s)", i+1, ctx.Err(), logPath)
	}
	return r
}

func (r *httpReceiver) post(ctx context.Context, path string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.url+path, strings.NewReader("{}"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: HTTP %d", path, resp.StatusCode)
	}
	return nil
}

type receivedReport struct {
	Updates     int               `json:"updates"`
	SHA256      map[string]string `json:"sha256"`
	Stats       map[string]any    `json:"stats"`
	Version     string            `json:"version"`
	API         string            `json:"api"`
	SessionOpen bool              `json:"session_open"`
	Inits       []receiverInit    `json:"inits"`
	Events      []receiverEvent   `json:"events"`
}

// receiverEvent is one entry of receiver.py's ordered event log.
type receiverEvent struct {
	What string `json:"what"`
}

// receiverInit is one completed init_weight_transfer_engine as receiver.py
// reports it: how its worker got the NCCL unique id.
type receiverInit struct {
	// Rendezvous is "tcpstore" (the pickled id read from the trainer's
	// TCPStore) or "unique_id" (init_info.nccl_unique_id_b64).
	Rendezvous string `json:"rendezvous"`
	// PickleModule and PickleBytes describe the pickle the TCPStore held
	// ("" and 0 without one).
	PickleModule string `json:"pickle_module"`
	PickleBytes  int    `json:"pickle_bytes"`
	MasterPort   *int   `json:"master_port"` // nil without a TCPStore
	Rank         int    `json:"rank"`
	WorldSize    int    `json:"world_size"`
}

// happened reports whether the receiver logged an event named what.
func (rep receivedReport) happened(what string) bool {
	return slices.Contains(rep.Events, receiverEvent{What: what})
}

func (r *httpReceiver) received(ctx context.Context) (receivedReport, error) {
	var rep receivedReport
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.url+"/received", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return rep, err
	}
	defer resp.Body.Close()
	return rep, json.NewDecoder(resp.Body).Decode(&rep)
}

// checkReceived compares every receiver's last update with the checkpoint.
func checkReceived(ctx context.Context, t *testing.T, rs []*httpReceiver, want map[string]string, updates int, what string) {
	t.Helper()
	for i, r := range rs {
		rep, err := r.received(ctx)
		if err != nil {
			gputest.Verdict(t, false, "%s: server %d: %v", what, i+1, err)
			continue
		}
		bad := 0
		for name, sum := range want {
			if rep.SHA256[name] != sum {
				bad++
			}
		}
		ok := rep.Updates == updates && bad == 0 && len(rep.SHA256) == len(want)
		gputest.Verdict(t, ok, "%s: server %d: update %d, %d of %d tensors byte-exact (SHA-256), receiver stats %v",
			what, i+1, rep.Updates, len(want)-bad, len(want), rep.Stats)
	}
}

// transferCase is one group of receiver.py --http servers (one rank each)
// driven through the transfer activities by runTransferCase.
type transferCase struct {
	name string
	apis []vllm.Generation // per server, in rank order
	wt   pipelines.WeightTransfer
	// methods is the rendezvous the engine must report per server
	// (MethodTCPStore or MethodUniqueID), module the ncclUniqueId module
	// the TCPStore's pickle must name ("" when no server uses it).
	methods []string
	module  string
	spread  bool // only with spread placement (one GPU per rank)
}

// allD is n generation-D servers, all taking the pickled id from the
// TCPStore, whose pickle names the legacy module.
func allD(name string, n int, wt pipelines.WeightTransfer, spread bool) transferCase {
	return transferCase{name: name, apis: slices.Repeat([]vllm.Generation{vllm.GenD}, n), wt: wt,
		methods: slices.Repeat([]string{MethodTCPStore}, n), module: ncclid.ModulePath, spread: spread}
}

// TestGPUTransferToHTTPReceivers: the engine end to end on the GPU, through
// the transfer activities as the GPU worker runs them, against generation D
// servers (runTransferCase). W4 and W8 (3 and 7 one-rank servers, rank
// offsets 1..W-1) run only with spread placement.
func TestGPUTransferToHTTPReceivers(t *testing.T) {
	runTransferCases(t, []transferCase{
		allD("W2-packed-64MiB", 1, pipelines.WeightTransfer{Packed: true, BufferBytes: 64 << 20}, false),
		allD("W3-nonpacked", 2, pipelines.WeightTransfer{}, false),
		allD("W3-packed-default-1GiB", 2, pipelines.WeightTransfer{Packed: true}, false),
		// Multi-GPU hosts (issue 5). receiver.py --http is a one-rank
		// server, so these are 3 and 7 servers, not 2 servers of several
		// ranks each.
		allD("W4-3servers-packed-64MiB", 3, pipelines.WeightTransfer{Packed: true, BufferBytes: 64 << 20}, true),
		allD("W8-7servers-packed-default-1GiB", 7, pipelines.WeightTransfer{Packed: true}, true),
	})
}

// TestGPUTransferGenE: runTransferCase against generation E servers
// (receiver.py --api E). With weight_transfer.rendezvous auto the engine
// hands each E server the unique id in init_info.nccl_unique_id_b64 and
// the receiver builds its communicator from those bytes (no TCPStore, no
// pickle), while a D server in the same group still reads the pickled id,
// naming the legacy module, from the TCPStore. With rendezvous tcpstore
// every E server reads a pickle naming the vllm.backends module (256
// bytes), which E's layout loads. Each case also fails an update on its
// last server: an E server closes its session itself, and rlflow labels
// its weights with update_weight_version instead of finishing it.
func TestGPUTransferGenE(t *testing.T) {
	e, d := vllm.GenE, vllm.GenD
	uid, store := MethodUniqueID, MethodTCPStore
	packed64 := pipelines.WeightTransfer{Packed: true, BufferBytes: 64 << 20}
	tcpstore64 := packed64
	tcpstore64.Rendezvous = pipelines.RendezvousTCPStore
	runTransferCases(t, []transferCase{
		{name: "W2-E-packed-64MiB", apis: []vllm.Generation{e}, wt: packed64, methods: []string{uid}},
		{name: "W3-E-nonpacked", apis: []vllm.Generation{e, e}, wt: pipelines.WeightTransfer{}, methods: []string{uid, uid}},
		{name: "W3-DE-packed-64MiB", apis: []vllm.Generation{d, e}, wt: packed64, methods: []string{store, uid}, module: ncclid.ModulePath},
		{name: "W3-ED-nonpacked", apis: []vllm.Generation{e, d}, wt: pipelines.WeightTransfer{}, methods: []string{uid, store}, module: ncclid.ModulePath},
		{name: "W3-E-tcpstore-packed-64MiB", apis: []vllm.Generation{e, e}, wt: tcpstore64, methods: []string{store, store}, module: ncclid.BackendsModulePath},
	})
}

// runTransferCases runs each case as a subtest on the real library (or
// skips where it cannot be loaded), over two ~0.4 GiB checkpoints.
func runTransferCases(t *testing.T, cases []transferCase) {
	lib := gputest.Lib(t)
	ck1, ck2 := genCheckpoint(t, 1), genCheckpoint(t, 2)
	cks := transferCheckpoints{paths: [2]string{ck1, ck2}, want: [2]map[string]string{digests(t, ck1), digests(t, ck2)}}
	var mon gpuhealth.Monitor
	if m, err := gpuhealth.OpenNVML(""); err == nil {
		mon = m
		defer m.Close()
	} else {
		t.Logf("no NVML: %v", err)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { runTransferCase(t, lib, mon, tc, cks) })
	}
}

// transferCheckpoints are the two checkpoints each case broadcasts and the
// SHA-256 per tensor of each.
type transferCheckpoints struct {
	paths [2]string
	want  [2]map[string]string
}

// runTransferCase: init (the engine's reported rendezvous per server and
// what each receiver says it did), two broadcasts reusing the group (each
// byte-exact and verifying the servers' weight version), an update_weights
// that fails early on the last server (the communicator must be aborted,
// not hang, and that server's session must not be left open), and a
// broadcast that re-initialises the group the same way.
func runTransferCase(t *testing.T, lib *nccl.Library, mon gpuhealth.Monitor, tc transferCase, cks transferCheckpoints) {
	pl := gputest.Place(t, len(tc.apis)+1)
	if tc.spread && !pl.Spread() {
		t.Skipf("skipping: world size %d runs only with spread placement (one GPU per rank): %d GPUs visible, %s=%q",
			len(tc.apis)+1, pl.Devices, gputest.EnvPlacement, os.Getenv(gputest.EnvPlacement))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var rs []*httpReceiver
	wt := tc.wt
	wt.Backend = pipelines.BackendNCCL
	sc := pipelines.StepContext{RunID: "gpu-test", Iteration: 1, WeightTransfer: &wt}
	for i, api := range tc.apis {
		r := startReceiverAPI(ctx, t, pl, i, api)
		rs = append(rs, r)
		sc.Servers = append(sc.Servers, pipelines.Server{URL: r.url, API: string(api)})
	}
	cfg := Config{API: lib, Device: pl.Trainer, Advertise: "127.0.0.1"}
	if mon != nil {
		cfg.Monitor, cfg.MonitorIndex = mon, pl.Trainer
	}
	tr, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	steps := activities.New(activities.Deps{NCCL: tr})

	t0 := time.Now()
	io, err := steps.InitTransfer(ctx, activities.InitTransferInput{Context: sc})
	if err != nil {
		gputest.Verdict(t, false, "init: %v", err)
		return
	}
	gputest.Verdict(t, io.WorldSize == len(rs)+1 && slices.Equal(io.Methods, tc.methods),
		"init: world size %d, engine methods %v (want %v), group %s, %.1fs", io.WorldSize, io.Methods, tc.methods, io.Group, time.Since(t0).Seconds())
	checkInits(ctx, t, rs, tc, io.VLLM, 1, "init")

	bcast := func(path string, iter int) (*activities.BroadcastOutput, error) {
		in := activities.BroadcastInput{Context: sc, Checkpoint: path, Verify: true}
		in.Context.Iteration = iter
		return steps.Broadcast(ctx, in)
	}
	for k := range cks.paths {
		out, err := bcast(cks.paths[k], k+1)
		if err != nil {
			gputest.Verdict(t, false, "broadcast %d: %v", k+1, err)
			return
		}
		gputest.Verdict(t, !out.Initialized && slices.Equal(out.Methods, tc.methods),
			"broadcast %d on the same group: %d bytes, %d tensors, %.2fs (%.2f GB/s), version %s, initialized %v, methods %v",
			k+1, out.Bytes, out.Tensors, out.Seconds, out.GBps, out.Version, out.Initialized, out.Methods)
		checkReceived(ctx, t, rs, cks.want[k], k+1, fmt.Sprintf("broadcast %d", k+1))
	}

	// The last server rejects the next update before receiving a
	// byte: the broadcast must fail fast with its reason, not hang.
	last := len(rs) - 1
	if err := rs[last].post(ctx, "/fail_next_update"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = bcast(cks.paths[0], 3)
	took := time.Since(start)
	ok := err != nil && took < 60*time.Second && strings.Contains(err.Error(), rs[last].url) &&
		strings.Contains(err.Error(), "injected failure") && activities.IsType(err, pipelines.ErrTypeServerError)
	gputest.Verdict(t, ok, "update_weights 500 on server %d: broadcast failed after %.2fs: %v", len(rs), took.Seconds(), err)
	checkFailedSession(ctx, t, rs[last], last, tc.apis[last], "gpu-test/iter-3")

	out, err := bcast(cks.paths[1], 4)
	if err != nil {
		gputest.Verdict(t, false, "broadcast after the failure: %v", err)
		return
	}
	gputest.Verdict(t, out.Initialized && slices.Equal(out.Methods, tc.methods),
		"broadcast after the failure re-initialised the group: initialized %v, methods %v, %.2fs", out.Initialized, out.Methods, out.Seconds)
	checkReceived(ctx, t, rs, cks.want[1], 3, "broadcast after the failure")
	checkInits(ctx, t, rs, tc, nil, 2, "re-initialisation")
}

// checkInits checks each receiver's latest init (the inits-th): its
// generation, rank, world size and how its worker got the unique id:
// the rendezvous the case expects, with a pickle of the expected module
// and size from the TCPStore, or nccl_unique_id_b64 with neither a
// TCPStore nor a pickle. servers, when given (the init step's _vllm),
// must show E servers' GET /version as 0.30.0, the version rlflow reads
// as generation E.
func checkInits(ctx context.Context, t *testing.T, rs []*httpReceiver, tc transferCase, servers []pipelines.VLLMServer, inits int, what string) {
	t.Helper()
	wantPickle := 0
	if tc.module != "" {
		b, err := ncclid.PickleIn(ncclid.ID{}, tc.module)
		if err != nil {
			t.Fatal(err)
		}
		wantPickle = len(b)
	}
	for i, r := range rs {
		rep, err := r.received(ctx)
		if err != nil || len(rep.Inits) != inits {
			gputest.Verdict(t, false, "%s: server %d: want %d inits, report: %d inits, %v", what, i+1, inits, len(rep.Inits), err)
			continue
		}
		in := rep.Inits[inits-1]
		ok := rep.API == string(tc.apis[i]) && in.Rank == i+1 && in.WorldSize == len(rs)+1 && in.Rendezvous == tc.methods[i]
		how := "nccl_unique_id_b64, no TCPStore, no pickle"
		if in.Rendezvous == MethodTCPStore {
			ok = ok && in.PickleModule == tc.module && in.PickleBytes == wantPickle && in.MasterPort != nil
			port := -1
			if in.MasterPort != nil {
				port = *in.MasterPort
			}
			how = fmt.Sprintf("TCPStore port %d, pickle of %d bytes (want %d) naming %s (want %s)", port, in.PickleBytes, wantPickle, in.PickleModule, tc.module)
		} else {
			ok = ok && in.PickleModule == "" && in.PickleBytes == 0 && in.MasterPort == nil
		}
		version := ""
		if servers != nil {
			version = ", GET /version " + servers[i].Version
			if tc.apis[i] == vllm.GenE {
				ok = ok && servers[i].Version == "0.30.0"
			}
		}
		gputest.Verdict(t, ok, "%s: server %d (API %s%s): rendezvous %s (want %s): %s; rank %d of %d",
			what, i+1, rep.API, version, in.Rendezvous, tc.methods[i], how, in.Rank, in.WorldSize)
	}
}

// checkFailedSession checks that the server whose update_weights failed
// (index i) has no update session left open: a generation-E server closed
// it itself and rlflow labelled its weights version+"-failed" with
// update_weight_version rather than finishing it; a D server had it
// finished with that label.
func checkFailedSession(ctx context.Context, t *testing.T, r *httpReceiver, i int, api vllm.Generation, version string) {
	t.Helper()
	rep, err := r.received(ctx)
	if err != nil {
		gputest.Verdict(t, false, "failed update: server %d: %v", i+1, err)
		return
	}
	label := version + "-failed"
	selfClosed := rep.happened("session closed by the worker: update_weights failed")
	labelled, finished := rep.happened("update_weight_version "+label), rep.happened("finish "+label)
	ok := !rep.SessionOpen && rep.Version == label
	if api == vllm.GenE {
		ok = ok && selfClosed && labelled && !finished
	} else {
		ok = ok && !selfClosed && finished
	}
	gputest.Verdict(t, ok, "failed update: server %d (API %s): session open %v, closed by the server itself %v, labelled by update_weight_version %v, finished by rlflow %v, weight version %q",
		i+1, api, rep.SessionOpen, selfClosed, labelled, finished, rep.Version)
}
