package activities

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/activity"
)

// TrainInput is the `with` of a train step.
type TrainInput struct {
	Context  pipelines.StepContext `json:"context"`
	Rollouts string                `json:"rollouts"`
	Args     map[string]any        `json:"args,omitempty"`
}

// Restarted is what every trainer step reports about a restart it needed.
type Restarted struct {
	Restarted bool `json:"restarted"`
	// RestoredFrom is the checkpoint's iteration the trainer was restored
	// from (0: a fresh initialisation).
	RestoredFrom int `json:"restored_from"`
	// Replayed are the iterations trained again from their rollouts.
	Replayed []int `json:"replayed"`
	// Cause says why the trainer was not there ("" without a restart).
	Cause      string `json:"restart_cause"`
	Generation int    `json:"trainer_generation"`
}

// restarted reports r: a start that lost nothing (the run's first, on a
// fresh trainer) is not a restart, though its cause is still said.
func restarted(r *trainer.Restart, generation int) Restarted {
	if r == nil {
		return Restarted{Replayed: []int{}, Generation: generation}
	}
	out := Restarted{RestoredFrom: r.RestoredFrom, Replayed: r.Replayed, Cause: r.Cause, Generation: r.Generation,
		Restarted: r.Generation > 1 || r.RestoredFrom > 0 || len(r.Replayed) > 0}
	if out.Replayed == nil {
		out.Replayed = []int{}
	}
	return out
}

// TrainOutput is a train step's outputs: the fixed keys and the trainer's
// metrics, each under its own name.
type TrainOutput struct {
	Iteration    int     `json:"iteration"`
	Seconds      float64 `json:"seconds"`
	StepDoneUnix float64 `json:"step_done_unix"`
	// FromJournal: an earlier attempt trained this iteration and the
	// worker journalled it; this attempt answered from the journal.
	FromJournal       bool    `json:"from_journal"`
	Checkpoint        string  `json:"checkpoint"`
	CheckpointSeconds float64 `json:"checkpoint_seconds"`
	Restarted
	Metrics map[string]float64 `json:"-"`
	Attempt int                `json:"_attempt"`
}

// MarshalJSON puts the metrics beside the fixed keys (a metric never
// replaces one).
func (o TrainOutput) MarshalJSON() ([]byte, error) {
	type plain TrainOutput
	return mergeOutputs(plain(o), o.Metrics)
}

// PublishInput is the `with` of a publish step.
type PublishInput struct {
	Context       pipelines.StepContext `json:"context"`
	Version       string                `json:"version,omitempty"`
	DType         string                `json:"dtype,omitempty"`
	UpdateTimeout pipelines.Duration    `json:"update_timeout,omitempty"`
	Verify        bool                  `json:"verify,omitempty"`
}

// PublishOutput is a publish step's outputs.
type PublishOutput struct {
	Backend string  `json:"backend"`
	Bytes   int64   `json:"bytes"`
	Tensors int     `json:"tensors"`
	Seconds float64 `json:"seconds"`
	GBps    float64 `json:"gb_per_s"`
	Version string  `json:"version"`
	// Iteration is the trainer's iteration the weights are from: the
	// interpreter's record of what the servers hold.
	Iteration       int                `json:"iteration"`
	SnapshotSeconds float64            `json:"snapshot_seconds"`
	ServerSeconds   map[string]float64 `json:"server_seconds"`
	Initialized     bool               `json:"initialized"`
	Methods         []string           `json:"methods"`
	Restarted
	VLLM    []pipelines.VLLMServer `json:"_vllm,omitempty"`
	Attempt int                    `json:"_attempt"`
}

// SaveCheckpointInput is the `with` of a save_checkpoint step.
type SaveCheckpointInput struct {
	Context pipelines.StepContext `json:"context"`
}

// SaveCheckpointOutput is a save_checkpoint step's outputs.
type SaveCheckpointOutput struct {
	Path      string  `json:"path"`
	Bytes     int64   `json:"bytes"`
	Seconds   float64 `json:"seconds"`
	Iteration int     `json:"iteration"`
	Restarted
	Attempt int `json:"_attempt"`
}

// Train trains the run's resident trainer on a rollouts file.
func (a *Activities) Train(ctx context.Context, in TrainInput) (*TrainOutput, error) {
	const step = pipelines.StepTrain
	if err := resolveArgs(ctx, step, &in); err != nil {
		return nil, err
	}
	sc := in.Context
	spec, err := a.trainerSpec(ctx, step, sc)
	if err != nil {
		return nil, err
	}
	rollouts, err := a.Roots.Resolve("with.rollouts", sc.BaseDir, in.Rollouts)
	if err == nil {
		rollouts, err = filepath.Abs(rollouts)
	}
	if err != nil {
		return nil, badInput(ctx, "%s: %v", step, err)
	}
	if st, err := os.Stat(rollouts); err != nil || !st.Mode().IsRegular() {
		return nil, badInput(ctx, "%s: with.rollouts %q is not a readable file", step, in.Rollouts)
	}
	if in.Args == nil {
		in.Args = map[string]any{}
	}
	stop := a.heartbeatLoop(ctx, trainerBeat(ctx))
	res, err := a.Trainers.Train(ctx, sc.RunID, spec, trainer.TrainRequest{Iteration: sc.Iteration, Rollouts: rollouts, Args: in.Args})
	stop()
	if err != nil {
		return nil, trainerError(ctx, step, err)
	}
	out := &TrainOutput{Iteration: res.Iteration, Seconds: res.Seconds, StepDoneUnix: res.StepDoneUnix, FromJournal: res.FromJournal,
		Checkpoint: res.Checkpoint, CheckpointSeconds: res.CheckpointSeconds, Restarted: a.restartOf(sc.RunID, res.Restart),
		Metrics: res.Metrics, Attempt: attemptOf(ctx)}
	for _, key := range sc.Outputs {
		if _, ok := res.Metrics[key]; !ok {
			return nil, stepError(ctx, pipelines.ErrTypeOutputMissing, nil, "%s: the trainer's metrics have no %q, which the step declares in outputs (it reported %s)",
				step, key, strings.Join(metricNames(res.Metrics), ", "))
		}
	}
	return out, nil
}

// Publish broadcasts the trainer's weights to every server from a device
// snapshot it hands over by CUDA IPC.
func (a *Activities) Publish(ctx context.Context, in PublishInput) (*PublishOutput, error) {
	const step = pipelines.StepPublish
	if err := resolveArgs(ctx, step, &in); err != nil {
		return nil, err
	}
	sc := in.Context
	spec, err := a.trainerSpec(ctx, step, sc)
	if err != nil {
		return nil, err
	}
	backend, engine, target, err := a.transferPath(ctx, step, sc, vllm.Timeouts{Update: in.UpdateTimeout.D()})
	if err != nil {
		return nil, err
	}
	version := in.Version
	if version == "" {
		version = defaultVersion(sc)
	}
	if sc.FleetPaused {
		if err := checkPaused(ctx, target.Fleet, "before the update"); err != nil {
			return nil, err
		}
	}
	// vLLM's ipc backend rebuilds every tensor from its own torch
	// ref-counter share (transfer.IPC).
	snap, restart, err := a.Trainers.PublishWith(ctx, sc.RunID, spec,
		trainer.PublishRequest{Version: version, DType: in.DType, IPCRefs: backend == pipelines.BackendIPC})
	if err != nil {
		return nil, trainerError(ctx, step, err)
	}
	defer func() {
		// The trainer owns the snapshot until it is released, whatever
		// happened to the broadcast; a trainer gone since has nothing to
		// release.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), spec.KillGrace+5*time.Second)
		defer cancel()
		_ = a.Trainers.Release(rctx, sc.RunID, version)
	}()
	if w := sc.Weights; w != nil && w.TrainerIteration > 0 && snap.Iteration != w.TrainerIteration {
		return nil, stepError(ctx, pipelines.ErrTypeTrainerFailed, nil,
			"%s: the servers must be restored to %s, the trainer's weights after iteration %d, but the trainer has trained to iteration %d since: they are gone from it (save_checkpoint keeps a durable copy)",
			step, w.Version, w.TrainerIteration, snap.Iteration)
	}
	res, serverSeconds, err := a.update(ctx, step, backend, engine, transfer.UpdateRequest{Target: target, Snapshot: snap, DType: in.DType,
		Version: version, Timeout: in.UpdateTimeout.D(), InitTimeout: vllm.DefaultInitTimeout, Paused: sc.FleetPaused}, in.Verify)
	if err != nil {
		return nil, err
	}
	out := &PublishOutput{Backend: backend, Bytes: res.Bytes, Tensors: res.Tensors, Seconds: res.Elapsed.Seconds(), Version: version,
		Iteration: snap.Iteration, SnapshotSeconds: snap.SnapshotSeconds, ServerSeconds: serverSeconds, Initialized: res.Initialized,
		Methods: nonNilStrings(res.Methods), Restarted: a.restartOf(sc.RunID, restart), VLLM: describeServers(ctx, target.Fleet), Attempt: attemptOf(ctx)}
	if res.Elapsed > 0 {
		out.GBps = float64(res.Bytes) / res.Elapsed.Seconds() / 1e9
	}
	return out, nil
}

// SaveCheckpoint saves a durable checkpoint of the trainer now.
func (a *Activities) SaveCheckpoint(ctx context.Context, in SaveCheckpointInput) (*SaveCheckpointOutput, error) {
	const step = pipelines.StepSaveCheckpoint
	if err := resolveArgs(ctx, step, &in); err != nil {
		return nil, err
	}
	sc := in.Context
	spec, err := a.trainerSpec(ctx, step, sc)
	if err != nil {
		return nil, err
	}
	stop := a.heartbeatLoop(ctx, trainerBeat(ctx))
	res, restart, err := a.Trainers.Save(ctx, sc.RunID, spec, sc.Iteration)
	stop()
	if err != nil {
		return nil, trainerError(ctx, step, err)
	}
	return &SaveCheckpointOutput{Path: res.Path, Bytes: res.Bytes, Seconds: res.Seconds, Iteration: res.Iteration,
		Restarted: a.restartOf(sc.RunID, restart), Attempt: attemptOf(ctx)}, nil
}

// restartOf reports a restart, and the trainer's generation either way.
func (a *Activities) restartOf(runID string, r *trainer.Restart) Restarted {
	_, gen, _ := a.Trainers.Running(runID)
	return restarted(r, gen)
}

// trainerSpec builds the run's trainer as the GPU worker starts it, from
// the pipeline's trainer: with this worker's roots and environment. The
// same for every step of the run, so a step never restarts a trainer
// another started.
func (a *Activities) trainerSpec(ctx context.Context, step string, sc pipelines.StepContext) (trainer.Spec, error) {
	tr := sc.Trainer
	if tr == nil {
		return trainer.Spec{}, badInput(ctx, "%s: the pipeline declares no trainer (add trainer: {command: [...], checkpoint_dir: ...})", step)
	}
	if a.Trainers == nil {
		return trainer.Spec{}, stepError(ctx, pipelines.ErrTypeNoGPUWorker, nil,
			"%s: the resident trainer runs on a GPU worker (start one with `rlflow worker --gpu` on the trainer's host); this worker has none", step)
	}
	if len(tr.Command) == 0 || tr.Command[0] == "" {
		return trainer.Spec{}, badInput(ctx, "%s: trainer.command[0], the program, is empty", step)
	}
	exec := ExecInput{Context: sc, Env: tr.Env, Secrets: tr.Secrets}
	if err := a.learnSecrets(ctx, exec); err != nil {
		return trainer.Spec{}, err
	}
	dir, err := a.Roots.Resolve("trainer.dir", sc.BaseDir, tr.Dir)
	if err == nil && dir == "" {
		dir, err = os.Getwd()
	}
	if err == nil {
		dir, err = filepath.Abs(dir)
	}
	if err != nil {
		return trainer.Spec{}, badInput(ctx, "%s: %v", step, err)
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return trainer.Spec{}, badInput(ctx, "%s: trainer.dir %q is not a directory", step, dir)
	}
	name := tr.Command[0]
	if strings.Contains(name, "/") && !filepath.IsAbs(name) {
		if name, err = a.Roots.resolveFrom("trainer.command[0]", name, "trainer.dir", dir); err != nil {
			return trainer.Spec{}, badInput(ctx, "%s: %v", step, err)
		}
	}
	prog, err := lookPath(name, dir)
	if err != nil {
		return trainer.Spec{}, stepError(ctx, pipelines.ErrTypeCommandNotFound, err, "%s: trainer.command", step)
	}
	ckpt, err := a.Roots.Resolve("trainer.checkpoint_dir", sc.BaseDir, tr.CheckpointDir)
	if err == nil {
		ckpt, err = filepath.Abs(ckpt)
	}
	if err != nil {
		return trainer.Spec{}, badInput(ctx, "%s: %v", step, err)
	}
	runDir := filepath.Join(ckpt, safeName(sc.RunID))
	env, err := a.processEnv(exec, "RLFLOW_PIPELINE="+sc.Pipeline)
	if err != nil {
		return trainer.Spec{}, stepError(ctx, pipelines.ErrTypeIO, err, "%s: the trainer's environment", step)
	}
	spec := trainer.Spec{
		Command: append([]string{prog}, tr.Command[1:]...), Dir: dir, Env: env, Device: a.TrainerDevice,
		CheckpointDir: runDir, CheckpointEvery: tr.CheckpointEvery, KeepCheckpoints: tr.KeepCheckpoints,
		StartTimeout: tr.StartTimeout.D(), KillGrace: tr.KillGrace.D(),
		LogPath: filepath.Join(runDir, "trainer.log"),
	}
	if spec.CheckpointEvery <= 0 {
		spec.CheckpointEvery = pipelines.DefaultCheckpointEvery
	}
	if spec.StartTimeout <= 0 {
		spec.StartTimeout = pipelines.DefaultTrainerStartTimeout
	}
	if spec.KillGrace <= 0 {
		spec.KillGrace = pipelines.DefaultKillGrace
	}
	if err := spec.Validate(); err != nil {
		return trainer.Spec{}, badInput(ctx, "%s: %v", step, err)
	}
	return spec, nil
}

// trainerError types a trainer failure: a trainer that died, or did not
// start in time, is retried (the next attempt restarts it from its last
// checkpoint); one that refused the call, broke the protocol or cannot be
// restored fails the step as it is. The trainer's log keeps its own words.
func trainerError(ctx context.Context, step string, err error) error {
	if ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return err
	}
	var te *trainer.Error
	if !errors.As(err, &te) {
		return stepError(ctx, pipelines.ErrTypeTrainerDied, err, "%s", step)
	}
	switch te.Kind {
	case trainer.BadInput:
		return stepError(ctx, pipelines.ErrTypeBadInput, err, "%s", step)
	case trainer.Died, trainer.Timeout:
		return stepError(ctx, pipelines.ErrTypeTrainerDied, err, "%s", step)
	}
	return stepError(ctx, pipelines.ErrTypeTrainerFailed, err, "%s", step)
}

func metricNames(m map[string]float64) []string {
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, strconv.Quote(k))
	}
	if len(names) == 0 {
		return []string{"none"}
	}
	return names
}

// mergeOutputs is fixed's JSON object with extra's keys added beside its
// own (a key of fixed wins).
func mergeOutputs(fixed any, extra map[string]float64) ([]byte, error) {
	b, err := json.Marshal(fixed)
	if err != nil || len(extra) == 0 {
		return b, err
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("merging outputs: %w", err)
	}
	for k, v := range extra {
		if _, taken := m[k]; !taken {
			m[k] = v
		}
	}
	return json.Marshal(m)
}

// trainerBeat is the heartbeat of a step waiting on the trainer: it says
// the worker is alive; the trainer's own progress is in its log.
func trainerBeat(ctx context.Context) func() {
	return func() { activity.RecordHeartbeat(ctx, map[string]string{"waiting_on": "trainer"}) }
}
