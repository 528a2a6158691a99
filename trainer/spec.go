// Package trainer is the GPU worker's side of the resident trainer protocol
// (PROTOCOL.md): it starts a run's trainer process, talks to it over two
// pipes, keeps the run's journal and checkpoints, and restarts the trainer
// from the last checkpoint, replaying the journal, whenever it died.
//
// Invariants: per run at most one trainer process and one call at a time;
// a train reply is journaled (fsynced) before Train returns it; LATEST is
// only ever replaced atomically, after save replied; a call whose context
// ends kills the trainer's process group (the next call restarts it); every
// reply frame is checked in full before anything of it is used.
package trainer

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"
)

// Spec is one run's trainer as the GPU worker starts it.
type Spec struct {
	// Command is the argv; Command[0] is an absolute path (the caller
	// resolved it).
	Command []string
	// Dir is the absolute working directory.
	Dir string
	// Env is the environment the caller built (minimal env, secrets, the
	// pipeline's env, RLFLOW_*). The supervisor appends RLFLOW_TRAINER_FDS,
	// RLFLOW_TRAINER_DEVICE, RLFLOW_RUN_ID, RLFLOW_TRAINER_GENERATION and
	// procs.TagEnv.
	Env []string
	// Device is the CUDA ordinal the trainer must use.
	Device int
	// CheckpointDir is this run's directory (ckpt-<iter>/, LATEST,
	// journal.jsonl), absolute; created 0700 if missing.
	CheckpointDir string
	// CheckpointEvery (>= 1): Train saves after every iteration that is a
	// multiple of it.
	CheckpointEvery int
	// KeepCheckpoints (>= 0): after a save, only the newest this many
	// ckpt-<n> directories stay (LATEST's among them); 0 keeps all.
	KeepCheckpoints int
	// StartTimeout bounds start + hello + load (not the replay, which the
	// call's context bounds).
	StartTimeout time.Duration
	// KillGrace is the time between SIGTERM and SIGKILL of the trainer's
	// processes, and the time a shutdown request gets.
	KillGrace time.Duration
	// LogPath is where the trainer's stdout and stderr are appended
	// (created 0600).
	LogPath string
}

// Validate checks the spec; its errors name the field.
func (s Spec) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch {
	case len(s.Command) == 0:
		bad("spec.command: empty")
	case !filepath.IsAbs(s.Command[0]):
		bad("spec.command[0]: not an absolute path")
	}
	for _, f := range []struct{ field, path string }{{"spec.dir", s.Dir}, {"spec.checkpoint_dir", s.CheckpointDir}, {"spec.log_path", s.LogPath}} {
		if !filepath.IsAbs(f.path) {
			bad("%s: not an absolute path", f.field)
		}
	}
	if s.Device < 0 {
		bad("spec.device: %d, want a CUDA ordinal >= 0", s.Device)
	}
	if s.KeepCheckpoints < 0 {
		bad("spec.keep_checkpoints: %d, want >= 0", s.KeepCheckpoints)
	}
	if s.CheckpointEvery < 1 {
		bad("spec.checkpoint_every: %d, want >= 1", s.CheckpointEvery)
	}
	if s.StartTimeout <= 0 {
		bad("spec.start_timeout: %v, want > 0", s.StartTimeout)
	}
	if s.KillGrace <= 0 {
		bad("spec.kill_grace: %v, want > 0", s.KillGrace)
	}
	if err := errors.Join(errs...); err != nil {
		return errorf(BadInput, err, "invalid trainer spec")
	}
	return nil
}

// TrainRequest is one train step's input.
type TrainRequest struct {
	// Iteration is the iteration to train (>= 1): the trainer's last one
	// plus one.
	Iteration int
	// Rollouts is the absolute path of the rollouts JSONL file.
	Rollouts string
	// Args are the step's with.args, passed through (nil: {}).
	Args map[string]any
}

func (r TrainRequest) validate() error {
	var errs []error
	if r.Iteration < 1 {
		errs = append(errs, fmt.Errorf("iteration: %d, want >= 1", r.Iteration))
	}
	if !filepath.IsAbs(r.Rollouts) {
		errs = append(errs, errors.New("rollouts: not an absolute path"))
	}
	if err := errors.Join(errs...); err != nil {
		return errorf(BadInput, err, "invalid train request")
	}
	return nil
}

// PublishRequest is one publish (PROTOCOL.md "publish").
type PublishRequest struct {
	// Version names the snapshot (non-empty); Release takes it back.
	Version string
	// DType is DTypeKeep, DTypeBFloat16 or DTypeFloat16: what float32
	// tensors are cast to.
	DType string
	// IPCRefs asks the trainer for one CUDA IPC ref-counter slot per
	// tensor (Snapshot.Refs): what vLLM's ipc backend needs to rebuild
	// each tensor with torch's rebuild_cuda_tensor. The NCCL path does
	// not need them.
	IPCRefs bool
}

// TrainResult is what a train step reports.
type TrainResult struct {
	Iteration    int
	Metrics      map[string]float64
	Seconds      float64
	StepDoneUnix float64
	// FromJournal: the journal already held this iteration (an earlier
	// attempt trained it), so it was answered from the journal, not
	// trained twice, and nothing was started.
	FromJournal bool
	// Checkpoint is the checkpoint saved after this iteration ("" none),
	// CheckpointSeconds the time save took.
	Checkpoint        string
	CheckpointSeconds float64
	// Restart is set when this call had to (re)start the trainer.
	Restart *Restart
}

// Restart describes a (re)start of a run's trainer.
type Restart struct {
	// Generation is the new process's (1: the first start of the run on
	// this worker).
	Generation int
	// Cause says why there was no live trainer, e.g. "trainer pid 123
	// killed by signal 9 during train of iteration 3".
	Cause string
	// RestoredFrom is the checkpoint's iteration and Checkpoint its path
	// (0 and "": the model's fresh initialisation).
	RestoredFrom int
	Checkpoint   string
	// Replayed are the journal's iterations trained again, in order.
	Replayed []int
	// Seconds is the whole restart: start, hello, load and replay.
	Seconds float64
}

// SaveResult is what a save_checkpoint step reports.
type SaveResult struct {
	Path      string
	Bytes     int64
	Seconds   float64
	Iteration int
}
