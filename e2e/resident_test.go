package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/trainer/trainertest"
	"github.com/rlflow/rlflow/transfer/ncclengine"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"github.com/rlflow/rlflow/vllm/double/fakeplane"
	"github.com/rlflow/rlflow/worker"
	"github.com/rlflow/rlflow/worker/gpuworker"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
)

// residentRig is a run of the resident path on a real Temporal server,
// with real processes where the failure lives: the trainer is the
// resident trainer TEST DOUBLE (`rlflow fake-trainer`, a separate process
// the GPU worker starts, kills and restarts); the GPU worker runs in this
// process over the fake NCCL (nccltest.Fake), whose fake CUDA IPC maps the
// trainer's snapshot file, and broadcasts it to the vLLM double through the
// fake data plane (fakeplane): so the bytes the double ends up serving are
// the ones the trainer published, through the engine's zero-copy path. The
// GPU tests (transfer/ncclengine) run the same path over real CUDA IPC and
// NCCL.
type residentRig struct {
	t     *testing.T
	c     client.Client
	queue string
	addr  string // the double's address: every run's rollouts name it
}

func newResidentRig(t *testing.T) *residentRig {
	srv := testutil.DevServer(t)
	ctx := context.Background()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	t.Cleanup(c.Close)
	r := &residentRig{t: t, c: c, queue: "resident-" + t.Name()}
	w, err := worker.NewControl(c, worker.Options{TaskQueue: r.queue, Deps: activities.Deps{LogDir: t.TempDir()}})
	require.NoError(t, err)
	require.NoError(t, w.Start())
	t.Cleanup(w.Stop)

	// One port for every double of the test: the rollouts record the
	// server that answered, and the trainer learns from every byte of them.
	r.addr = fmt.Sprintf("127.0.0.1:%d", testutil.RebindablePort(t))
	return r
}

// gpuWorker starts an in-process GPU worker over a fresh fake NCCL and a
// fresh double (untrained, seed 7) of backend: nccl, whose data plane joins
// that fake, or ipc, on the fake trainer's GPU, opening its snapshot file.
func (r *residentRig) gpuWorker(queue, backend string) (*fakeplane.Receiver, *double.Server, func()) {
	t := r.t
	fake := nccltest.NewFake(nccltest.Config{Devices: 2, DeviceMemory: 256 << 20})
	recv := &fakeplane.Receiver{F: fake}
	cfg := double.Config{Generation: double.GenE, Backend: double.BackendNCCL, DevMode: true,
		NCCLReceiver: recv, RendezvousTimeout: 10 * time.Second, Seed: 7}
	if backend == pipelines.BackendIPC {
		cfg = double.Config{Generation: double.GenE, Backend: double.BackendIPC, DevMode: true, Seed: 7,
			GPUUUID: trainertest.FakeGPUUUID, IPCOpener: double.FileIPC{}, AllowInsecureSerialization: true}
	}
	dbl, err := double.New(cfg)
	require.NoError(t, err)
	var l net.Listener
	require.Eventually(t, func() bool { l, err = net.Listen("tcp", r.addr); return err == nil }, 5*time.Second, 20*time.Millisecond)
	hs := &http.Server{Handler: dbl.Handler()}
	go hs.Serve(l)

	engine, err := ncclengine.New(ncclengine.Config{API: fake, IPC: fake, Device: 0, Advertise: "127.0.0.1",
		Staging: staging.Options{DeviceMargin: 1 << 20}, Comm: []nccl.CommOption{nccl.WithPollInterval(20*time.Microsecond, time.Millisecond)}})
	require.NoError(t, err)
	g, err := gpuworker.New(r.c, gpuworker.Options{SharedQueue: queue, Engine: engine, Host: "resident-host"})
	require.NoError(t, err)
	require.NoError(t, g.Start())
	stop := func() {
		g.Stop()
		engine.Close()
		recv.CloseComms()
		hs.Close()
		dbl.Close()
	}
	return recv, dbl, stop
}

// spec is the resident loop: generate from the double, train the resident
// trainer on the rollouts, pause, publish, resume; checkpoints every 2
// iterations. die is the fake trainer's fault knob ("" none).
func (r *residentRig) spec(base, gpuQueue, die, backend string) *pipelines.Pipeline {
	t := r.t
	require.NoError(t, os.WriteFile(filepath.Join(base, "prompts.jsonl"),
		[]byte("{\"id\": \"a\", \"prompt\": \"the cat\"}\n{\"id\": \"b\", \"prompt\": \"a dog\"}\n"), 0o644))
	env := map[string]string{
		// The double's one weight: the trainer's model is its shape.
		"RLFLOW_FAKE_TRAINER_SHAPES":     bigram.TensorName + "=128x128",
		"RLFLOW_FAKE_TRAINER_SEED":       "3",
		"RLFLOW_FAKE_TRAINER_SHM_DIR":    t.TempDir(),
		"RLFLOW_FAKE_TRAINER_MARKER_DIR": t.TempDir(),
	}
	if die != "" {
		env["RLFLOW_FAKE_TRAINER_DIE"] = die
	}
	retry := &pipelines.RetryPolicy{MaxAttempts: 3, InitialInterval: pipelines.Duration(100 * time.Millisecond)}
	return &pipelines.Pipeline{
		Version: 1, Name: "resident-e2e", BaseDir: base, Loop: pipelines.Loop{Iterations: 4},
		Servers:        []pipelines.Server{{URL: "http://" + r.addr}},
		WeightTransfer: &pipelines.WeightTransfer{Backend: backend, GPUTaskQueue: gpuQueue},
		Trainer: &pipelines.Trainer{
			Command: []string{testutil.RlflowBinary(t), "fake-trainer"}, Env: env,
			CheckpointDir: "checkpoints", CheckpointEvery: 2,
			StartTimeout: pipelines.Duration(30 * time.Second), KillGrace: pipelines.Duration(time.Second),
		},
		Defaults: pipelines.StepDefaults{Timeout: pipelines.Duration(time.Minute), Heartbeat: pipelines.Duration(10 * time.Second), Retry: retry},
		Steps: []pipelines.Step{
			{ID: "rollout", Uses: pipelines.StepGenerate, With: map[string]any{"prompts": "prompts.jsonl", "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": 5}},
			{ID: "train", Uses: pipelines.StepTrain, Needs: []string{"rollout"}, Outputs: []string{"loss"},
				With: map[string]any{"rollouts": "${{ steps.rollout.outputs.path }}"}},
			{ID: "pause", Uses: pipelines.StepPause, Needs: []string{"train"}, With: map[string]any{"mode": "keep"}},
			{ID: "sync", Uses: pipelines.StepPublish, Needs: []string{"pause"}, With: map[string]any{"version": "iter-${{ loop.iteration }}", "verify": true}},
			{ID: "resume", Uses: pipelines.StepResume, Needs: []string{"sync"}, Always: true},
		},
	}
}

// run runs spec to completion over nccl and returns what the double
// received last, and the progress of every iteration's train and sync
// steps.
func (r *residentRig) run(name, die string) (last map[string][]byte, train, sync []workflows.StepResult) {
	t := r.t
	var recv *fakeplane.Receiver
	train, sync = r.runWith(name, die, pipelines.BackendNCCL, func(rv *fakeplane.Receiver, _ *double.Server) { recv = rv })
	got := recv.Received()
	require.Len(t, got, 4, "one update per iteration reached the double")
	return got[3], train, sync
}

// runWith runs spec over backend to completion, hands done the GPU
// worker's double (and its NCCL receiver) before they stop, and returns
// the progress of every iteration's train and sync steps.
func (r *residentRig) runWith(name, die, backend string, done func(*fakeplane.Receiver, *double.Server)) (train, sync []workflows.StepResult) {
	t := r.t
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	gpuQueue := "rlflow-gpu-" + name
	recv, dbl, stop := r.gpuWorker(gpuQueue, backend)
	defer stop()
	spec := r.spec(t.TempDir(), gpuQueue, die, backend)
	run, err := runs.Start(ctx, r.c, runs.StartOptions{Spec: spec, TaskQueue: r.queue, ID: "resident-" + name})
	require.NoError(t, err)
	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res), "run %s", name)
	require.Equal(t, 4, res.Iterations)
	for i := 1; i <= 4; i++ {
		p := progressOf(ctx, t, r.c, fmt.Sprintf("%s/iter-%d", run.GetID(), i))
		train = append(train, stepOf(t, p, "train"))
		sync = append(sync, stepOf(t, p, "sync"))
	}
	done(recv, dbl)
	return train, sync
}

// The resident trainer SIGKILLed in the middle of iteration 4's training:
// the step is retried, the GPU worker restarts the trainer from iteration
// 2's checkpoint and replays iteration 3 from its rollouts, the run
// completes, and the weights the double ends up serving are byte for byte
// an undisturbed run's.
func TestResidentTrainerSIGKILLedMidIteration(t *testing.T) {
	r := newResidentRig(t)
	calm, calmTrain, calmSync := r.run("calm", "")
	killed, train, sync := r.run("killed", "train:4")

	require.Contains(t, calm, bigram.TensorName)
	assert.Equal(t, calm[bigram.TensorName], killed[bigram.TensorName], "the weights after iteration 4 differ from the undisturbed run's")

	for i := range 4 {
		assert.Equal(t, false, calmTrain[i].Outputs["restarted"], "calm iteration %d", i+1)
		assert.Equal(t, calmTrain[i].Outputs["loss"], train[i].Outputs["loss"], "iteration %d's loss", i+1)
		assert.Equal(t, float64(i+1), sync[i].Outputs["iteration"], "iteration %d's publish", i+1)
		assert.Equal(t, calmSync[i].Outputs["bytes"], sync[i].Outputs["bytes"])
	}
	assert.Equal(t, 1, calmTrain[0].Attempts)
	k := train[3]
	assert.Equal(t, 2, k.Attempts, "iteration 4's train: the killed attempt and its retry")
	assert.Equal(t, true, k.Outputs["restarted"])
	assert.Equal(t, float64(2), k.Outputs["restored_from"])
	assert.Equal(t, []any{float64(3)}, k.Outputs["replayed"])
	assert.Equal(t, float64(2), k.Outputs["trainer_generation"])
	assert.Contains(t, k.Outputs["restart_cause"], "signal")
	assert.Equal(t, false, train[2].Outputs["restarted"], "iteration 3 trained once, before the kill")
}

// The same loop over vLLM's ipc backend (trainer and server on one GPU):
// every publish hands the double the fake trainer's snapshot as CUDA IPC
// handles in update_info, one rebuild_cuda_tensor per tensor (the double
// opens the fake_shm file as the handle's memory), and the double ends on
// the bytes the nccl run's broadcasts delivered: the same weights by
// either backend.
func TestResidentTrainerOverIPC(t *testing.T) {
	r := newResidentRig(t)
	viaNCCL, _, _ := r.run("nccl", "")
	var served []byte
	var refs double.IPCRefs
	train, sync := r.runWith("ipc", "", pipelines.BackendIPC, func(_ *fakeplane.Receiver, d *double.Server) {
		served, refs = d.Model().Bytes(), d.IPCRefs()
	})
	require.Contains(t, viaNCCL, bigram.TensorName)
	assert.Equal(t, viaNCCL[bigram.TensorName], served, "the weights the ipc backend loaded after iteration 4 differ from the nccl run's")
	assert.Equal(t, 4, refs.Held+refs.Released, "one ref-counter share per tensor per publish")
	for i := range 4 {
		assert.Equal(t, "ipc", sync[i].Outputs["backend"], "iteration %d's publish", i+1)
		assert.Equal(t, []any{"ipc"}, sync[i].Outputs["methods"], "iteration %d's publish", i+1)
		assert.Equal(t, float64(i+1), sync[i].Outputs["iteration"], "iteration %d's publish", i+1)
		assert.Equal(t, 1, train[i].Attempts)
	}
}
