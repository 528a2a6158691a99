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
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
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

// startReceiver starts server i (0-based). receiver.py --http serves one
// rank, so the fleet's cumulative rank offsets make server i rank i+1: it
// runs on pl.Device(i+1), with NCCL_HOSTID=rlflow-worker<i+1> in single
// placement.
func startReceiver(ctx context.Context, t *testing.T, pl gputest.Placement, i int) *httpReceiver {
	t.Helper()
	py := os.Getenv("RLFLOW_PYTHON")
	if py == "" {
		py = "python3"
	}
	port := testutil.FreePort(t)
	args := []string{gputest.Script(t, "receiver.py"), "--http", strconv.Itoa(port), "--api", "D", "--device", strconv.Itoa(pl.Device(i + 1)), "--deadline", "600", "--update-deadline", "30"}
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
	Updates int               `json:"updates"`
	SHA256  map[string]string `json:"sha256"`
	Stats   map[string]any    `json:"stats"`
	Version string            `json:"version"`
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

// TestGPUTransferToHTTPReceivers: the engine end to end on the GPU, through
// the transfer activities as the GPU worker runs them: init, two
// broadcasts reusing the group (each verifying the servers' weight
// version), an
// update_weights that fails early (the communicator must be aborted, not
// hang), and a broadcast that re-initialises the group. W4 and W8 (3 and 7
// one-rank servers, rank offsets 1..W-1) run only with spread placement.
func TestGPUTransferToHTTPReceivers(t *testing.T) {
	lib := gputest.Lib(t)
	ck1, ck2 := genCheckpoint(t, 1), genCheckpoint(t, 2)
	want1, want2 := digests(t, ck1), digests(t, ck2)
	var mon gpuhealth.Monitor
	if m, err := gpuhealth.OpenNVML(""); err == nil {
		mon = m
		defer m.Close()
	} else {
		t.Logf("no NVML: %v", err)
	}
	cases := []struct {
		name    string
		servers int
		wt      pipelines.WeightTransfer
		spread  bool // only with spread placement (one GPU per rank)
	}{
		{"W2-packed-64MiB", 1, pipelines.WeightTransfer{Packed: true, BufferBytes: 64 << 20}, false},
		{"W3-nonpacked", 2, pipelines.WeightTransfer{}, false},
		{"W3-packed-default-1GiB", 2, pipelines.WeightTransfer{Packed: true}, false},
		// Multi-GPU hosts (issue 5). receiver.py --http is a one-rank
		// server, so these are 3 and 7 servers, not 2 servers of several
		// ranks each.
		{"W4-3servers-packed-64MiB", 3, pipelines.WeightTransfer{Packed: true, BufferBytes: 64 << 20}, true},
		{"W8-7servers-packed-default-1GiB", 7, pipelines.WeightTransfer{Packed: true}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pl := gputest.Place(t, tc.servers+1)
			if tc.spread && !pl.Spread() {
				t.Skipf("skipping: world size %d runs only with spread placement (one GPU per rank): %d GPUs visible, %s=%q",
					tc.servers+1, pl.Devices, gputest.EnvPlacement, os.Getenv(gputest.EnvPlacement))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			var rs []*httpReceiver
			wt := tc.wt
			wt.Backend = pipelines.BackendNCCL
			sc := pipelines.StepContext{RunID: "gpu-test", Iteration: 1, WeightTransfer: &wt}
			for i := 0; i < tc.servers; i++ {
				r := startReceiver(ctx, t, pl, i)
				rs = append(rs, r)
				sc.Servers = append(sc.Servers, pipelines.Server{URL: r.url, API: "D"})
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
			gputest.Verdict(t, io.WorldSize == tc.servers+1, "init: world size %d, group %s, %.1fs", io.WorldSize, io.Group, time.Since(t0).Seconds())

			bcast := func(path string, iter int) (*activities.BroadcastOutput, error) {
				in := activities.BroadcastInput{Context: sc, Checkpoint: path, Verify: true}
				in.Context.Iteration = iter
				return steps.Broadcast(ctx, in)
			}
			for iter, c := range []struct {
				path string
				want map[string]string
			}{{ck1, want1}, {ck2, want2}} {
				out, err := bcast(c.path, iter+1)
				if err != nil {
					gputest.Verdict(t, false, "broadcast %d: %v", iter+1, err)
					return
				}
				gputest.Verdict(t, !out.Initialized, "broadcast %d on the same group: %d bytes, %d tensors, %.2fs (%.2f GB/s), version %s, initialized %v",
					iter+1, out.Bytes, out.Tensors, out.Seconds, out.GBps, out.Version, out.Initialized)
				checkReceived(ctx, t, rs, c.want, iter+1, fmt.Sprintf("broadcast %d", iter+1))
			}

			// The last server rejects the next update before receiving a
			// byte: the broadcast must fail fast with its reason, not hang.
			if err := rs[len(rs)-1].post(ctx, "/fail_next_update"); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			_, err = bcast(ck1, 3)
			took := time.Since(start)
			ok := err != nil && took < 60*time.Second && strings.Contains(err.Error(), rs[len(rs)-1].url) &&
				strings.Contains(err.Error(), "injected failure") && activities.IsType(err, pipelines.ErrTypeServerError)
			gputest.Verdict(t, ok, "update_weights 500 on server %d: broadcast failed after %.2fs: %v", len(rs), took.Seconds(), err)

			out, err := bcast(ck2, 4)
			if err != nil {
				gputest.Verdict(t, false, "broadcast after the failure: %v", err)
				return
			}
			gputest.Verdict(t, out.Initialized, "broadcast after the failure re-initialised the group: initialized %v, %.2fs", out.Initialized, out.Seconds)
			checkReceived(ctx, t, rs, want2, 3, "broadcast after the failure")
		})
	}
}
