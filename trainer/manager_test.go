package trainer_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/goldenfile"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/procs"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/trainer/trainertest"
)

// The test binary re-executes itself as a trainer: roleEnv says which.
const (
	roleEnv = "RLFLOW_TRAINER_TEST_ROLE"
	// roleFake is trainertest.Main, the TEST DOUBLE.
	roleFake = "fake"
	// roleScript answers hello properly and every other request with
	// scriptEnv's line ({id} replaced), "oversize" (a line over 16 MiB)
	// or "exit" (exits 3 without a reply).
	roleScript = "script"
	scriptEnv  = "RLFLOW_TRAINER_TEST_SCRIPT"
	// roleWorker is a GPU worker stand-in: a Manager trains iteration 1
	// with the spec in workerSpecEnv, prints the trainer's pid, and
	// blocks.
	roleWorker    = "worker"
	workerSpecEnv = "RLFLOW_TRAINER_TEST_SPEC"
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case roleFake:
		os.Exit(trainertest.Main())
	case roleScript:
		os.Exit(scriptMain())
	case roleWorker:
		os.Exit(workerMain())
	}
	os.Exit(m.Run())
}

func scriptMain() int {
	in, out := bufio.NewReader(os.NewFile(3, "requests")), os.NewFile(4, "replies")
	for {
		line, err := in.ReadBytes('\n')
		if err != nil {
			return 0
		}
		var req struct {
			ID int64
			Op string
		}
		if json.Unmarshal(line, &req) != nil {
			return 1
		}
		reply := os.Getenv(scriptEnv)
		switch {
		case req.Op == "hello":
			reply = fmt.Sprintf(`{"id":{id},"ok":true,"protocol":1,"pid":%d,"device":0,"framework":"script","iteration":0}`, os.Getpid())
		case req.Op == "shutdown":
			reply = `{"id":{id},"ok":true}`
		case reply == "exit":
			return 3
		case reply == "oversize":
			reply = `{"id":{id},"ok":true,"pad":"` + strings.Repeat("x", trainer.MaxFrameBytes) + `"}`
		}
		if _, err := out.WriteString(strings.ReplaceAll(reply, "{id}", strconv.FormatInt(req.ID, 10)) + "\n"); err != nil {
			return 1
		}
		if req.Op == "shutdown" {
			return 0
		}
	}
}

func workerMain() int {
	var in struct {
		Spec     trainer.Spec
		Rollouts string
	}
	if err := json.Unmarshal([]byte(os.Getenv(workerSpecEnv)), &in); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	m := trainer.NewManager(trainer.Options{})
	if _, err := m.Train(context.Background(), "r1", in.Spec, trainer.TrainRequest{Iteration: 1, Rollouts: in.Rollouts}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	pid, _, _ := m.Running("r1")
	fmt.Println(pid)
	for {
		time.Sleep(time.Hour) // until the test kills this worker
	}
}

// env is what every trainer of these tests gets.
func testEnv(t *testing.T, role string, extra ...string) []string {
	return append(append(os.Environ(), roleEnv+"="+role, trainertest.EnvShmDir+"="+t.TempDir(),
		trainertest.EnvShapes+"=model.embed.weight=16x8,model.layers.0.w=8x8,model.norm.weight=8"), extra...)
}

// newSpec is a spec running this test binary as role, checkpointing every k.
func newSpec(t *testing.T, role string, k int, env ...string) trainer.Spec {
	exe, err := os.Executable()
	require.NoError(t, err)
	dir := t.TempDir()
	return trainer.Spec{
		Command: []string{exe}, Dir: dir, Env: testEnv(t, role, env...),
		CheckpointDir: filepath.Join(dir, "checkpoints", "r1"), CheckpointEvery: k,
		StartTimeout: 20 * time.Second, KillGrace: 5 * time.Second,
		LogPath: filepath.Join(dir, "trainer.log"),
	}
}

// rolloutFiles writes n rollouts files with distinct content (the same for
// every test, so runs compare), iteration i at index i-1.
func rolloutFiles(t *testing.T, n int) []string {
	dir := t.TempDir()
	var files []string
	for i := 1; i <= n; i++ {
		p := filepath.Join(dir, fmt.Sprintf("rollouts-%d.jsonl", i))
		var b strings.Builder
		for j := range 3 {
			fmt.Fprintf(&b, `{"iteration":%d,"sample":%d,"text":"answer %d"}`+"\n", i, j, i*j)
		}
		require.NoError(t, os.WriteFile(p, []byte(b.String()), 0o600))
		files = append(files, p)
	}
	return files
}

func kindOf(err error) trainer.ErrorKind {
	var e *trainer.Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return 0
}

func digest(t *testing.T, s *trainer.Snapshot) map[string]string {
	t.Helper()
	d, err := trainertest.WeightsDigest(s.Path, s)
	require.NoError(t, err)
	return d
}

func readFile(t *testing.T, path string) string {
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return string(b)
}

func journalIterations(t *testing.T, dir string) []int {
	b, err := os.ReadFile(filepath.Join(dir, trainer.JournalFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(t, err)
	var its []int
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if l == "" {
			continue
		}
		var v struct{ Iteration int }
		require.NoError(t, json.Unmarshal([]byte(l), &v))
		its = append(its, v.Iteration)
	}
	return its
}

func TestEveryOperationRoundTrips(t *testing.T) {
	ctx := context.Background()
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(ctx) })
	spec := newSpec(t, roleFake, 2, trainer.EnvDevice+"=9") // the supervisor's own value comes last and wins
	spec.Device = 1
	ro := rolloutFiles(t, 3)

	res, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0], Args: map[string]any{"lr": 0.1}})
	require.NoError(t, err)
	require.NotNil(t, res.Restart)
	assert.Equal(t, trainer.Restart{Generation: 1, Cause: "no trainer for this run on this worker", Seconds: res.Restart.Seconds}, *res.Restart)
	assert.Equal(t, float64(3), res.Metrics["samples"])
	assert.False(t, res.FromJournal)
	assert.Empty(t, res.Checkpoint)
	pid, gen, ok := m.Running("r1")
	require.True(t, ok)
	assert.Equal(t, 1, gen)
	assert.Equal(t, []int{1}, journalIterations(t, spec.CheckpointDir))
	st, err := os.Stat(spec.CheckpointDir)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), st.Mode().Perm())
	st, err = os.Stat(spec.LogPath)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	res, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 2, Rollouts: ro[1]})
	require.NoError(t, err)
	assert.Nil(t, res.Restart)
	assert.Equal(t, filepath.Join(spec.CheckpointDir, "ckpt-2"), res.Checkpoint)
	assert.Equal(t, "ckpt-2\n", readFile(t, filepath.Join(spec.CheckpointDir, trainer.LatestFile)))
	assert.Equal(t, []int{2}, journalIterations(t, spec.CheckpointDir), "the checkpoint holds iterations 1 and 2; its own line stays")
	// A retry of the iteration just checkpointed (its result lost) is
	// answered from the journal, not refused as a gap.
	retried, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 2, Rollouts: ro[1]})
	require.NoError(t, err)
	assert.True(t, retried.FromJournal)
	assert.Equal(t, res.Metrics, retried.Metrics)
	_, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 3, Rollouts: ro[2]})
	require.NoError(t, err)
	assert.Equal(t, []int{2, 3}, journalIterations(t, spec.CheckpointDir))

	s, rs, err := m.Publish(ctx, "r1", spec, "v3", trainer.DTypeKeep)
	require.NoError(t, err)
	assert.Nil(t, rs)
	assert.Equal(t, fmt.Sprintf("pid %d generation 1", pid), s.Owner)
	assert.Equal(t, 1, s.Device)
	assert.Equal(t, []string{"model.embed.weight", "model.layers.0.w", "model.norm.weight"},
		[]string{s.Tensors[0].Name, s.Tensors[1].Name, s.Tensors[2].Name})
	require.NoError(t, s.Validate())
	weights := digest(t, s)
	_, _, err = m.Publish(ctx, "r1", spec, "v3b", trainer.DTypeKeep)
	assert.Equal(t, trainer.Refused, kindOf(err), "%v", err)
	assert.EqualError(t, err, "run r1: publish of version v3b: refused by the trainer: the previous version is not released yet")
	require.NoError(t, m.Release(ctx, "r1", "v3"))
	half, _, err := m.Publish(ctx, "r1", spec, "v3-bf16", trainer.DTypeBFloat16)
	require.NoError(t, err)
	assert.Equal(t, s.Path, half.Path)
	assert.Equal(t, s.Bytes()/2, half.Bytes())
	require.NoError(t, m.Release(ctx, "r1", "v3-bf16"))
	assert.Nil(t, s.Refs, "not asked for")
	withRefs, rs, err := m.PublishWith(ctx, "r1", spec, trainer.PublishRequest{Version: "v3-refs", DType: trainer.DTypeKeep, IPCRefs: true})
	require.NoError(t, err)
	assert.Nil(t, rs)
	fake := []byte(trainertest.FakeRefCounterHandle)
	assert.Equal(t, []trainer.IPCRef{{CounterHandle: fake, CounterOffset: 0}, {CounterHandle: fake, CounterOffset: 1}, {CounterHandle: fake, CounterOffset: 2}},
		withRefs.Refs, "one per tensor, in order")
	assert.Equal(t, weights, digest(t, withRefs))
	require.NoError(t, m.Release(ctx, "r1", "v3-refs"))

	sv, rs, err := m.Save(ctx, "r1", spec, 3)
	require.NoError(t, err)
	assert.Nil(t, rs)
	assert.Equal(t, filepath.Join(spec.CheckpointDir, "ckpt-3"), sv.Path)
	assert.Positive(t, sv.Bytes)
	assert.Equal(t, "ckpt-3\n", readFile(t, filepath.Join(spec.CheckpointDir, trainer.LatestFile)))
	assert.Equal(t, []int{3}, journalIterations(t, spec.CheckpointDir))
	_, _, err = m.Save(ctx, "r1", spec, 2)
	assert.Equal(t, trainer.BadInput, kindOf(err))
	assert.EqualError(t, err, "run r1: save_checkpoint of iteration 2: the trainer is at iteration 3")

	require.NoError(t, m.Stop(ctx, "r1"))
	_, _, ok = m.Running("r1")
	assert.False(t, ok)
	again, rs, err := m.Save(ctx, "r1", spec, 3)
	require.NoError(t, err)
	assert.Nil(t, rs, "LATEST names the checkpoint: answered without a trainer")
	assert.Equal(t, sv.Path, again.Path)
	_, _, ok = m.Running("r1")
	assert.False(t, ok)
	require.NoError(t, m.Release(ctx, "r1", "v-none"), "no trainer: nothing to release")

	s, rs, err = m.Publish(ctx, "r1", spec, "v3c", trainer.DTypeKeep)
	require.NoError(t, err)
	require.NotNil(t, rs)
	assert.Equal(t, 2, rs.Generation)
	assert.Equal(t, fmt.Sprintf("trainer pid %d was ended: stopped by the worker", pid), rs.Cause)
	assert.Equal(t, 3, rs.RestoredFrom)
	assert.Equal(t, sv.Path, rs.Checkpoint)
	assert.Empty(t, rs.Replayed)
	assert.Equal(t, weights, digest(t, s), "the checkpoint restores the weights bit for bit")
	assert.Contains(t, readFile(t, spec.LogPath), "fake-trainer: pid", "stdout and stderr go to the log")
}

// runIterations trains 1..len(ro) and publishes, retrying a call once
// after Died as the workflow does; it returns the published digests
// (keep and bfloat16) and every Restart seen, by call.
func runIterations(t *testing.T, m *trainer.Manager, spec trainer.Spec, ro []string) (keep, bf16 map[string]string, restarts map[string]*trainer.Restart) {
	ctx := context.Background()
	restarts = map[string]*trainer.Restart{}
	for i, r := range ro {
		call := fmt.Sprintf("train %d", i+1)
		res, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: i + 1, Rollouts: r})
		if kindOf(err) == trainer.Died {
			restarts[call+" failed"] = &trainer.Restart{Cause: err.Error()}
			res, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: i + 1, Rollouts: r})
		}
		require.NoError(t, err, call)
		if res.FromJournal {
			restarts[call+" from the journal"] = &trainer.Restart{}
		}
		if res.Restart != nil && res.Restart.Generation > 1 {
			restarts[call] = res.Restart
		}
	}
	publish := func(version, dtype string) map[string]string {
		s, rs, err := m.Publish(ctx, "r1", spec, version, dtype)
		if kindOf(err) == trainer.Died {
			restarts["publish "+version+" failed"] = &trainer.Restart{Cause: err.Error()}
			s, rs, err = m.Publish(ctx, "r1", spec, version, dtype)
		}
		require.NoError(t, err)
		if rs != nil && rs.Generation > 1 {
			restarts["publish "+version] = rs
		}
		d := digest(t, s)
		require.NoError(t, m.Release(ctx, "r1", version))
		return d
	}
	return publish("v-keep", trainer.DTypeKeep), publish("v-bf16", trainer.DTypeBFloat16), restarts
}

func TestRestartAfterSIGKILLReplaysToTheSameBytes(t *testing.T) {
	ro := rolloutFiles(t, 5)
	newManager := func(t *testing.T) *trainer.Manager {
		m := trainer.NewManager(trainer.Options{})
		t.Cleanup(func() { _ = m.Close(context.Background()) })
		return m
	}
	wantKeep, wantBF16, restarts := runIterations(t, newManager(t), newSpec(t, roleFake, 2), ro)
	require.Empty(t, restarts)

	for _, tc := range []struct {
		die  string
		want map[string]trainer.Restart // by call: RestoredFrom, Replayed, and a Cause pattern
	}{
		{"train:3", map[string]trainer.Restart{
			"train 3 failed": {Cause: `^run r1: train of iteration 3: trainer pid \d+ killed by signal 9 \(log .*trainer.log\)$`},
			"train 3":        {Generation: 2, Cause: `^trainer pid \d+ killed by signal 9 during train of iteration 3$`, RestoredFrom: 2},
		}},
		{"train:4", map[string]trainer.Restart{
			"train 4 failed": {Cause: `train of iteration 4: trainer pid \d+ killed by signal 9`},
			"train 4":        {Generation: 2, Cause: `during train of iteration 4$`, RestoredFrom: 2, Replayed: []int{3}},
		}},
		{"train:3,train:4", map[string]trainer.Restart{
			"train 3 failed": {Cause: `train of iteration 3`},
			"train 3":        {Generation: 2, Cause: `during train of iteration 3$`, RestoredFrom: 2},
			"train 4 failed": {Cause: `train of iteration 4`},
			"train 4":        {Generation: 3, Cause: `during train of iteration 4$`, RestoredFrom: 2, Replayed: []int{3}},
		}},
		{"save:4", map[string]trainer.Restart{
			// Iteration 4 was journaled before its save died: its retry
			// is answered from the journal, iteration 5 restarts.
			"train 4 failed":           {Cause: `train of iteration 4: saving its checkpoint: save of iteration 4: trainer pid \d+ killed by signal 9`},
			"train 4 from the journal": {},
			"train 5":                  {Generation: 2, Cause: `during save of iteration 4$`, RestoredFrom: 2, Replayed: []int{3, 4}},
		}},
		{"publish:5", map[string]trainer.Restart{
			"publish v-keep failed": {Cause: `publish of version v-keep: trainer pid \d+ killed by signal 9`},
			"publish v-keep":        {Generation: 2, Cause: `during publish of version v-keep$`, RestoredFrom: 4, Replayed: []int{5}},
		}},
	} {
		t.Run(tc.die, func(t *testing.T) {
			spec := newSpec(t, roleFake, 2, trainertest.EnvDie+"="+tc.die, trainertest.EnvMarkerDir+"="+t.TempDir())
			keep, bf16, restarts := runIterations(t, newManager(t), spec, ro)
			assert.Equal(t, wantKeep, keep, "published weights equal the undisturbed run's byte for byte")
			assert.Equal(t, wantBF16, bf16)
			require.Len(t, restarts, len(tc.want), "%v", restarts)
			for call, want := range tc.want {
				got := restarts[call]
				require.NotNil(t, got, call)
				assert.Regexp(t, want.Cause, got.Cause, call)
				if want.Generation != 0 {
					assert.Equal(t, want.Generation, got.Generation, call)
					assert.Equal(t, want.RestoredFrom, got.RestoredFrom, call)
					assert.Equal(t, filepath.Join(spec.CheckpointDir, fmt.Sprintf("ckpt-%d", want.RestoredFrom)), got.Checkpoint, call)
					assert.Equal(t, want.Replayed, got.Replayed, call)
				}
			}
		})
	}
}

func TestARetriedTrainIsAnsweredFromTheJournal(t *testing.T) {
	ctx := context.Background()
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(ctx) })
	spec := newSpec(t, roleFake, 5)
	ro := rolloutFiles(t, 2)
	first, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	require.NoError(t, err)
	require.NoError(t, m.Stop(ctx, "r1"))

	again, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	require.NoError(t, err)
	assert.Equal(t, trainer.TrainResult{Iteration: 1, Metrics: first.Metrics, Seconds: first.Seconds, StepDoneUnix: first.StepDoneUnix, FromJournal: true}, again)
	_, _, ok := m.Running("r1")
	assert.False(t, ok, "nothing was started to answer it")

	_, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[1]})
	assert.Equal(t, trainer.BadInput, kindOf(err))
	assert.EqualError(t, err, fmt.Sprintf("run r1: train of iteration 1: the journal holds this iteration trained on %s, not %s", ro[0], ro[1]))
}

func TestATrainThatSkipsAnIterationIsBadInput(t *testing.T) {
	ctx := context.Background()
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(ctx) })
	spec := newSpec(t, roleFake, 5)
	ro := rolloutFiles(t, 3)
	_, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	require.NoError(t, err)
	_, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 3, Rollouts: ro[2]})
	assert.Equal(t, trainer.BadInput, kindOf(err))
	assert.EqualError(t, err, "run r1: train of iteration 3: the trainer is at iteration 1, so the next it can train is 2")

	_, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 0, Rollouts: "rel"})
	assert.EqualError(t, err, "run r1: train of iteration 0: invalid train request: iteration: 0, want >= 1\nrollouts: not an absolute path")
	_, _, err = m.Publish(ctx, "r1", spec, "v", "float8")
	assert.EqualError(t, err, "run r1: publish of version v: dtype: want keep, bfloat16 or float16")
}

// A refused train may have left the model half updated: the trainer is
// ended, and the next call restores it.
func TestARefusedTrainEndsTheTrainer(t *testing.T) {
	ctx := context.Background()
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(ctx) })
	spec := newSpec(t, roleFake, 5)
	missing := filepath.Join(t.TempDir(), "none.jsonl")
	_, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: missing})
	assert.Equal(t, trainer.Refused, kindOf(err))
	assert.False(t, kindOf(err).Retryable())
	assert.EqualError(t, err, fmt.Sprintf("run r1: train of iteration 1: refused by the trainer: reading the rollouts: open %s: no such file or directory", missing))
	_, _, ok := m.Running("r1")
	assert.False(t, ok)
	assert.Empty(t, journalIterations(t, spec.CheckpointDir))
	res, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: rolloutFiles(t, 1)[0]})
	require.NoError(t, err)
	require.NotNil(t, res.Restart)
	assert.Equal(t, 2, res.Restart.Generation)
	assert.Contains(t, res.Restart.Cause, "its train was refused")
}

func TestLostWhenTheRunCannotBeRestored(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, spec trainer.Spec, ro []string)
		err   string
	}{
		{"a journal line's rollouts file is gone", func(t *testing.T, spec trainer.Spec, ro []string) {
			require.NoError(t, os.Remove(ro[2]))
			require.NoError(t, os.Remove(ro[3]))
		}, `^run r1: train of iteration 5: starting trainer generation 2: cannot replay the journal after checkpoint iteration 2: ` +
			`the rollouts of iteration 3 \(\S+/rollouts-3.jsonl: no such file or directory\), iteration 4 \(\S+/rollouts-4.jsonl: no such file or directory\) are gone$`},
		{"the checkpoint LATEST names is gone", func(t *testing.T, spec trainer.Spec, ro []string) {
			require.NoError(t, os.RemoveAll(filepath.Join(spec.CheckpointDir, "ckpt-2")))
		}, `^run r1: train of iteration 5: starting trainer generation 2: \S+/LATEST names checkpoint \S+/ckpt-2, which is not a directory$`},
		{"the checkpoint is unreadable", func(t *testing.T, spec trainer.Spec, ro []string) {
			require.NoError(t, os.WriteFile(filepath.Join(spec.CheckpointDir, "ckpt-2", "state.json"), []byte("{"), 0o600))
		}, `^run r1: train of iteration 5: starting trainer generation 2: checkpoint \S+/ckpt-2 is unreadable: load: refused by the trainer: \S+/ckpt-2/state.json: not a fake trainer checkpoint$`},
		{"the journal is corrupt", func(t *testing.T, spec trainer.Spec, ro []string) {
			require.NoError(t, os.WriteFile(filepath.Join(spec.CheckpointDir, trainer.JournalFile), []byte("{\"iteration\":3}\n{]\n"), 0o600))
		}, `^run r1: train of iteration 5: \S+/journal.jsonl line 1: not a journal line$`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := trainer.NewManager(trainer.Options{})
			t.Cleanup(func() { _ = m.Close(ctx) })
			spec := newSpec(t, roleFake, 2)
			ro := rolloutFiles(t, 5)
			// ckpt-2, then iterations 3 and 4 only in the journal.
			for i := 1; i <= 4; i++ {
				if i == 3 {
					spec.CheckpointEvery = 5
				}
				_, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: i, Rollouts: ro[i-1]})
				require.NoError(t, err)
			}
			require.Equal(t, []int{2, 3, 4}, journalIterations(t, spec.CheckpointDir))
			require.NoError(t, m.Stop(ctx, "r1"))
			tc.spoil(t, spec, ro)

			_, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 5, Rollouts: ro[4]})
			assert.Equal(t, trainer.Lost, kindOf(err), "%v", err)
			assert.Regexp(t, tc.err, err.Error())
		})
	}
}

// TestProtocolErrorsGolden: a trainer whose reply breaks the protocol
// fails the call with a Protocol error naming the frame and the field, and
// is killed (the next call starts another).
func TestProtocolErrorsGolden(t *testing.T) {
	ctx := context.Background()
	tensors := `[{"name":"a","dtype":"float32","shape":[4],"offset":0,"bytes":16},{"name":"b","dtype":"float32","shape":[2],"offset":%d,"bytes":8}]`
	publish := `{"id":{id},"ok":true,"version":"v1","ipc":"fake_shm","path":"/dev/shm/x","storage_bytes":%d,"storage_offset":0,"device":0,"snapshot_seconds":0,"tensors":` + tensors + `}`
	cases := []struct{ name, op, script string }{
		{"wrong id", "train", `{"id":99,"ok":true}`},
		{"bad json", "train", `{"id":{id},"ok":true,`},
		{"missing field", "train", `{"id":{id},"ok":true,"iteration":1,"metrics":{},"seconds":1}`},
		{"another iteration", "train", `{"id":{id},"ok":true,"iteration":2,"metrics":{},"seconds":1,"step_done_unix":1}`},
		{"oversize line", "train", "oversize"},
		{"overlapping tensors", "publish", fmt.Sprintf(publish, 24, 12)},
		{"misaligned tensor", "publish", fmt.Sprintf(publish, 24, 18)},
		{"tensor past the storage", "publish", fmt.Sprintf(publish, 20, 16)},
		{"another version", "publish", strings.Replace(fmt.Sprintf(publish, 24, 16), `"v1"`, `"v0"`, 1)},
		{"another device", "publish", strings.Replace(fmt.Sprintf(publish, 24, 16), `"device":0`, `"device":1`, 1)},
		{"float32 left in a bfloat16 publish", "publish-bf16", fmt.Sprintf(publish, 24, 16)},
		{"ipc_refs asked for, missing", "publish-refs", fmt.Sprintf(publish, 24, 16)},
		{"ipc_refs not asked for", "publish", strings.Replace(fmt.Sprintf(publish, 24, 16), `"tensors"`, `"ipc_refs":[],"tensors"`, 1)},
		{"ipc_refs one for two tensors", "publish-refs", strings.Replace(fmt.Sprintf(publish, 24, 16), `"tensors"`,
			`"ipc_refs":[{"ref_counter_handle":"eA==","ref_counter_offset":0,"event_handle":null,"event_sync_required":false}],"tensors"`, 1)},
		{"exit without a reply (died, not protocol)", "train", "exit"},
	}
	ro := rolloutFiles(t, 1)
	var b strings.Builder
	for _, tc := range cases {
		m := trainer.NewManager(trainer.Options{})
		spec := newSpec(t, roleScript, 5, scriptEnv+"="+tc.script)
		var err error
		switch tc.op {
		case "train":
			_, err = m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
		case "publish":
			_, _, err = m.Publish(ctx, "r1", spec, "v1", trainer.DTypeKeep)
		case "publish-bf16":
			_, _, err = m.Publish(ctx, "r1", spec, "v1", trainer.DTypeBFloat16)
		case "publish-refs":
			_, _, err = m.PublishWith(ctx, "r1", spec, trainer.PublishRequest{Version: "v1", DType: trainer.DTypeKeep, IPCRefs: true})
		}
		require.Error(t, err, tc.name)
		_, _, running := m.Running("r1")
		assert.False(t, running, "%s: the trainer is killed", tc.name)
		msg := regexp.MustCompile(`pid \d+`).ReplaceAllString(err.Error(), "pid N")
		msg = strings.ReplaceAll(msg, spec.LogPath, "$LOG")
		fmt.Fprintf(&b, "%s (%s)\n\t%s\n", tc.name, kindOf(err), msg)
		require.NoError(t, m.Close(ctx))
	}
	golden(t, "call_errors.golden", b.String())
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	goldenfile.Check(t, name, got, trainer.UpdateGolden(), "go test ./trainer -update")
}

// fifoRollouts is a rollouts path that is a FIFO: the trainer's open of it
// blocks until the test opens it for writing, so the test knows the train
// is under way without polling.
func fifoRollouts(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "rollouts.fifo")
	require.NoError(t, syscall.Mkfifo(p, 0o600))
	return p
}

// childPID reads the fake's "child pid N" log line.
func childPID(t *testing.T, log string) int {
	m := regexp.MustCompile(`child pid (\d+)`).FindStringSubmatch(readFile(t, log))
	require.NotNil(t, m, "the fake logged its child")
	pid, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	return pid
}

func TestCancellingACallKillsTheProcessGroup(t *testing.T) {
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	spec := newSpec(t, roleFake, 5, trainertest.EnvChild+"=1")
	spec.KillGrace = 10 * time.Second // SIGTERM ends both: the grace is not waited out
	fifo := fifoRollouts(t)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := m.Train(ctx, "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: fifo})
		errc <- err
	}()
	w, err := os.OpenFile(fifo, os.O_WRONLY, 0) // returns once the trainer opened it: train is under way
	require.NoError(t, err)
	defer w.Close()
	pid, _, ok := m.Running("r1")
	require.True(t, ok)
	trainerID, err := procs.Of(pid)
	require.NoError(t, err)
	childID, err := procs.Of(childPID(t, spec.LogPath))
	require.NoError(t, err)
	st, err := procs.ReadStat(childID.PID)
	require.NoError(t, err)
	require.Equal(t, pid, st.PGID, "the child is in the trainer's group")

	began := time.Now()
	cancel()
	err = <-errc
	assert.Equal(t, trainer.Died, kindOf(err))
	assert.ErrorIs(t, err, context.Canceled)
	assert.Regexp(t, `^run r1: train of iteration 1: trainer pid \d+ ended because the call ended: context canceled$`, err.Error())
	assert.False(t, trainerID.Alive(), "the trainer is gone when Train returns")
	assert.False(t, childID.Alive(), "and so is its child")
	assert.Less(t, time.Since(began), spec.KillGrace)
	_, _, ok = m.Running("r1")
	assert.False(t, ok)

	// The next call restarts it, saying why.
	ro := rolloutFiles(t, 1)
	res, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	require.NoError(t, err)
	assert.Equal(t, 2, res.Restart.Generation)
	assert.Equal(t, fmt.Sprintf("trainer pid %d was ended: train of iteration 1 was cancelled (context canceled)", pid), res.Restart.Cause)
}

func TestAnIdleTrainerIsStopped(t *testing.T) {
	m := trainer.NewManager(trainer.Options{IdleTimeout: 50 * time.Millisecond})
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	stopped := make(chan string, 1)
	trainer.SetIdleStopped(m, func(runID string) { stopped <- runID })
	spec := newSpec(t, roleFake, 5)
	ro := rolloutFiles(t, 2)
	_, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	require.NoError(t, err)
	pid, _, _ := m.Running("r1")
	assert.Equal(t, "r1", <-stopped)
	_, _, ok := m.Running("r1")
	assert.False(t, ok)
	assert.Contains(t, readFile(t, spec.LogPath), "fake-trainer: shutdown", "it was asked to shut down first")

	res, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 2, Rollouts: ro[1]})
	require.NoError(t, err)
	require.NotNil(t, res.Restart)
	assert.Equal(t, fmt.Sprintf("trainer pid %d was ended: stopped after 50ms without a call", pid), res.Restart.Cause)
	assert.Equal(t, []int{1}, res.Restart.Replayed)
}

func TestATrainerThatDiesWhileIdleIsRestartedByTheNextCall(t *testing.T) {
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	spec := newSpec(t, roleFake, 5)
	ro := rolloutFiles(t, 2)
	_, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	require.NoError(t, err)
	_, _, err = m.Publish(context.Background(), "r1", spec, "v1", trainer.DTypeKeep) // not released before the death
	require.NoError(t, err)
	pid, _, _ := m.Running("r1")
	exited := trainer.Exited(m, "r1")
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	<-exited
	_, _, ok := m.Running("r1")
	assert.False(t, ok)

	res, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 2, Rollouts: ro[1]})
	require.NoError(t, err)
	require.NotNil(t, res.Restart)
	assert.Equal(t, trainer.Restart{Generation: 2, Cause: fmt.Sprintf("trainer pid %d killed by signal 9 while idle", pid),
		Replayed: []int{1}, Seconds: res.Restart.Seconds}, *res.Restart)
	require.NoError(t, m.Release(context.Background(), "r1", "v1"), "v1's snapshot went with generation 1: nothing to release")
	_, _, err = m.Publish(context.Background(), "r1", spec, "v2", trainer.DTypeKeep)
	require.NoError(t, err)
}

func TestAStartPastStartTimeoutIsATimeout(t *testing.T) {
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	spec := newSpec(t, roleFake, 5, trainertest.EnvHelloDelay+"=1h")
	spec.StartTimeout = 100 * time.Millisecond
	ro := rolloutFiles(t, 1)
	_, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
	assert.Equal(t, trainer.Timeout, kindOf(err))
	assert.Equal(t, fmt.Sprintf("run r1: train of iteration 1: starting trainer generation 1: hello: not done within the start timeout 100ms (log %s)", spec.LogPath), err.Error())
	_, _, ok := m.Running("r1")
	assert.False(t, ok)
}

func TestTheTrainerDiesWithItsWorker(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	spec := newSpec(t, roleFake, 5)
	ro := rolloutFiles(t, 1)
	in, err := json.Marshal(map[string]any{"Spec": spec, "Rollouts": ro[0]})
	require.NoError(t, err)
	worker := exec.Command(exe)
	worker.Env = append(os.Environ(), roleEnv+"="+roleWorker, workerSpecEnv+"="+string(in))
	worker.Stderr = os.Stderr
	out, err := worker.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, worker.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	require.NoError(t, err)
	id, err := procs.Of(pid)
	require.NoError(t, err)
	require.True(t, id.Alive())

	require.NoError(t, worker.Process.Signal(syscall.SIGKILL))
	_ = worker.Wait()
	// Not this process's child: its end is seen in /proc. Pdeathsig (and
	// end of file on fd 3) end it at once; the deadline is generous.
	deadline := time.Now().Add(10 * time.Second)
	for id.Alive() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	assert.False(t, id.Alive(), "the trainer outlived its worker")
}

// TestATrainerOutlivesTheThreadThatStartedIt: Pdeathsig follows the
// forking thread, and a goroutine that exits locked ends its thread; the
// trainer must not die with it.
func TestATrainerOutlivesTheThreadThatStartedIt(t *testing.T) {
	m := trainer.NewManager(trainer.Options{})
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	spec := newSpec(t, roleFake, 5)
	ro := rolloutFiles(t, 2)
	type started struct {
		tid int
		err error
	}
	done := make(chan started, 1)
	for s := (started{}); s.tid == 0; {
		go func() {
			runtime.LockOSThread()
			if syscall.Gettid() == os.Getpid() {
				// The main thread is never ended; try another.
				runtime.UnlockOSThread()
				done <- started{}
				return
			}
			// Never unlocked: the thread ends with the goroutine.
			_, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 1, Rollouts: ro[0]})
			done <- started{syscall.Gettid(), err}
		}()
		s = <-done
		require.NoError(t, s.err)
		if s.tid == 0 {
			continue
		}
		task := fmt.Sprintf("/proc/self/task/%d", s.tid)
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) { // the runtime ends the thread after the goroutine returned
			if _, err := os.Stat(task); errors.Is(err, os.ErrNotExist) {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		require.NoDirExists(t, task, "the thread that started the trainer ended")
	}
	res, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 2, Rollouts: ro[1]})
	require.NoError(t, err)
	assert.Nil(t, res.Restart, "the trainer still runs")
}

// keep_checkpoints: after each save only the newest K checkpoints stay,
// LATEST's among them, and a trainer killed after that restarts from the
// one kept; 0 keeps every one.
func TestKeepCheckpoints(t *testing.T) {
	ro := rolloutFiles(t, 5)
	left := func(spec trainer.Spec) []string {
		ents, err := os.ReadDir(spec.CheckpointDir)
		require.NoError(t, err)
		var out []string
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), trainer.CheckpointPrefix) {
				out = append(out, e.Name())
			}
		}
		return out
	}
	for _, tc := range []struct {
		keep int
		want []string
	}{
		{0, []string{"ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5"}},
		{2, []string{"ckpt-4", "ckpt-5"}},
		{1, []string{"ckpt-5"}},
	} {
		t.Run(fmt.Sprint("keep ", tc.keep), func(t *testing.T) {
			m := trainer.NewManager(trainer.Options{})
			t.Cleanup(func() { _ = m.Close(context.Background()) })
			spec := newSpec(t, roleFake, 1)
			spec.KeepCheckpoints = tc.keep
			for i := 1; i <= 5; i++ {
				_, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: i, Rollouts: ro[i-1]})
				require.NoError(t, err)
			}
			assert.Equal(t, tc.want, left(spec))
			if tc.keep != 1 {
				return
			}
			// SIGKILLed now, the trainer restarts from the one kept.
			pid, _, ok := m.Running("r1")
			require.True(t, ok)
			exited := trainer.Exited(m, "r1")
			require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
			<-exited
			res, err := m.Train(context.Background(), "r1", spec, trainer.TrainRequest{Iteration: 6, Rollouts: ro[4]})
			require.NoError(t, err)
			require.NotNil(t, res.Restart)
			assert.Equal(t, 5, res.Restart.RestoredFrom)
			assert.Equal(t, []string{"ckpt-6"}, left(spec))
		})
	}
	spec := newSpec(t, roleFake, 1)
	spec.KeepCheckpoints = -1
	assert.ErrorContains(t, spec.Validate(), "spec.keep_checkpoints: -1, want >= 0")
}
