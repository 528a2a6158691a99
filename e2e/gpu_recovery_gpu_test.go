//go:build linux

package e2e

// The GPU-host variant of TestGPUWorkerSIGKILLDuringBroadcast: the same
// recovery (SIGKILL the GPU worker mid-broadcast, a restarted one
// re-initialises the group and completes the iteration), but with real
// NCCL on a GPU and a vLLM-like receiver that does a worker's real part
// (tests/gpu/receiver.py --http: TCPStore rendezvous, NCCL init, the
// broadcasts, SHA-256 of every received tensor). Trainer and receiver share
// one GPU and are kept apart with NCCL_HOSTID, so the bytes go over NCCL's
// socket transport. It skips, saying what is missing, where there is no GPU,
// NCCL, CUDA runtime or torch. nccl/GPU.md has the device command.
//
// Environment: RLFLOW_TEMPORAL (Temporal CLI), RLFLOW_BIN (prebuilt rlflow;
// built from the module when unset: the GPU host has no Go toolchain),
// RECEIVER_NCCL_LIB (the receiver's libnccl, which the trainer must load
// too; default: torch's bundled copy), RLFLOW_PYTHON (default python3),
// RLFLOW_GPU_DEVICE (default 0), RLFLOW_GPU_LOGS (process logs; default a
// new temporary directory), RLFLOW_GPU_SCRIPTS (directory of receiver.py).

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// gpuHostRecoveryPipeline is gpuRecoveryPipeline with the real transfer's
// settings: 64 MiB packing (a few dozen chunks, so that a kill lands
// between two of them), a 5 s heartbeat (the loss is noticed 5 s after the
// kill), a bounded update and the weight version verified after each
// broadcast.
const gpuHostRecoveryPipeline = `version: 1
name: gpu-host-recovery
params:
  ckpt_root: {type: string, required: true}
servers:
  - {url: "%s", api: C}
weight_transfer: {backend: nccl, packed: true, buffer_bytes: 64MiB, gpu_start_timeout: 20s}
loop: {iterations: 2}
defaults:
  timeout: 3m
  heartbeat: 5s
  retry: {max_attempts: 3, initial_interval: 500ms}
steps:
  - id: pause
    uses: pause
    with: {mode: keep}
  - id: sync
    uses: broadcast
    needs: [pause]
    with:
      checkpoint: "${{ params.ckpt_root }}/iter-${{ loop.iteration }}"
      version: "iter-${{ loop.iteration }}"
      update_timeout: 90s
      verify: true
  - id: resume
    uses: resume
    needs: [sync]
    always: true
`

const (
	// gpuHostTestBudget bounds the whole test; every wait below is inside it.
	gpuHostTestBudget = 5 * time.Minute
	// receiverChunkDelay slows each update down by this much per packed
	// chunk (12 chunks): the socket path alone moves the 1.29 GB in about
	// 0.4 s, too short a window to SIGKILL the trainer in it reliably.
	receiverChunkDelay = "0.1"
	// receiverUpdateDeadline bounds an update_weights whose trainer died
	// without NCCL noticing; the retried init waits for it.
	receiverUpdateDeadline = 30 * time.Second
)

// gpuHost is what the test needs from a GPU host.
type gpuHost struct {
	python  string
	ncclLib string // the receiver's libnccl; the trainer must load the same build
	device  int
}

// requireGPUHost skips unless this machine has a GPU, NCCL, the CUDA
// runtime and torch with CUDA; it resolves the NCCL both sides load.
func requireGPUHost(t *testing.T) gpuHost {
	t.Helper()
	const what = "skipping the GPU-host recovery test (its CPU variant is TestGPUWorkerSIGKILLDuringBroadcast): "
	smi, err := exec.LookPath("nvidia-smi")
	if err != nil {
		t.Skip(what + "no nvidia-smi on PATH, so no NVIDIA GPU here")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, smi, "-L").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "GPU ") {
		t.Skipf(what+"nvidia-smi -L lists no GPU (%v): %s", err, tail(string(out), 500))
	}
	h := gpuHost{python: os.Getenv("RLFLOW_PYTHON"), ncclLib: os.Getenv("RECEIVER_NCCL_LIB")}
	if h.python == "" {
		h.python = "python3"
	}
	h.device = gputest.Device(t)
	out, err = exec.CommandContext(ctx, h.python, "-c",
		"import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'; print(torch.__version__)").CombinedOutput()
	if err != nil {
		t.Skipf(what+"%s -c 'import torch' with CUDA failed (%v): %s", h.python, err, tail(string(out), 800))
	}
	t.Logf("torch %s (%s)", strings.TrimSpace(tail(string(out), 100)), h.python)
	if h.ncclLib == "" {
		// torch loads the NCCL of its nvidia-nccl wheel: NCCL refuses ranks of
		// different builds (nccl/GPU-RESULTS.md), so the trainer loads it too.
		out, err := exec.CommandContext(ctx, h.python, "-c",
			"import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], 'lib', 'libnccl.so.2'))").CombinedOutput()
		if err != nil {
			t.Fatalf("cannot tell which NCCL torch loads (%v: %s): set RECEIVER_NCCL_LIB to it; the trainer must load the same build", err, tail(string(out), 500))
		}
		h.ncclLib = strings.TrimSpace(string(out))
	}
	lib, err := nccl.Load(nccl.Config{NCCLPath: h.ncclLib})
	if err != nil {
		t.Skipf(what+"cannot load NCCL (%s) and the CUDA runtime: %v", h.ncclLib, err)
	}
	n, err := lib.GetDeviceCount()
	if err != nil || n == 0 {
		t.Skipf(what+"the CUDA runtime sees no device (count %d): %v", n, err)
	}
	v, _ := lib.NCCLVersion()
	t.Logf("NCCL %d from %s, CUDA runtime %s, %d device(s), using device %d", v, lib.NCCLPath(), lib.CUDARTPath(), n, h.device)
	h.ncclLib = lib.NCCLPath()
	return h
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// rlflowBin is $RLFLOW_BIN (the GPU host has no Go toolchain) or a build
// of cmd/rlflow.
func rlflowBin(t *testing.T) string {
	t.Helper()
	p := os.Getenv("RLFLOW_BIN")
	if p == "" {
		return testutil.RlflowBinary(t)
	}
	abs, err := filepath.Abs(p)
	require.NoError(t, err)
	st, err := os.Stat(abs)
	require.NoError(t, err, "RLFLOW_BIN")
	require.False(t, st.IsDir(), "RLFLOW_BIN %s is a directory", abs)
	return abs
}

func gpuLogsDir(t *testing.T) string {
	t.Helper()
	abs, err := filepath.Abs(gputest.LogDir(t, ""))
	require.NoError(t, err)
	return abs
}

// logFile creates <logs>/<test>.<name>.log, closed at cleanup (registered
// first, so it closes after the process writing to it was waited for).
func logFile(t *testing.T, logs, name string) (*os.File, string) {
	t.Helper()
	p := filepath.Join(logs, strings.ReplaceAll(t.Name(), "/", "_")+"."+name+".log")
	f, err := os.Create(p)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f, p
}

// startInGroup starts cmd as the leader of its own process group (killed
// whole, at cleanup or by killGroup) that dies with the test process.
func startInGroup(t *testing.T, cmd *exec.Cmd, log *os.File) func() string {
	t.Helper()
	fmt.Fprintf(log, "$ %s\n", strings.Join(cmd.Args, " "))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	out := startCaptured(t, cmd, log)
	t.Cleanup(func() { killGroup(cmd) }) // runs before startCaptured's Wait
	return out
}

func killGroup(cmd *exec.Cmd) {
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
}

// ---- the checkpoint ----

// gpuRecoverySpecs is a 1.29 GB bf16 decoder-shaped model of 58 tensors,
// with the awkward ones the GPU tests use (1, 3x5x7 and 65537 elements, an
// f32 scalar, int64, a zero-size tensor): 12 chunks when packed with a
// 64 MiB threshold (a chunk closes after the tensor that crosses it).
func gpuRecoverySpecs() []gputest.Spec { return gputest.DecoderSpecs(2048, 5632, 32000, 10) }

// writeGPURecoveryCheckpoint writes dir/model.safetensors with xorshift
// bytes from seed (every checkpoint differs) and returns the SHA-256 of
// each tensor's bytes, as receiver.py reports what it received, and the
// total size. Tensors are filled in parallel: ~1.3 GB per checkpoint.
func writeGPURecoveryCheckpoint(t *testing.T, dir string, seed uint64) (map[string]string, int64) {
	t.Helper()
	specs := gpuRecoverySpecs()
	wt := make([]safetensors.WriteTensor, len(specs))
	sums := make([]string, len(specs))
	var total int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.NumCPU())
	for i, s := range specs {
		data := make([]byte, s.Bytes())
		total += int64(len(data))
		wt[i] = safetensors.WriteTensor{Name: s.Name, DType: s.DType, Shape: s.Shape, Data: data}
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			gputest.XorshiftFill(data, seed, i)
			sum := sha256.Sum256(data)
			sums[i] = hex.EncodeToString(sum[:])
		})
	}
	wg.Wait()
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, safetensors.Write(filepath.Join(dir, "model.safetensors"), wt, map[string]string{"rlflow_gen": "gpu-host-recovery"}))
	out := map[string]string{}
	for i, s := range specs {
		out[s.Name] = sums[i]
	}
	return out, total
}

// ---- the receiver (tests/gpu/receiver.py --http) ----

// receiverReport is receiver.py's GET /received.
type receiverReport struct {
	Updates int    `json:"updates"` // completed update_weights
	Calls   int    `json:"calls"`   // update_weights that started receiving
	Version string `json:"version"`
	History []struct {
		Update  int               `json:"update"`
		At      float64           `json:"at"` // Unix seconds
		SHA256  map[string]string `json:"sha256"`
		Version string            `json:"version"`
		Paused  bool              `json:"paused"`
		Stats   map[string]any    `json:"stats"`
	} `json:"history"`
	Failures []struct {
		Update     int     `json:"update"`
		At         float64 `json:"at"`
		Seconds    float64 `json:"seconds"`
		Error      string  `json:"error"`
		ChunksDone int     `json:"chunks_done"`
		Chunks     int     `json:"chunks"`
	} `json:"failures"`
	Inits []struct {
		At         float64 `json:"at"`
		MasterPort int     `json:"master_port"`
		Seconds    float64 `json:"seconds"`
	} `json:"inits"`
	Progress struct {
		Update     int   `json:"update"`
		Running    bool  `json:"running"`
		Chunks     int   `json:"chunks"`
		ChunksDone int   `json:"chunks_done"`
		Bytes      int64 `json:"bytes"`
		BytesDone  int64 `json:"bytes_done"`
	} `json:"progress"`
	SessionOpen bool `json:"session_open"`
	Paused      bool `json:"paused"`
	PauseCalls  int  `json:"pause_calls"`
	ResumeCalls int  `json:"resume_calls"`
	Events      []struct {
		T    float64 `json:"t"`
		What string  `json:"what"`
	} `json:"events"`
}

func getReceived(ctx context.Context, url string) (receiverReport, []byte, error) {
	var rep receiverReport
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/received", nil)
	if err != nil {
		return rep, nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return rep, nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return rep, nil, err
	}
	if err := json.Unmarshal(raw, &rep); err != nil {
		return rep, nil, fmt.Errorf("GET /received: HTTP %d: %w: %s", resp.StatusCode, err, tail(string(raw), 300))
	}
	return rep, raw, nil
}

// pollReceiver polls GET /received until done says so, done fails, or ctx
// ends: every 5 ms while an update runs (a chunk takes ~0.1 s), else every
// 50 ms.
func pollReceiver(ctx context.Context, url string, done func(receiverReport) (bool, error)) (receiverReport, error) {
	var last receiverReport
	var lastErr error
	for {
		rep, _, err := getReceived(ctx, url)
		if err == nil {
			last = rep
			ok, derr := done(rep)
			if derr != nil || ok {
				return rep, derr
			}
		} else {
			lastErr = err
		}
		every := 50 * time.Millisecond
		if last.Progress.Running {
			every = 5 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return last, fmt.Errorf("%w (last receiver error: %v; last progress %+v)", ctx.Err(), lastErr, last.Progress)
		case <-time.After(every):
		}
	}
}

// startReceiverPy starts receiver.py --http as a generation C vLLM server
// with NCCL_HOSTID rlflow-worker1 and waits for its READY line.
func startReceiverPy(ctx context.Context, t *testing.T, h gpuHost, script, logs string, port int) string {
	t.Helper()
	f, logPath := logFile(t, logs, "receiver")
	cmd := exec.Command(h.python, script, "--http", strconv.Itoa(port), "--api", "C", "--device", strconv.Itoa(h.device),
		"--nccl-lib", h.ncclLib, "--deadline", strconv.Itoa(int(gpuHostTestBudget.Seconds())+60),
		"--update-deadline", strconv.Itoa(int(receiverUpdateDeadline.Seconds())), "--store-timeout", "60",
		"--chunk-delay", receiverChunkDelay)
	// PCI_BUS_ID as the GPU worker sets it, so that both mean the same
	// device by the same ordinal.
	cmd.Env = append(os.Environ(), "NCCL_HOSTID=rlflow-worker1", "PYTHONUNBUFFERED=1", "CUDA_DEVICE_ORDER=PCI_BUS_ID", ncclDebug())
	out := startInGroup(t, cmd, f)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute) // import torch, CUDA init
	defer cancel()
	for !strings.Contains(out(), "\nREADY ") && !strings.HasPrefix(out(), "READY ") {
		if exited(cmd.Process.Pid) {
			t.Fatalf("receiver.py exited before READY (see %s):\n%s", logPath, tail(out(), 3000))
		}
		select {
		case <-rctx.Done():
			t.Fatalf("receiver.py: no READY within its start deadline: %v (see %s):\n%s", rctx.Err(), logPath, tail(out(), 3000))
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Logf("receiver %s ready: %s (log %s)", url, readyLine(out()), logPath)
	return url
}

// ncclDebug keeps NCCL's warnings (the lost peer, its errno) in the process
// logs unless the caller chose a level.
func ncclDebug() string {
	if v := os.Getenv("NCCL_DEBUG"); v != "" {
		return "NCCL_DEBUG=" + v
	}
	return "NCCL_DEBUG=WARN"
}

func readyLine(out string) string {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "READY ") {
			return sc.Text()
		}
	}
	return ""
}

// pauseResumeSequence is the receiver's pause/resume calls in order, with
// repeats collapsed (a retried pause or resume is harmless).
func pauseResumeSequence(rep receiverReport) []string {
	var seq []string
	for _, e := range rep.Events {
		what, _, _ := strings.Cut(e.What, " ")
		if what != "pause" && what != "resume" {
			continue
		}
		if len(seq) == 0 || seq[len(seq)-1] != what {
			seq = append(seq, what)
		}
	}
	return seq
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

func TestGPUHostWorkerSIGKILLDuringBroadcast(t *testing.T) {
	// What can be checked without a GPU runs first, so that a broken
	// pipeline or a missing receiver shows on a CPU machine too.
	script := gputest.Script(t, "receiver.py")
	port := testutil.FreePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	dir := t.TempDir()
	ckptRoot := filepath.Join(dir, "ckpt")
	file := filepath.Join(dir, "gpu-host-recovery.yaml")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(gpuHostRecoveryPipeline, url)), 0o644))
	spec, err := pipelines.LoadFile(file)
	require.NoError(t, err)
	params, err := spec.ResolveParams(map[string]string{"ckpt_root": ckptRoot})
	require.NoError(t, err)

	host := requireGPUHost(t)
	bin := rlflowBin(t)
	requireGPUWorkerCommand(t, bin)
	logs := gpuLogsDir(t)
	t.Logf("process logs in %s", logs)

	// The one-line summary the GPU runs are read by; facts are added as
	// they are established.
	var facts []string
	note := func(format string, args ...any) {
		facts = append(facts, fmt.Sprintf(format, args...))
		t.Logf(format, args...)
	}
	defer func() {
		word := "PASS"
		if t.Failed() {
			word = "FAIL"
		}
		if !t.Skipped() {
			fmt.Printf("GPU-%s %s: %s\n", word, t.Name(), strings.Join(facts, "; "))
		}
	}()

	budget := gpuHostTestBudget - 15*time.Second // room for cleanup
	if d, ok := t.Deadline(); ok && time.Until(d)-15*time.Second < budget {
		budget = time.Until(d) - 15*time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()

	// The dev server first: without the Temporal CLI the test skips before
	// writing 2.6 GB.
	srv := testutil.DevServer(t)
	t0 := time.Now()
	want := map[int]map[string]string{}
	var ckptBytes int64
	for i := 1; i <= 2; i++ {
		want[i], ckptBytes = writeGPURecoveryCheckpoint(t, filepath.Join(ckptRoot, fmt.Sprintf("iter-%d", i)), uint64(100+i))
	}
	note("checkpoints: 2 x %d bytes, %d tensors, written in %.1fs", ckptBytes, len(want[1]), time.Since(t0).Seconds())

	url = startReceiverPy(ctx, t, host, script, logs, port)
	t.Cleanup(func() {
		// The receiver's last report (events, failures, progress) next to
		// the logs, however the test ended; before the receiver is killed.
		_, raw, err := getReceived(context.Background(), url)
		if err == nil {
			err = os.WriteFile(filepath.Join(logs, strings.ReplaceAll(t.Name(), "/", "_")+".received.json"), raw, 0o644)
		}
		if err != nil {
			t.Logf("saving the receiver's report: %v", err)
		}
	})
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()

	queue := "gpu-host-recovery"
	workerLogs := filepath.Join(logs, "step-logs")
	cf, _ := logFile(t, logs, "control-worker")
	startInGroup(t, exec.Command(bin, "worker", "--address", srv.Address, "--task-queue", queue, "--log-dir", workerLogs), cf)
	startGPU := func(n int) (*exec.Cmd, func() string, string) {
		f, p := logFile(t, logs, fmt.Sprintf("gpu-worker%d", n))
		cmd := exec.Command(bin, "worker", "--gpu", "--advertise", "127.0.0.1", "--gpu-device", strconv.Itoa(host.device),
			"--address", srv.Address, "--log-dir", workerLogs)
		cmd.Env = append(os.Environ(), "NCCL_HOSTID=rlflow-trainer", nccl.EnvNCCLLib+"="+host.ncclLib, ncclDebug())
		return cmd, startInGroup(t, cmd, f), p
	}
	gpu1, out1, log1 := startGPU(1)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)
	t.Logf("run %s started", run.GetID())

	// SIGKILL the GPU worker once iteration 1's update is under way: some
	// but not all of its chunks have arrived at the receiver.
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
	mid, err := pollReceiver(wctx, url, func(r receiverReport) (bool, error) {
		switch {
		case r.Updates > 0:
			return false, fmt.Errorf("iteration 1's update completed before the GPU worker could be killed in its middle (%d chunks): raise receiverChunkDelay", r.Progress.Chunks)
		case len(r.Failures) > 0:
			return false, fmt.Errorf("iteration 1's update failed before the kill: %+v", r.Failures)
		case exited(gpu1.Process.Pid):
			return false, errors.New("GPU worker 1 exited on its own")
		}
		p := r.Progress
		return p.Update == 1 && p.Running && p.ChunksDone > 0 && p.ChunksDone < p.Chunks, nil
	})
	wcancel()
	if err != nil {
		t.Fatalf("waiting for iteration 1's broadcast to be under way: %v\nGPU worker 1 (%s):\n%s", err, log1, tail(out1(), 4000))
	}
	killGroup(gpu1)
	tKill := time.Now()
	_, _ = gpu1.Process.Wait()
	note("SIGKILLed GPU worker 1 at chunk %d of %d (%d of %d bytes) of update 1, %.1fs after the run started",
		mid.Progress.ChunksDone, mid.Progress.Chunks, mid.Progress.BytesDone, mid.Progress.Bytes, time.Since(t0).Seconds())
	_, out2, log2 := startGPU(2)

	// The recovered broadcast: a new init, then update 2 completes.
	rctx, rcancel := context.WithTimeout(ctx, 2*time.Minute)
	rec, err := pollReceiver(rctx, url, func(r receiverReport) (bool, error) { return r.Updates >= 1, nil })
	rcancel()
	if err != nil {
		t.Fatalf("no recovered broadcast after the kill: %v\nGPU worker 2 (%s):\n%s", err, log2, tail(out2(), 4000))
	}
	kill := unixSeconds(tKill)
	if len(rec.Failures) > 0 {
		note("receiver's killed update_weights failed %+.2fs after the kill (%d of %d chunks arrived): %s",
			rec.Failures[0].At-kill, rec.Failures[0].ChunksDone, rec.Failures[0].Chunks, rec.Failures[0].Error)
	}
	if len(rec.Inits) >= 2 {
		note("re-init done %+.2fs after the kill", rec.Inits[1].At-kill)
	}
	note("recovered broadcast done %+.2fs after the kill", rec.History[0].At-kill)

	var res workflows.PipelineResult
	if err := run.Get(ctx, &res); err != nil {
		t.Fatalf("run failed: %v\nGPU worker 1 (%s):\n%s\nGPU worker 2 (%s):\n%s", err, log1, tail(out1(), 3000), log2, tail(out2(), 3000))
	}
	note("run completed %.1fs after the kill", time.Since(tKill).Seconds())
	assert.Equal(t, 2, res.Iterations)

	// Iteration 1's broadcast: attempt 1 lost with the killed worker, attempt
	// 2 on the new worker's queue, where it initialised a new group.
	iter1 := progressOf(ctx, t, c, run.GetID()+"/iter-1")
	sync1 := stepOf(t, iter1, "sync")
	assert.Equal(t, workflows.StatusSucceeded, sync1.Status)
	assert.Equal(t, 2, sync1.Attempts, "the attempt lost with the worker counts: %+v", sync1)
	assert.Equal(t, true, sync1.Outputs["initialized"], "the new worker initialised a new group: %v", sync1.Outputs)
	require.NotNil(t, sync1.GPUHost)
	queues := broadcastQueues(ctx, t, c, run.GetID()+"/iter-1")
	require.Len(t, queues, 2, "two broadcast attempts: %v", queues)
	assert.NotEqual(t, queues[0], queues[1], "the retry ran on another worker's queue")
	assert.Equal(t, sync1.GPUHost.TaskQueue, queues[1])
	note("iteration 1 broadcast: attempt %d on %s, initialized %v, %v GB/s (trainer)", sync1.Attempts, queues[len(queues)-1], sync1.Outputs["initialized"], sync1.Outputs["gb_per_s"])

	// Iteration 2 reused the new worker and its group.
	iter2 := progressOf(ctx, t, c, run.GetID()+"/iter-2")
	sync2 := stepOf(t, iter2, "sync")
	assert.Equal(t, workflows.StatusSucceeded, sync2.Status)
	assert.Equal(t, 1, sync2.Attempts)
	assert.Equal(t, sync1.GPUHost, sync2.GPUHost)
	assert.Equal(t, false, sync2.Outputs["initialized"], "the group was reused: %v", sync2.Outputs)

	// The receiver's side.
	final, _, err := getReceived(ctx, url)
	require.NoError(t, err)
	// One init per worker, each with its own TCPStore.
	require.GreaterOrEqual(t, len(final.Inits), 2, "inits: %+v", final.Inits)
	assert.Len(t, final.Inits, 2, "one init per GPU worker, the group reused in iteration 2: %+v", final.Inits)
	assert.NotEqual(t, final.Inits[0].MasterPort, final.Inits[1].MasterPort, "a fresh rendezvous for the new worker")
	assert.Greater(t, final.Inits[1].At, kill, "the second init came after the kill")
	// Exactly the killed update failed, because of the kill, within the
	// receiver's deadline, before receiving all of it.
	if assert.Len(t, final.Failures, 1, "failed updates: %+v", final.Failures) {
		f := final.Failures[0]
		assert.Equal(t, 1, f.Update)
		assert.Less(t, f.ChunksDone, f.Chunks, "the killed update did not arrive whole")
		assert.Greater(t, f.At, kill-0.5, "the update failed because of the kill")
		assert.Less(t, f.At-kill, receiverUpdateDeadline.Seconds()+10, "the killed update_weights failed within the receiver's deadline")
	}
	// Every completed update is byte-exact against its iteration's
	// checkpoint, carries its version and ran while paused.
	bytesOK := 0
	if assert.Len(t, final.History, 2, "completed updates") {
		for i, h := range final.History {
			iter := i + 1
			assert.Equal(t, fmt.Sprintf("iter-%d", iter), h.Version, "update %d's weight version", h.Update)
			assert.True(t, h.Paused, "update %d ran while generation was paused", h.Update)
			var bad []string
			for name, sum := range want[iter] {
				if h.SHA256[name] != sum {
					bad = append(bad, name)
				}
			}
			if assert.Empty(t, bad, "update %d: tensors that differ from iter-%d's checkpoint (SHA-256)", h.Update, iter) &&
				assert.Len(t, h.SHA256, len(want[iter]), "update %d: tensors received", h.Update) {
				bytesOK++
			}
			t.Logf("update %d (%s): %d tensors, receiver stats %v", h.Update, h.Version, len(h.SHA256), h.Stats)
		}
	}
	note("%d of %d completed updates byte-exact (SHA-256 of every tensor)", bytesOK, len(final.History))
	assert.Equal(t, "iter-2", final.Version)
	assert.False(t, final.SessionOpen, "no update session left open")
	// Every pause was followed by a resume (the killed attempt's iteration
	// included), and generation runs at the end.
	assert.Equal(t, []string{"pause", "resume", "pause", "resume"}, pauseResumeSequence(final), "pause/resume calls in order")
	assert.GreaterOrEqual(t, final.PauseCalls, 2, "one pause per iteration")
	assert.GreaterOrEqual(t, final.ResumeCalls, 2, "one resume per iteration")
	assert.False(t, isPaused(t, url), "resume ran after every pause")
	note("inits %d, failed updates %d, completed %d, version %s, pause/resume calls %d/%d, is_paused false",
		len(final.Inits), len(final.Failures), len(final.History), final.Version, final.PauseCalls, final.ResumeCalls)
}

// exited reports whether process pid is gone or a zombie (exited, not yet
// waited for: startCaptured's cleanup waits).
func exited(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	_, rest, ok := strings.Cut(string(b), ") ")
	return !ok || strings.HasPrefix(rest, "Z") || strings.HasPrefix(rest, "X")
}
