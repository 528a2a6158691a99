package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/procs"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
)

// controlPlaneOnlyReceiver is a CONTROL-PLANE-ONLY test receiver for the
// vLLM double's NCCL backend (double.Config.NCCLReceiver).
//
// On a CPU machine the GPU worker runs a fake NCCL inside its own process,
// so no bytes can travel from it to the double: this receiver joins no
// communicator and receives nothing. What it does instead: it records every
// init (the double has already done the real TCPStore rendezvous with the
// GPU worker by then), checks each update's metadata (names, dtypes,
// shapes) against the checkpoint the test wrote for that iteration, holds
// the update for a configurable time in place of the broadcast (long enough
// to SIGKILL the GPU worker mid-transfer), and then hands the double the
// tensors the TEST read from that checkpoint. So this test proves the
// routing, the loss detection, the re-acquire and the re-initialisation
// against real processes and a real Temporal server; it does not prove that
// broadcast bytes arrive intact (the GPU tests in nccl/ do, on a GPU).
type controlPlaneOnlyReceiver struct {
	hold time.Duration
	// iteration says which iteration an update belongs to; the metadata
	// alone cannot (every checkpoint has the same tensor names and shapes).
	iteration func() int
	ckpts     map[int]string // iteration -> checkpoint directory
	receiving chan int       // gets the iteration of each update that passed the checks

	mu       sync.Mutex
	inits    []double.NCCLInit
	outcomes []string // per update: "ok", "cancelled" or the error
}

func (r *controlPlaneOnlyReceiver) Init(_ context.Context, in double.NCCLInit) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inits = append(r.inits, in)
	return nil
}

func (r *controlPlaneOnlyReceiver) Receive(ctx context.Context, u double.NCCLUpdate) ([]double.Tensor, error) {
	tensors, err := r.receive(ctx, u)
	outcome := "ok"
	switch {
	case err != nil && ctx.Err() != nil:
		outcome = "cancelled"
	case err != nil:
		outcome = err.Error()
	}
	r.mu.Lock()
	r.outcomes = append(r.outcomes, outcome)
	r.mu.Unlock()
	return tensors, err
}

func (r *controlPlaneOnlyReceiver) receive(ctx context.Context, u double.NCCLUpdate) ([]double.Tensor, error) {
	iter := r.iteration()
	dir, ok := r.ckpts[iter]
	if !ok {
		return nil, fmt.Errorf("test receiver: no checkpoint for iteration %d", iter)
	}
	want, err := readCheckpoint(dir)
	if err != nil {
		return nil, err
	}
	if len(u.Names) != len(want) {
		return nil, fmt.Errorf("test receiver: update has %d tensors %v, checkpoint %s has %d", len(u.Names), u.Names, dir, len(want))
	}
	for i, w := range want {
		if u.Names[i] != w.Name || u.DTypeNames[i] != w.DType || !slices.Equal(u.Shapes[i], w.Shape) {
			return nil, fmt.Errorf("test receiver: tensor %d is %s %s %v, checkpoint %s has %s %s %v",
				i, u.Names[i], u.DTypeNames[i], u.Shapes[i], dir, w.Name, w.DType, w.Shape)
		}
	}
	r.receiving <- iter
	t := time.NewTimer(r.hold)
	defer t.Stop()
	select {
	case <-t.C:
		return want, nil
	case <-ctx.Done(): // the sender died: the double's request ended
		return nil, ctx.Err()
	}
}

func (r *controlPlaneOnlyReceiver) snapshot() ([]double.NCCLInit, []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.inits), slices.Clone(r.outcomes)
}

// readCheckpoint reads every tensor of a safetensors checkpoint.
func readCheckpoint(path string) ([]double.Tensor, error) {
	c, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		return nil, fmt.Errorf("test receiver: %w", err)
	}
	defer c.Close()
	var out []double.Tensor
	for _, ti := range c.Tensors() {
		b, err := c.Bytes(ti)
		if err != nil {
			return nil, fmt.Errorf("test receiver: %s: %w", ti.Name, err)
		}
		out = append(out, double.Tensor{Name: ti.Name, DType: ti.DType.TorchName(), Shape: ti.Shape, Data: slices.Clone(b)})
	}
	return out, nil
}

// writeCheckpoints writes one bigram checkpoint directory per iteration
// (bigram.logits F32 [128,128], which the double can load), each with
// different weights so that the double's final model names the iteration.
func writeCheckpoints(t *testing.T, root string, iterations int) (map[int]string, map[int]*bigram.Model) {
	t.Helper()
	dirs, models := map[int]string{}, map[int]*bigram.Model{}
	for i := 1; i <= iterations; i++ {
		dir := filepath.Join(root, fmt.Sprintf("iter-%d", i))
		m := bigram.Random(uint64(1000 + i))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, m.Save(filepath.Join(dir, "model.safetensors")))
		dirs[i], models[i] = dir, m
	}
	return dirs, models
}

func TestControlPlaneOnlyReceiverChecksMetadata(t *testing.T) {
	dirs, models := writeCheckpoints(t, t.TempDir(), 1)
	r := &controlPlaneOnlyReceiver{hold: time.Millisecond, iteration: func() int { return 1 }, ckpts: dirs, receiving: make(chan int, 4)}
	good := double.NCCLUpdate{Names: []string{bigram.TensorName}, DTypeNames: []string{"float32"}, Shapes: [][]int64{{128, 128}}}
	got, err := r.Receive(context.Background(), good)
	require.NoError(t, err)
	m, err := bigram.FromTensor(got[0].DType, got[0].Shape, got[0].Data)
	require.NoError(t, err)
	assert.Equal(t, models[1].Checksum(), m.Checksum())

	for _, bad := range []double.NCCLUpdate{
		{Names: []string{"other"}, DTypeNames: []string{"float32"}, Shapes: [][]int64{{128, 128}}},
		{Names: []string{bigram.TensorName}, DTypeNames: []string{"bfloat16"}, Shapes: [][]int64{{128, 128}}},
		{Names: []string{bigram.TensorName}, DTypeNames: []string{"float32"}, Shapes: [][]int64{{128, 64}}},
		{},
	} {
		_, err := r.Receive(context.Background(), bad)
		assert.Error(t, err, "%+v", bad)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r.hold = time.Hour
	_, err = r.Receive(ctx, good)
	require.ErrorIs(t, err, context.Canceled)
	_, outcomes := r.snapshot()
	assert.Equal(t, "cancelled", outcomes[len(outcomes)-1])
}

// gpuRecoveryPipeline is pause(keep) -> broadcast (nccl) -> resume (always),
// twice. The heartbeat is short so that the killed worker is noticed fast.
const gpuRecoveryPipeline = `version: 1
name: gpu-recovery
params:
  ckpt_root: {type: string, required: true}
servers:
  - {url: "%s", api: C}
weight_transfer: {backend: nccl, packed: true, buffer_bytes: 64KiB, gpu_start_timeout: 5s}
loop: {iterations: 2}
defaults:
  timeout: 2m
  heartbeat: 2s
  retry: {max_attempts: 3, initial_interval: 200ms}
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
  - id: resume
    uses: resume
    needs: [sync]
    always: true
`

// requireGPUWorkerCommand fails unless this rlflow build has the GPU worker
// (rlflow worker --gpu).
func requireGPUWorkerCommand(t *testing.T, bin string) {
	t.Helper()
	out, err := exec.Command(bin, "worker", "--help").CombinedOutput()
	require.NoError(t, err, "rlflow worker --help:\n%s", out)
	// The GPU worker is part of every build: a missing flag is a regression,
	// not a reason to skip.
	require.Contains(t, string(out), "--gpu", "rlflow worker --help lists no --gpu flag")
}

func startGPUWorker(t *testing.T, bin, addr, logDir string) (*exec.Cmd, func() string) {
	t.Helper()
	cmd := exec.Command(bin, "worker", "--gpu", "--fake-nccl", "--advertise", "127.0.0.1", "--address", addr, "--log-dir", logDir)
	return cmd, startCaptured(t, cmd, nil)
}

// startCaptured starts cmd with its stdout and stderr captured (read with
// the returned func) and, when tee is not nil, copied there as well; the
// process is killed at cleanup.
func startCaptured(t *testing.T, cmd *exec.Cmd, tee io.Writer) func() string {
	t.Helper()
	var mu sync.Mutex
	var out strings.Builder
	w := writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		if tee != nil {
			_, _ = tee.Write(p)
		}
		return out.Write(p)
	})
	cmd.Stdout, cmd.Stderr = w, w
	// Wait (not Process.Wait) drains the output into tee before cleanup
	// closes it; WaitDelay bounds that when a child still holds the pipe.
	cmd.WaitDelay = 5 * time.Second
	require.NoError(t, procs.Start(cmd)) // Pdeathsig where cmd sets it: see procs.Start
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return func() string { mu.Lock(); defer mu.Unlock(); return out.String() }
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func TestGPUWorkerSIGKILLDuringBroadcast(t *testing.T) {
	// Everything up to the pipeline's load runs even while the test must
	// skip, so that a broken pipeline or double setup shows now.
	dir := t.TempDir()
	ckptRoot := filepath.Join(dir, "ckpt")
	dirs, models := writeCheckpoints(t, ckptRoot, 2)

	var dbl *double.Server
	recv := &controlPlaneOnlyReceiver{
		hold: 3 * time.Second,
		// Each iteration pauses the server once before its broadcast.
		iteration: func() int { return dbl.Stats().Requests["POST /pause"] },
		ckpts:     dirs,
		receiving: make(chan int, 8),
	}
	dbl, err := double.New(double.Config{Generation: double.GenC, Backend: double.BackendNCCL, DevMode: true, NCCLReceiver: recv, Seed: 7})
	require.NoError(t, err)
	defer dbl.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dctx, stopDouble := context.WithCancel(context.Background())
	defer stopDouble()
	go func() { _ = dbl.Serve(dctx, ln) }()
	url := "http://" + ln.Addr().String()

	file := filepath.Join(dir, "gpu-recovery.yaml")
	require.NoError(t, os.WriteFile(file, []byte(fmt.Sprintf(gpuRecoveryPipeline, url)), 0o644))
	spec, err := pipelines.LoadFile(file)
	require.NoError(t, err)
	params, err := spec.ResolveParams(map[string]string{"ckpt_root": ckptRoot})
	require.NoError(t, err)

	bin := testutil.RlflowBinary(t)
	requireGPUWorkerCommand(t, bin)
	srv := testutil.DevServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "gpu-recovery"
	logs := filepath.Join(dir, "logs")
	startWorker(t, bin, srv.Address, queue, logs)
	gpu1, out1 := startGPUWorker(t, bin, srv.Address, logs)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	// Kill the GPU worker once the double is inside iteration 1's
	// update_weights, i.e. mid-broadcast.
	select {
	case it := <-recv.receiving:
		require.Equal(t, 1, it)
	case <-ctx.Done():
		t.Fatalf("the double never received iteration 1's update_weights; GPU worker output:\n%s", out1())
	}
	require.NoError(t, gpu1.Process.Signal(syscall.SIGKILL))
	_, _ = gpu1.Process.Wait()
	_, out2 := startGPUWorker(t, bin, srv.Address, logs)

	var res workflows.PipelineResult
	if err := run.Get(ctx, &res); err != nil {
		t.Fatalf("run failed: %v\nfirst GPU worker:\n%s\nsecond GPU worker:\n%s", err, out1(), out2())
	}
	assert.Equal(t, 2, res.Iterations)

	// Iteration 1's broadcast: attempt 1 on the killed worker's queue,
	// attempt 2 on another one, where it re-initialised the group.
	iter1 := progressOf(ctx, t, c, run.GetID()+"/iter-1")
	sync1 := stepOf(t, iter1, "sync")
	assert.Equal(t, workflows.StatusSucceeded, sync1.Status)
	assert.Equal(t, 2, sync1.Attempts, "the attempt lost with the worker counts")
	assert.Equal(t, true, sync1.Outputs["initialized"], "the second worker initialised a new group")
	require.NotNil(t, sync1.GPUHost)
	queues := broadcastQueues(ctx, t, c, run.GetID()+"/iter-1")
	require.Len(t, queues, 2, "two broadcast attempts: %v", queues)
	assert.NotEqual(t, queues[0], queues[1], "the retry ran on another worker's queue")
	assert.Equal(t, sync1.GPUHost.TaskQueue, queues[1])

	// Iteration 2 reused the second worker and its group.
	iter2 := progressOf(ctx, t, c, run.GetID()+"/iter-2")
	sync2 := stepOf(t, iter2, "sync")
	assert.Equal(t, 1, sync2.Attempts)
	assert.Equal(t, sync1.GPUHost, sync2.GPUHost)
	assert.Equal(t, false, sync2.Outputs["initialized"], "the group was reused")

	// The double: two inits (one per worker) on different TCPStore ports, the
	// killed update cancelled, both iterations' updates loaded, resumed.
	inits, outcomes := recv.snapshot()
	require.Len(t, inits, 2)
	assert.NotEqual(t, inits[0].MasterPort, inits[1].MasterPort, "a fresh rendezvous for the new worker")
	assert.Equal(t, []string{"cancelled", "ok", "ok"}, outcomes)
	assert.Equal(t, "iter-2", dbl.WeightVersion())
	assert.Equal(t, models[2].Checksum(), dbl.Model().Checksum(), "the double serves iteration 2's weights")
	assert.False(t, isPaused(t, url), "resume ran after every pause")
}

func progressOf(ctx context.Context, t *testing.T, c client.Client, id string) workflows.Progress {
	t.Helper()
	v, err := c.QueryWorkflow(ctx, id, "", workflows.QueryProgress)
	require.NoError(t, err, "query %s", id)
	var p workflows.Progress
	require.NoError(t, v.Get(&p))
	return p
}

func stepOf(t *testing.T, p workflows.Progress, id string) workflows.StepResult {
	t.Helper()
	for _, s := range p.Steps {
		if s.ID == id {
			return s
		}
	}
	t.Fatalf("no step %s in %+v", id, p)
	return workflows.StepResult{}
}

// broadcastQueues lists the task queue of every broadcast activity an
// iteration scheduled, in order.
func broadcastQueues(ctx context.Context, t *testing.T, c client.Client, id string) []string {
	t.Helper()
	var qs []string
	for _, ev := range history(ctx, t, c, id) {
		if a := ev.GetActivityTaskScheduledEventAttributes(); a != nil && a.GetActivityType().GetName() == pipelines.StepBroadcast {
			qs = append(qs, a.GetTaskQueue().GetName())
		}
	}
	return qs
}

func isPaused(t *testing.T, url string) bool {
	t.Helper()
	resp, err := http.Get(url + "/is_paused")
	require.NoError(t, err)
	defer resp.Body.Close()
	var body struct {
		IsPaused bool `json:"is_paused"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&body))
	return body.IsPaused
}
