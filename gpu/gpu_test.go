package gpu

// The GPU test of Transfer: real NCCL and CUDA through nccl.Load, rank 0 in
// this process, and every vLLM server played by tests/gpu/receiver.py
// --http (a vLLM-like HTTP front doing a worker's real TCPStore
// rendezvous, NCCL init, warm-up and broadcasts), all on one GPU with a
// distinct NCCL_HOSTID per process. It skips, naming what is missing,
// where NCCL or the CUDA runtime cannot be loaded or no GPU is visible.
// nccl/GPU.md has the command.
//
// Environment: RLFLOW_GPU_DIR (checkpoints, default $TMPDIR/rlflow-gpu),
// RLFLOW_GPU_LOGS (process logs, default ./gpu-logs), RLFLOW_GPU_SCRIPTS
// (directory of receiver.py), RLFLOW_PYTHON (default python3),
// RLFLOW_GPU_DEVICE (default 0), RECEIVER_NCCL_LIB (receiver's NCCL).

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
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
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/safetensors"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
)

func gpuDevice() int {
	if v, err := strconv.Atoi(os.Getenv("RLFLOW_GPU_DEVICE")); err == nil {
		return v
	}
	return 0
}

var gpuOnce struct {
	sync.Once
	lib *nccl.Library
	err error
}

// gpuLib loads the real libraries or skips the test, saying what is missing.
func gpuLib(t *testing.T) *nccl.Library {
	t.Helper()
	gpuOnce.Do(func() {
		// NCCL reads NCCL_HOSTID when it first initialises: the trainer must
		// look like another host than the receivers on the same GPU.
		if os.Getenv("NCCL_HOSTID") == "" {
			os.Setenv("NCCL_HOSTID", "rlflow-trainer")
		}
		lib, err := nccl.Load(nccl.Config{})
		if err != nil {
			gpuOnce.err = err
			return
		}
		dev, err := nccl.OpenDevice(lib, gpuDevice())
		if err != nil {
			gpuOnce.err = err
			return
		}
		defer dev.Close()
		gpuOnce.err = dev.Do(context.Background(), func(api nccl.API) error {
			n, err := api.GetDeviceCount()
			if err == nil && n == 0 {
				err = errors.New("no CUDA device")
			}
			return err
		})
		gpuOnce.lib = lib
	})
	if gpuOnce.err != nil {
		t.Skipf("skipping GPU test: %v", gpuOnce.err)
	}
	v, _ := gpuOnce.lib.NCCLVersion()
	t.Logf("NCCL %d from %s, CUDA runtime %s", v, gpuOnce.lib.NCCLPath(), gpuOnce.lib.CUDARTPath())
	return gpuOnce.lib
}

func verdict(t *testing.T, ok bool, format string, args ...any) {
	t.Helper()
	word := "PASS"
	if !ok {
		word = "FAIL"
	}
	msg := fmt.Sprintf(format, args...)
	fmt.Printf("GPU-%s %s: %s\n", word, t.Name(), msg)
	if !ok {
		t.Error(msg)
	}
}

func logDir(t *testing.T) string {
	d := os.Getenv("RLFLOW_GPU_LOGS")
	if d == "" {
		d = "gpu-logs"
	}
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

func receiverScript(t *testing.T) string {
	t.Helper()
	for _, d := range []string{os.Getenv("RLFLOW_GPU_SCRIPTS"), "../tests/gpu", "tests/gpu", "../../tests/gpu"} {
		if d == "" {
			continue
		}
		p := filepath.Join(d, "receiver.py")
		if _, err := os.Stat(p); err == nil {
			abs, _ := filepath.Abs(p)
			return abs
		}
	}
	t.Fatal("cannot find receiver.py (set RLFLOW_GPU_SCRIPTS to the tests/gpu directory)")
	return ""
}

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
	type spec struct {
		name  string
		dtype safetensors.DType
		shape []int64
	}
	const h, inter = 1024, 2816
	specs := []spec{
		{"model.embed_tokens.weight", safetensors.BF16, []int64{32000, h}},
		{"odd.one", safetensors.BF16, []int64{1}},
		{"odd.3x5x7", safetensors.BF16, []int64{3, 5, 7}},
		{"odd.scalar", safetensors.F32, []int64{}},
		{"odd.empty", safetensors.BF16, []int64{0, 16}},
		{"odd.i64", safetensors.I64, []int64{7}},
		{"odd.65537", safetensors.BF16, []int64{65537}},
	}
	for l := 0; l < 12; l++ {
		p := fmt.Sprintf("model.layers.%d.", l)
		specs = append(specs,
			spec{p + "input_layernorm.weight", safetensors.BF16, []int64{h}},
			spec{p + "self_attn.qkv_proj.weight", safetensors.BF16, []int64{3 * h, h}},
			spec{p + "self_attn.o_proj.weight", safetensors.BF16, []int64{h, h}},
			spec{p + "mlp.gate_up_proj.weight", safetensors.BF16, []int64{2 * inter, h}},
			spec{p + "mlp.down_proj.weight", safetensors.BF16, []int64{h, inter}},
		)
	}
	specs = append(specs, spec{"lm_head.weight", safetensors.BF16, []int64{32000, h}})
	var wt []safetensors.WriteTensor
	for i, s := range specs {
		n := int64(1)
		for _, d := range s.shape {
			n *= d
		}
		data := make([]byte, n*int64(s.dtype.ItemSize()))
		x := uint64(seed)*0x9e3779b97f4a7c15 + uint64(i+1)*0xbf58476d1ce4e5b9
		for j := 0; j+8 <= len(data); j += 8 {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			binary.LittleEndian.PutUint64(data[j:], x)
		}
		for j := len(data) &^ 7; j < len(data); j++ {
			data[j] = byte(j + seed)
		}
		wt = append(wt, safetensors.WriteTensor{Name: s.name, DType: s.dtype, Shape: s.shape, Data: data})
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

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func startReceiver(ctx context.Context, t *testing.T, i int) *httpReceiver {
	t.Helper()
	py := os.Getenv("RLFLOW_PYTHON")
	if py == "" {
		py = "python3"
	}
	port := freePort(t)
	args := []string{receiverScript(t), "--http", strconv.Itoa(port), "--api", "D", "--device", strconv.Itoa(gpuDevice()), "--deadline", "600", "--update-deadline", "30"}
	cmd := exec.Command(py, args...)
	cmd.Env = append(os.Environ(), fmt.Sprintf("NCCL_HOSTID=rlflow-worker%d", i+1), "PYTHONUNBUFFERED=1")
	logPath := filepath.Join(logDir(t), strings.NewReplacer("/", "_").Replace(t.Name())+fmt.Sprintf(".server%d.log", i+1))
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(logf, "$ %s %s\n", py, strings.Join(args, " "))
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
			verdict(t, false, "%s: server %d: %v", what, i+1, err)
			continue
		}
		bad := 0
		for name, sum := range want {
			if rep.SHA256[name] != sum {
				bad++
			}
		}
		ok := rep.Updates == updates && bad == 0 && len(rep.SHA256) == len(want)
		verdict(t, ok, "%s: server %d: update %d, %d of %d tensors byte-exact (SHA-256), receiver stats %v",
			what, i+1, rep.Updates, len(want)-bad, len(want), rep.Stats)
	}
}

// TestGPUTransferToHTTPReceivers: gpu.Transfer end to end on the GPU, as
// the GPU worker runs it: init, two broadcasts reusing the group, an
// update_weights that fails early (the communicator must be aborted, not
// hang), and a broadcast that re-initialises the group.
func TestGPUTransferToHTTPReceivers(t *testing.T) {
	lib := gpuLib(t)
	ck1, ck2 := genCheckpoint(t, 1), genCheckpoint(t, 2)
	want1, want2 := digests(t, ck1), digests(t, ck2)
	var mon Monitor
	if m, err := OpenNVML(""); err == nil {
		mon = m
		defer m.Close()
	} else {
		t.Logf("no NVML: %v", err)
	}
	cases := []struct {
		name    string
		servers int
		wt      pipelines.WeightTransfer
	}{
		{"W2-packed-64MiB", 1, pipelines.WeightTransfer{Packed: true, BufferBytes: 64 << 20}},
		{"W3-nonpacked", 2, pipelines.WeightTransfer{}},
		{"W3-packed-default-1GiB", 2, pipelines.WeightTransfer{Packed: true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			var rs []*httpReceiver
			var fleet vllm.Fleet
			wt := tc.wt
			wt.Backend = "nccl"
			sc := pipelines.StepContext{RunID: "gpu-test", Iteration: 1, WeightTransfer: &wt}
			for i := 0; i < tc.servers; i++ {
				r := startReceiver(ctx, t, i)
				rs = append(rs, r)
				c, err := vllm.New(r.url, vllm.Options{Generation: vllm.GenD})
				if err != nil {
					t.Fatal(err)
				}
				fleet = append(fleet, c)
				sc.Servers = append(sc.Servers, pipelines.Server{URL: r.url, API: "D"})
			}
			var beatMu sync.Mutex
			var lastBeat Progress
			cfg := Config{API: lib, Device: gpuDevice(), Advertise: "127.0.0.1",
				Heartbeat: func(_ context.Context, p Progress) { beatMu.Lock(); lastBeat = p; beatMu.Unlock() }}
			if mon != nil {
				cfg.Monitor, cfg.MonitorIndex = mon, gpuDevice()
			}
			tr, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()

			t0 := time.Now()
			io, err := tr.Init(ctx, activities.InitTransferInput{Context: sc}, fleet)
			if err != nil {
				verdict(t, false, "init: %v", err)
				return
			}
			verdict(t, io.WorldSize == tc.servers+1, "init: world size %d, group %s, %.1fs", io.WorldSize, io.Group, time.Since(t0).Seconds())

			bcast := func(path string, iter int) (*activities.BroadcastOutput, error) {
				in := activities.BroadcastInput{Context: sc, Checkpoint: path, Verify: true}
				in.Context.Iteration = iter
				return tr.Broadcast(ctx, in, fleet)
			}
			for iter, c := range []struct {
				path string
				want map[string]string
			}{{ck1, want1}, {ck2, want2}} {
				out, err := bcast(c.path, iter+1)
				if err != nil {
					verdict(t, false, "broadcast %d: %v", iter+1, err)
					return
				}
				verdict(t, !out.Initialized, "broadcast %d on the same group: %d bytes, %d tensors, %.2fs (%.2f GB/s), version %s, initialized %v",
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
				strings.Contains(err.Error(), "injected failure") && activities.IsType(err, activities.ErrTypeServerError)
			verdict(t, ok, "update_weights 500 on server %d: broadcast failed after %.2fs: %v", len(rs), took.Seconds(), err)

			out, err := bcast(ck2, 4)
			if err != nil {
				verdict(t, false, "broadcast after the failure: %v", err)
				return
			}
			verdict(t, out.Initialized, "broadcast after the failure re-initialised the group: initialized %v, %.2fs", out.Initialized, out.Seconds)
			checkReceived(ctx, t, rs, want2, 3, "broadcast after the failure")
			beatMu.Lock()
			if lastBeat.Health != nil {
				t.Logf("GPU health in the last heartbeat: %+v", *lastBeat.Health)
			}
			beatMu.Unlock()
		})
	}
}
