package activities

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/trainer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The trainer steps refuse, before starting anything, what can never work:
// a control worker (no trainers), a pipeline without trainer:, a path
// outside the roots, a program that does not exist, a rollouts file that is
// not there.
func TestTrainerStepRefusals(t *testing.T) {
	ctx := context.Background()
	base := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(base, "r.jsonl"), []byte("{}\n"), 0o644))
	tr := &pipelines.Trainer{Command: []string{"true"}, CheckpointDir: "ckpt"}
	sc := func(tr *pipelines.Trainer) pipelines.StepContext {
		s := stepContext(t, pipelines.StepTrain)
		s.BaseDir, s.Trainer = base, tr
		return s
	}
	gpu := func(t *testing.T) *Activities {
		a := newActivities(t)
		a.Trainers = trainer.NewManager(trainer.Options{})
		roots, err := NewRoots(base)
		require.NoError(t, err)
		a.Roots = roots
		return a
	}
	for _, c := range []struct {
		name    string
		a       func(t *testing.T) *Activities
		in      TrainInput
		errType string
		want    string
	}{
		{"control worker", newActivities, TrainInput{Context: sc(tr), Rollouts: "r.jsonl"}, pipelines.ErrTypeNoGPUWorker,
			"train: the resident trainer runs on a GPU worker"},
		{"no trainer", gpu, TrainInput{Context: sc(nil), Rollouts: "r.jsonl"}, pipelines.ErrTypeBadInput,
			"train: the pipeline declares no trainer"},
		{"checkpoint_dir outside the roots", gpu, TrainInput{Context: sc(&pipelines.Trainer{Command: []string{"true"}, CheckpointDir: "/etc"}), Rollouts: "r.jsonl"},
			pipelines.ErrTypeBadInput, "trainer.checkpoint_dir"},
		{"no such program", gpu, TrainInput{Context: sc(&pipelines.Trainer{Command: []string{"no-such-trainer-xyz"}, CheckpointDir: "ckpt"}), Rollouts: "r.jsonl"},
			pipelines.ErrTypeCommandNotFound, `command "no-such-trainer-xyz" not found in PATH`},
		{"secret unset", gpu, TrainInput{Context: sc(&pipelines.Trainer{Command: []string{"true"}, CheckpointDir: "ckpt", Secrets: []string{"HF_TOKEN"}}), Rollouts: "r.jsonl"},
			pipelines.ErrTypeBadInput, "HF_TOKEN is not set in the worker's environment"},
		{"no rollouts", gpu, TrainInput{Context: sc(tr), Rollouts: "gone.jsonl"}, pipelines.ErrTypeBadInput,
			`with.rollouts "gone.jsonl" is not a readable file`},
		{"rollouts outside the roots", gpu, TrainInput{Context: sc(tr), Rollouts: "/etc/passwd"}, pipelines.ErrTypeBadInput,
			"with.rollouts"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.a(t).Train(ctx, c.in)
			require.Error(t, err)
			assert.Equal(t, c.errType, errType(t, err), "%v", err)
			assert.ErrorContains(t, err, c.want)
		})
	}
}

// A train step's metrics are outputs beside its fixed keys, never over
// them; a declared output the trainer did not report fails the step.
func TestTrainOutputKeys(t *testing.T) {
	out := TrainOutput{Iteration: 3, Metrics: map[string]float64{"loss": 0.5, "iteration": 99}, Restarted: restarted(nil, 1)}
	b, err := json.Marshal(out)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	assert.Equal(t, 0.5, m["loss"])
	assert.Equal(t, float64(3), m["iteration"], "a metric never replaces a fixed key")
	assert.Equal(t, false, m["restarted"])
	assert.Equal(t, []any{}, m["replayed"])

	first := restarted(&trainer.Restart{Generation: 1, Cause: "no trainer for this run on this worker"}, 1)
	assert.False(t, first.Restarted, "a first start lost nothing")
	again := restarted(&trainer.Restart{Generation: 1, RestoredFrom: 4, Cause: "no trainer for this run on this worker"}, 1)
	assert.True(t, again.Restarted, "a new GPU worker restoring a checkpoint restarted the trainer")
}
