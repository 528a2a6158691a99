package trainer_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/trainer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// python3 is the interpreter of the Python helper's CPU tests, which need
// no torch.
func python3(t *testing.T) string {
	return testutil.Python3(t, "trainer/python's torch-free tests")
}

// The Python helper's own tests, the torch-free part (the torch and CUDA
// ones run on the GPU host: nccl/GPU.md).
func TestPythonHelperTests(t *testing.T) {
	py := python3(t)
	cmd := exec.Command(py, "test_rlflow_trainer.py")
	cmd.Dir = "python"
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// The Go side and the Python helper speak the same protocol: the Manager
// drives rlflow_trainer.py's real loop, save and load (over its test
// double of the model, so no torch), through a checkpoint, a publish (and
// one with ipc_refs), a SIGKILL, the restore and the replay.
func TestManagerDrivesThePythonHelper(t *testing.T) {
	py := python3(t)
	ctx := context.Background()
	script, err := filepath.Abs("python/test_rlflow_trainer.py")
	require.NoError(t, err)
	dir := t.TempDir()
	spec := trainer.Spec{
		Command: []string{py, script, "--child-fake"}, Dir: dir,
		Env: []string{"PATH=" + os.Getenv("PATH"), "PYTHONDONTWRITEBYTECODE=1"},
		// The helper's model double reports device 3.
		Device:        3,
		CheckpointDir: filepath.Join(dir, "checkpoints", "r1"), CheckpointEvery: 2,
		StartTimeout: 20 * time.Second, KillGrace: 5 * time.Second, LogPath: filepath.Join(dir, "trainer.log"),
	}
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(ctx) })
	ro := rolloutFiles(t, 4)
	for i := 1; i <= 3; i++ {
		res, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: i, Rollouts: ro[i-1], Args: map[string]any{}})
		require.NoError(t, err, "train %d (log %s)", i, spec.LogPath)
		assert.Equal(t, 3.0, res.Metrics["samples"])
		assert.Positive(t, res.StepDoneUnix)
		if i == 2 {
			assert.Equal(t, filepath.Join(spec.CheckpointDir, "ckpt-2"), res.Checkpoint, "the helper's save")
		}
	}
	s, rs, err := m.Publish(ctx, "r1", spec, "v3", trainer.DTypeKeep)
	require.NoError(t, err)
	assert.Nil(t, rs)
	assert.Equal(t, trainer.IPCFakeShm, s.IPC)
	assert.Equal(t, 3, s.Iteration)
	assert.Nil(t, s.Refs)
	require.NoError(t, m.Release(ctx, "r1", "v3"))
	s, _, err = m.PublishWith(ctx, "r1", spec, trainer.PublishRequest{Version: "v3-refs", DType: trainer.DTypeKeep, IPCRefs: true})
	require.NoError(t, err, "log %s", spec.LogPath)
	fake := []byte("fake_refcounter") // the helper's test double answers the fake_shm refs
	assert.Equal(t, []trainer.IPCRef{{CounterHandle: fake, CounterOffset: 0}, {CounterHandle: fake, CounterOffset: 1}}, s.Refs)
	require.NoError(t, m.Release(ctx, "r1", "v3-refs"))

	pid, gen, ok := m.Running("r1")
	require.True(t, ok)
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	// Killed while idle: the Manager notices (a call racing the death
	// fails as Died, and its step's retry restarts the trainer).
	require.Eventually(t, func() bool { _, _, ok := m.Running("r1"); return !ok }, 10*time.Second, 10*time.Millisecond)
	res, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 4, Rollouts: ro[3]})
	require.NoError(t, err, "log %s", spec.LogPath)
	require.NotNil(t, res.Restart)
	assert.Equal(t, gen+1, res.Restart.Generation)
	assert.Equal(t, 2, res.Restart.RestoredFrom, "the helper's load of ckpt-2")
	assert.Equal(t, []int{3}, res.Restart.Replayed)
	assert.Contains(t, res.Restart.Cause, "signal")
}
