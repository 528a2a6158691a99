//go:build linux

package e2e

// TestGPUResidentPipelineSIGKILL is issue 18's acceptance as a real
// pipeline on the GPU: "the resident trainer SIGKILLed mid-iteration:
// restarted from the last durable checkpoint, the run completes, and the
// weights vLLM ends with are byte-identical to an undisturbed run's".
// TestResidentTrainerSIGKILLedMidIteration is its CPU variant (fake trainer,
// fake NCCL); transfer/ncclengine's TestGPUResidentSIGKILL drives the same
// pieces without Temporal.
//
// Everything real: a Temporal dev server; the control worker and the GPU
// worker in this process, the GPU worker over the real NCCL engine with
// the CUDA IPC importer (as `rlflow worker --gpu` builds it); the resident
// trainer tests/gpu/bench_trainer.py (bench_seed.py's bf16 model and Adam,
// ~64 MiB, fixed seed) started and supervised by the GPU worker; the one
// vLLM server tests/gpu/receiver.py --http --api E, with its own
// NCCL_HOSTID on a shared GPU. Each iteration trains on a fixed rollouts
// file, pauses the server, publishes the trainer's weights (device
// snapshot, CUDA IPC, NCCL broadcast, weight version verified) and
// resumes. Run A is undisturbed; run B (same seed, same rollouts) has its
// trainer SIGKILLed inside iteration 5's train, after the optimizer step
// and before the reply. Both runs go to the same receiver, whose history
// keeps the SHA-256 of every tensor of every update.
//
// It skips, saying why, without NCCL and the CUDA runtime, a GPU, a Python
// whose torch sees CUDA, or the Temporal CLI. Environment: gputest's
// (RLFLOW_NCCL_LIB, RLFLOW_GPU_DEVICE, RLFLOW_GPU_PLACEMENT,
// RLFLOW_GPU_LOGS, RLFLOW_GPU_SCRIPTS), RLFLOW_PYTHON (default python3),
// RECEIVER_NCCL_LIB (the receiver's libnccl: the same build as
// RLFLOW_NCCL_LIB), RLFLOW_TEMPORAL (the Temporal CLI). The command is in
// tests/gpu/resident-run.sh (ONLY=e2e).

import (
	"bufio"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/cudaipc"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer/ncclengine"
	"github.com/rlflow/rlflow/worker"
	"github.com/rlflow/rlflow/worker/gpuworker"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
)

const (
	// residentIterations, residentEvery and residentKillAt: run B's
	// trainer dies in iteration 5, whose last durable checkpoint is ckpt-4.
	residentIterations = 6
	residentEvery      = 2
	residentKillAt     = 5
	// residentKillSleep is how long the train of iteration residentKillAt
	// sleeps after its optimizer step in run B, once it wrote its mark:
	// the window the test kills the trainer in. The retried attempt
	// sleeps again (a retry gets the same args), which costs run B this
	// much.
	residentKillSleep = 10
	// residentBudget bounds the whole test (about 2 minutes expected on
	// the H200: three trainer starts, twelve iterations, the retried
	// attempt's sleep); resident-run.sh's e2e step allows a little more.
	residentBudget = 4 * time.Minute
	// residentModel is bench_trainer.py's model: 64 MiB of bf16
	// Linear(1024, 1024) layers.
	residentModel  = "64MiB"
	residentHidden = 1024
)

// residentGPURig is what both runs share: the server, the workers and
// the receiver.
type residentGPURig struct {
	t        *testing.T
	c        client.Client
	queue    string // the control worker's
	gpuQueue string // the GPU worker's shared queue
	backend  string // the runs' weight_transfer.backend (nccl unless set)
	url      string // receiver.py of backend
	py       string // absolute: a trainer's command[0] must be
	script   string // bench_trainer.py
	helper   string // trainer/python: rlflow_trainer on PYTHONPATH
	logs     string
	start    time.Time
}

// residentGPURun is what one run did, read from its iterations' progress.
type residentGPURun struct {
	id      string
	train   map[int]workflows.StepResult
	publish map[int]workflows.StepResult
	final   string // ckpt-<residentIterations>/model.safetensors
}

// trainerKill is what the test SIGKILLed.
type trainerKill struct {
	pid, generation int
	at              time.Time
}

// residentRollouts writes rollouts-<i>.jsonl for every iteration under dir,
// in the format bench_trainer.py reads: a reward that differs per
// iteration (it scales the loss by the mean reward, so a replay or a
// retry on the wrong file would show in the weights).
func residentRollouts(t *testing.T, dir string) {
	t.Helper()
	for i := 1; i <= residentIterations; i++ {
		var b strings.Builder
		for j := range 4 {
			fmt.Fprintf(&b, "{\"prompt\": \"q%d\", \"text\": \"answer %d.%d\", \"reward\": %.2f}\n", j, i, j, 0.5+0.1*float64(i)+0.05*float64(j))
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("rollouts-%d.jsonl", i)), []byte(b.String()), 0o644))
	}
}

// residentTrainArgs is the train step's with.args: in the iteration
// killAt (0: none) bench_trainer.py writes mark-<iteration> under markDir
// after its optimizer step and then sleeps; in every other iteration it
// sleeps 0 and writes nothing. The two runs' specs differ only in killAt.
func residentTrainArgs(markDir string, killAt int) map[string]any {
	return map[string]any{
		"sleep": fmt.Sprintf("${{ loop.iteration == %d ? %d : 0 }}", killAt, residentKillSleep),
		"mark":  filepath.Join(markDir, "mark-${{ loop.iteration }}"),
	}
}

// spec is the resident loop over receiver.py: train on the iteration's
// rollouts, pause (keep), publish (verified), resume; checkpoints every
// residentEvery iterations.
func (r *residentGPURig) spec(base string, killAt int) *pipelines.Pipeline {
	retry := &pipelines.RetryPolicy{MaxAttempts: 3, InitialInterval: pipelines.Duration(500 * time.Millisecond)}
	return &pipelines.Pipeline{
		Version: 1, Name: "resident-gpu-e2e", BaseDir: base, Loop: pipelines.Loop{Iterations: residentIterations},
		Servers:        []pipelines.Server{{URL: r.url, API: "E"}},
		WeightTransfer: &pipelines.WeightTransfer{Backend: cmp.Or(r.backend, pipelines.BackendNCCL), GPUTaskQueue: r.gpuQueue},
		Trainer: &pipelines.Trainer{
			Command: []string{r.py, r.script, "--model-bytes", residentModel, "--hidden", strconv.Itoa(residentHidden), "--seed", "7"},
			Dir:     base,
			Env: map[string]string{
				"PYTHONPATH": r.helper,
				// cuBLAS's deterministic workspace (read when its first
				// handle is made) and the allocator mode CUDA IPC can
				// export, as transfer/ncclengine's resident tests run it.
				"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
				"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
				"PYTHONUNBUFFERED":        "1",
			},
			CheckpointDir: "checkpoints", CheckpointEvery: residentEvery,
			// import torch, CUDA init, the model: seconds to tens of
			// seconds on a busy host.
			StartTimeout: pipelines.Duration(3 * time.Minute), KillGrace: pipelines.Duration(10 * time.Second),
		},
		Defaults: pipelines.StepDefaults{Timeout: pipelines.Duration(4 * time.Minute), Heartbeat: pipelines.Duration(30 * time.Second), Retry: retry},
		Steps: []pipelines.Step{
			{ID: "train", Uses: pipelines.StepTrain, Outputs: []string{"loss"}, With: map[string]any{
				"rollouts": "rollouts-${{ loop.iteration }}.jsonl",
				"args":     residentTrainArgs(filepath.Join(base, "marks"), killAt),
			}},
			{ID: "pause", Uses: pipelines.StepPause, Needs: []string{"train"}, With: map[string]any{"mode": "keep"}},
			{ID: "publish", Uses: pipelines.StepPublish, Needs: []string{"pause"}, With: map[string]any{"version": "iter-${{ loop.iteration }}", "verify": true}},
			{ID: "resume", Uses: pipelines.StepResume, Needs: []string{"publish"}, Always: true},
		},
	}
}

// checkSpec validates spec as the worker will (runs.Start does the same);
// on a CPU machine this is the part of the test that runs.
func checkSpec(t *testing.T, spec *pipelines.Pipeline) {
	t.Helper()
	b, err := json.Marshal(spec)
	require.NoError(t, err)
	_, err = pipelines.LoadJSON(pipelines.InlineSpec, b)
	require.NoError(t, err, "the resident pipeline does not validate")
}

func (r *residentGPURig) phase(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "resident-e2e %6.1fs: %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func TestGPUResidentPipelineSIGKILL(t *testing.T) {
	// What a CPU machine can check runs first: the scripts exist and both
	// runs' pipelines validate and render the kill's args as meant.
	r, env := newResidentGPURig(t, func(r *residentGPURig) {
		checkSpec(t, r.spec(t.TempDir(), 0))
		checkSpec(t, r.spec(t.TempDir(), residentKillAt))
		for _, c := range []struct {
			iter  int
			sleep any
		}{{residentKillAt, residentKillSleep}, {residentKillAt - 1, 0}} {
			got, err := pipelines.Render(residentTrainArgs("/marks", residentKillAt), pipelines.Env{Iteration: c.iter})
			require.NoError(t, err)
			require.Equal(t, map[string]any{"sleep": c.sleep, "mark": fmt.Sprintf("/marks/mark-%d", c.iter)}, got, "iteration %d's train args", c.iter)
		}
	})
	ctx := env.ctx
	r.phase("receiver")
	r.url = env.startReceiver(pipelines.BackendNCCL)
	env.startWorkers()

	a := r.run(ctx, "resident-gpu-calm", 0)
	b := r.run(ctx, "resident-gpu-killed", residentKillAt)
	r.phase("comparing")

	// The steps: every train and publish of A once, unrestarted; in B the
	// train of iteration 5 restarted generation 2 from ckpt-4 with
	// nothing to replay, every other step once.
	for i := 1; i <= residentIterations; i++ {
		for _, run := range []residentGPURun{a, b} {
			tr, pub := run.train[i], run.publish[i]
			if run.id == b.id && i == residentKillAt {
				gputest.Verdict(t, tr.Attempts == 2 && tr.Outputs["restarted"] == true && tr.Outputs["restored_from"] == float64(residentKillAt-1) &&
					isEmptyList(tr.Outputs["replayed"]) && tr.Outputs["trainer_generation"] == float64(2) &&
					strings.Contains(fmt.Sprint(tr.Outputs["restart_cause"]), "signal"),
					"run %s: the train of iteration %d, whose trainer was SIGKILLed inside it: attempts %d, restarted %v, restored_from %v, replayed %v, trainer_generation %v, restart_cause %q (want 2, true, %d, [], 2, a signal)",
					run.id, i, tr.Attempts, tr.Outputs["restarted"], tr.Outputs["restored_from"], tr.Outputs["replayed"],
					tr.Outputs["trainer_generation"], tr.Outputs["restart_cause"], residentKillAt-1)
			} else {
				gen := float64(1)
				if run.id == b.id && i > residentKillAt {
					gen = 2
				}
				gputest.Verdict(t, tr.Attempts == 1 && tr.Outputs["restarted"] == false && tr.Outputs["trainer_generation"] == gen,
					"run %s: the train of iteration %d: attempts %d, restarted %v, trainer_generation %v (want 1, false, %v)",
					run.id, i, tr.Attempts, tr.Outputs["restarted"], tr.Outputs["trainer_generation"], gen)
			}
			gputest.Verdict(t, pub.Attempts == 1 && pub.Outputs["restarted"] == false && pub.Outputs["iteration"] == float64(i) &&
				pub.Outputs["version"] == fmt.Sprintf("iter-%d", i),
				"run %s: the publish of iteration %d: attempts %d, restarted %v, the trainer's iteration %v, version %v, %v bytes in %vs (snapshot %vs, %v GB/s, initialized %v)",
				run.id, i, pub.Attempts, pub.Outputs["restarted"], pub.Outputs["iteration"], pub.Outputs["version"],
				pub.Outputs["bytes"], pub.Outputs["seconds"], pub.Outputs["snapshot_seconds"], pub.Outputs["gb_per_s"], pub.Outputs["initialized"])
		}
		la, lb := a.train[i].Outputs["loss"], b.train[i].Outputs["loss"]
		gputest.Verdict(t, la != nil && la == lb, "iteration %d's loss: run B %v, run A %v", i, lb, la)
	}

	// The receiver: one update per publish, A's then B's, each paused and
	// named by its version, none failed; after every iteration B's bytes
	// are A's, and each run ends on its own last checkpoint's bytes.
	rep, raw, err := getReceived(ctx, r.url)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(r.logs, strings.ReplaceAll(t.Name(), "/", "_")+".received.json"), raw, 0o644))
	gputest.Verdict(t, len(rep.History) == 2*residentIterations && len(rep.Failures) == 0,
		"the receiver completed %d updates (want %d: one per publish of both runs), %d failed", len(rep.History), 2*residentIterations, len(rep.Failures))
	if len(rep.History) != 2*residentIterations {
		t.FailNow()
	}
	for k, h := range rep.History {
		want := fmt.Sprintf("iter-%d", k%residentIterations+1)
		if h.Version != want || !h.Paused || len(h.SHA256) == 0 {
			gputest.Verdict(t, false, "receiver update %d: version %q (want %q), paused %v (want true), %d tensors", h.Update, h.Version, want, h.Paused, len(h.SHA256))
		}
	}
	calm, killed := rep.History[:residentIterations], rep.History[residentIterations:]
	for i := range residentIterations {
		bad := gputest.DigestMismatches(killed[i].SHA256, calm[i].SHA256)
		gputest.Verdict(t, bad == 0, "iteration %d: the receiver after run B's publish holds %d of %d tensors as after run A's (SHA-256)",
			i+1, len(calm[i].SHA256)-bad, len(calm[i].SHA256))
	}
	// The comparison can fail: every iteration changed the weights.
	gputest.Verdict(t, gputest.DigestMismatches(calm[0].SHA256, calm[1].SHA256) > 0, "the weights after iterations 1 and 2 differ (the comparison above can see a change)")
	for _, run := range []struct {
		name string
		got  map[string]string
		ckpt string
	}{{a.id, calm[residentIterations-1].SHA256, a.final}, {b.id, killed[residentIterations-1].SHA256, b.final}} {
		want, err := safetensorsDigests(run.ckpt)
		if err != nil {
			gputest.Verdict(t, false, "run %s: %v", run.name, err)
			continue
		}
		bad := gputest.DigestMismatches(run.got, want)
		gputest.Verdict(t, bad == 0, "run %s: the receiver's last update holds the bytes of %s: %d of %d tensors",
			run.name, run.ckpt, len(want)-bad, len(want))
	}
	r.phase("done")
}

// residentGPUEnv is what a resident GPU test runs on: its deadline, the
// GPU placement, the dev server, the receiver script.
type residentGPUEnv struct {
	r        *residentGPURig
	ctx      context.Context
	lib      *nccl.Library
	pl       gputest.Placement
	srv      string // the dev server's address
	receiver string // receiver.py
}

// newResidentGPURig finds the scripts, runs check (what a CPU machine can
// verify: the specs validate; the rig's url is a placeholder then), then
// skips, saying why, without NCCL, a GPU or a CUDA torch, and starts the
// dev server.
func newResidentGPURig(t *testing.T, check func(*residentGPURig)) (*residentGPURig, *residentGPUEnv) {
	r := &residentGPURig{t: t, queue: "resident-gpu-control", gpuQueue: "resident-gpu-shared", start: time.Now()}
	r.script = gputest.Script(t, "bench_trainer.py")
	env := &residentGPUEnv{r: r, receiver: gputest.Script(t, "receiver.py")}
	r.helper = filepath.Dir(testutil.RepoFile(t, filepath.Join("trainer", "python", "rlflow_trainer.py")))
	r.py = residentPython(t)
	r.url = "http://127.0.0.1:8000"
	check(r)
	r.url = ""

	env.lib = gputest.Lib(t)
	env.pl = gputest.Place(t, 2)
	probeResidentTorch(t, r.py, r.script)
	env.srv = testutil.DevServer(t).Address
	r.logs = gpuLogsDir(t)
	t.Logf("process logs in %s", r.logs)

	budget := residentBudget - 15*time.Second // room for cleanup
	if d, ok := t.Deadline(); ok && time.Until(d)-15*time.Second < budget {
		budget = time.Until(d) - 15*time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	t.Cleanup(cancel)
	env.ctx = ctx
	return r, env
}

// startWorkers starts the control worker and the GPU worker as `rlflow
// worker --gpu` builds it, with the engine given: the real NCCL, the CUDA
// IPC importer, the placement's device (its trainers run there too).
func (env *residentGPUEnv) startWorkers() {
	r, t := env.r, env.r.t
	c, err := runs.Connect(env.ctx, env.srv, "default")
	require.NoError(t, err)
	t.Cleanup(c.Close)
	r.c = c
	w, err := worker.NewControl(c, worker.Options{TaskQueue: r.queue, Deps: activities.Deps{LogDir: t.TempDir()}})
	require.NoError(t, err)
	require.NoError(t, w.Start())
	t.Cleanup(w.Stop)

	im, err := cudaipc.New(env.lib)
	require.NoError(t, err, "CUDA IPC importer")
	engine, err := ncclengine.New(ncclengine.Config{API: env.lib, IPC: im, Device: env.pl.Trainer, Advertise: "127.0.0.1"})
	require.NoError(t, err)
	wlog, _ := logFile(t, r.logs, "gpu-worker")
	g, err := gpuworker.New(c, gpuworker.Options{SharedQueue: r.gpuQueue, Engine: engine, Device: env.pl.Trainer, Advertise: "127.0.0.1",
		Host: "resident-gpu-host", Log: slog.New(slog.NewTextHandler(wlog, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	require.NoError(t, err)
	require.NoError(t, g.Start())
	t.Cleanup(func() {
		g.Stop() // stops the trainers
		engine.Close()
	})
}

// run runs the spec with killAt to completion; with killAt > 0 it SIGKILLs
// the trainer once the train of that iteration wrote its mark.
func (r *residentGPURig) run(ctx context.Context, id string, killAt int) residentGPURun {
	t := r.t
	base := t.TempDir()
	residentRollouts(t, base)
	markDir := filepath.Join(base, "marks")
	require.NoError(t, os.MkdirAll(markDir, 0o755))
	runDir := filepath.Join(base, "checkpoints", id)
	t.Cleanup(func() {
		// The trainer's log (every generation's) next to the others.
		if b, err := os.ReadFile(filepath.Join(runDir, "trainer.log")); err == nil {
			_ = os.WriteFile(filepath.Join(r.logs, strings.ReplaceAll(t.Name(), "/", "_")+"."+id+".trainer.log"), b, 0o644)
		}
	})

	kctx, kcancel := context.WithCancel(ctx)
	defer kcancel()
	type killResult struct {
		k   trainerKill
		err error
	}
	killed := make(chan killResult, 1)
	if killAt > 0 {
		mark := filepath.Join(markDir, fmt.Sprintf("mark-%d", killAt))
		go func() {
			k, err := killTrainerAtMark(kctx, id, mark)
			killed <- killResult{k, err}
		}()
	}

	r.phase("run %s starts (kill in iteration %d)", id, killAt)
	run, err := runs.Start(ctx, r.c, runs.StartOptions{Spec: r.spec(base, killAt), TaskQueue: r.queue, ID: id})
	require.NoError(t, err)
	var res workflows.PipelineResult
	if err := run.Get(ctx, &res); err != nil {
		t.Fatalf("run %s: %v (trainer log %s; logs in %s)", id, err, filepath.Join(runDir, "trainer.log"), r.logs)
	}
	r.phase("run %s completed", id)
	require.Equal(t, residentIterations, res.Iterations)
	if killAt > 0 {
		kcancel()
		kr := <-killed
		if kr.err != nil {
			gputest.Verdict(t, false, "run %s: killing the trainer in iteration %d: %v", id, killAt, kr.err)
		} else {
			gputest.Verdict(t, kr.k.generation == 1, "run %s: SIGKILLed the trainer (pid %d, generation %d; want 1) inside the train of iteration %d, after its optimizer step, %.1fs after the test started",
				id, kr.k.pid, kr.k.generation, killAt, kr.k.at.Sub(r.start).Seconds())
		}
	}
	out := residentGPURun{id: id, train: map[int]workflows.StepResult{}, publish: map[int]workflows.StepResult{},
		final: filepath.Join(runDir, trainer.CheckpointName(residentIterations), "model.safetensors")}
	for i := 1; i <= residentIterations; i++ {
		p := progressOf(ctx, t, r.c, fmt.Sprintf("%s/iter-%d", id, i))
		out.train[i], out.publish[i] = stepOf(t, p, "train"), stepOf(t, p, "publish")
		t.Logf("run %s iteration %d: train %.2fs (attempts %d, loss %v), publish %.2fs", id, i,
			out.train[i].Seconds, out.train[i].Attempts, out.train[i].Outputs["loss"], out.publish[i].Seconds)
	}
	return out
}

// killTrainerAtMark waits until mark holds the pid of the process that
// wrote it (bench_trainer.py writes it after its optimizer step, closes
// it, then sleeps), finds run's trainer process (the one whose
// environment names the run and whose command line bench_trainer.py), and
// SIGKILLs it once both agree.
func killTrainerAtMark(ctx context.Context, runID, mark string) (trainerKill, error) {
	markPID := 0
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(mark); err == nil && strings.HasSuffix(string(b), "\n") {
			pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil {
				return trainerKill{}, fmt.Errorf("mark %s: not a pid", mark)
			}
			markPID = pid
			break
		}
		select {
		case <-ctx.Done():
			return trainerKill{}, fmt.Errorf("waiting for the train's mark %s: %w", mark, ctx.Err())
		case <-tick.C:
		}
	}
	procs, err := residentTrainerProcs(runID)
	if err != nil {
		return trainerKill{}, err
	}
	if len(procs) != 1 || procs[0].pid != markPID {
		return trainerKill{}, fmt.Errorf("want one trainer process of run %s, the mark's pid %d: found %+v", runID, markPID, procs)
	}
	k := procs[0]
	if err := syscall.Kill(k.pid, syscall.SIGKILL); err != nil {
		return trainerKill{}, fmt.Errorf("SIGKILL %d: %w", k.pid, err)
	}
	k.at = time.Now()
	return k, nil
}

// residentTrainerProcs lists the live processes whose environment has
// RLFLOW_RUN_ID=runID and whose command line names bench_trainer.py, with
// the generation their environment gives.
func residentTrainerProcs(runID string) ([]trainerKill, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []trainerKill
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		if err != nil {
			continue // gone, or not ours
		}
		vars := strings.Split(string(env), "\x00")
		if !slices.Contains(vars, trainer.EnvRunID+"="+runID) {
			continue
		}
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || !strings.Contains(string(cmdline), "bench_trainer.py") || exited(pid) {
			continue
		}
		k := trainerKill{pid: pid}
		for _, kv := range vars {
			if v, ok := strings.CutPrefix(kv, trainer.EnvGeneration+"="); ok {
				k.generation, _ = strconv.Atoi(v)
			}
		}
		out = append(out, k)
	}
	return out, nil
}

// startReceiver starts receiver.py --http as a generation E server
// of backend and waits for its READY line; it returns its URL. With nccl it
// is rank 1 of the placement (its own NCCL_HOSTID on a shared GPU); with
// ipc it runs on the trainer's GPU, as vLLM's ipc backend needs, and
// unpickles update_info's handles as vLLM does (so it needs vLLM's
// VLLM_ALLOW_INSECURE_SERIALIZATION=1). No process group and no
// Pdeathsig: its --deadline ends it if the test dies.
func (e *residentGPUEnv) startReceiver(backend string) string {
	r, t, ctx := e.r, e.r.t, e.ctx
	t.Helper()
	port := testutil.FreePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	f, logPath := logFile(t, r.logs, "receiver-"+backend)
	device := e.pl.Device(1)
	if backend == pipelines.BackendIPC {
		device = e.pl.Trainer
	}
	args := []string{e.receiver, "--http", strconv.Itoa(port), "--api", "E", "--backend", backend, "--device", strconv.Itoa(device),
		"--deadline", strconv.Itoa(int(residentBudget.Seconds()) + 60), "--update-deadline", "30"}
	cmd := exec.Command(r.py, args...)
	env := e.pl.ProcEnv("rlflow-worker1")
	if backend == pipelines.BackendIPC {
		env = append(env, "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
	}
	cmd.Env = append(append(os.Environ(), env...), "PYTHONUNBUFFERED=1", ncclDebug())
	fmt.Fprintf(f, "$ %s%s %s\n", strings.Join(append(env, ""), " "), r.py, strings.Join(args, " "))
	cmd.Stderr = f
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	ready, done := make(chan string, 1), make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			fmt.Fprintln(f, "stdout:", sc.Text())
			if strings.HasPrefix(sc.Text(), "READY") {
				select {
				case ready <- sc.Text():
				default:
				}
			}
		}
		_ = cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
	})
	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute) // import torch, CUDA init
	defer cancel()
	select {
	case line := <-ready:
		t.Logf("receiver %s: %s (log %s)", url, line, logPath)
	case <-done:
		t.Fatalf("receiver.py exited before READY (see %s)", logPath)
	case <-rctx.Done():
		t.Fatalf("receiver.py: no READY: %v (see %s)", rctx.Err(), logPath)
	}
	return url
}

// residentPython is $RLFLOW_PYTHON (default python3) as an absolute path
// (not resolving links: a virtual environment's python is one).
func residentPython(t *testing.T) string {
	t.Helper()
	py := gputest.Python()
	p, err := exec.LookPath(py)
	if err != nil {
		t.Skipf("skipping GPU test: no Python %q: %v", py, err)
	}
	abs, err := filepath.Abs(p)
	require.NoError(t, err)
	return abs
}

// probeResidentTorch skips unless py imports torch with CUDA
// (bench_trainer.py --probe answers READY or SKIP).
func probeResidentTorch(t *testing.T, py, script string) {
	t.Helper()
	out, err := exec.Command(py, script, "--probe").CombinedOutput()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	last := lines[len(lines)-1]
	switch {
	case err != nil:
		t.Fatalf("%s %s --probe: %v: %s", py, script, err, tail(string(out), 1000))
	case strings.HasPrefix(last, "SKIP "):
		t.Skipf("skipping GPU test: %s", strings.TrimPrefix(last, "SKIP "))
	case !strings.HasPrefix(last, "READY "):
		t.Fatalf("%s --probe: want READY or SKIP, got %q", script, last)
	}
	t.Logf("trainer Python: %s", strings.TrimPrefix(last, "READY "))
}

// safetensorsDigests is the SHA-256 of every tensor's bytes in path, as
// receiver.py reports what it received.
func safetensorsDigests(path string) (map[string]string, error) {
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	out := map[string]string{}
	for _, ti := range ck.Tensors() {
		b, err := ck.Bytes(ti)
		if err != nil {
			return nil, fmt.Errorf("%s: tensor %s: %w", path, ti.Name, err)
		}
		sum := sha256.Sum256(b)
		out[ti.Name] = hex.EncodeToString(sum[:])
	}
	if len(out) == 0 {
		return nil, errors.New(path + ": no tensors")
	}
	return out, nil
}

func isEmptyList(v any) bool {
	l, ok := v.([]any)
	return ok && len(l) == 0
}
