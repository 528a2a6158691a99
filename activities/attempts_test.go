package activities

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/procs"
)

// attemptN is the nth attempt of one Temporal activity, with a minute
// before its deadline.
func attemptN(n int) attemptInfo {
	return attemptInfo{Attempt: n, WorkflowID: "run-1/iter-2", WorkflowRunID: "wf-run", ActivityID: "train",
		Deadline: time.Now().Add(time.Minute)}
}

// execRig runs exec steps whose commands write pid files to $P and wait
// for $P/go before finishing; it kills every pid written at the end.
type execRig struct {
	t   *testing.T
	a   *Activities
	sc  pipelines.StepContext
	dir string
}

func newExecRig(t *testing.T) *execRig {
	r := &execRig{t: t, a: newActivities(t), sc: stepContext(t, "train"), dir: t.TempDir()}
	t.Cleanup(func() {
		for _, pid := range pidFiles(r.dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		// A tree that was still forking when the step ended (a setsid'd
		// grandchild that had not written its pid file yet) would write
		// into r.dir while t.TempDir removes it: kill every process of
		// the test's scripts (they carry P=r.dir) until none is left.
		killScripts(t, "P="+r.dir)
	})
	return r
}

// killScripts SIGKILLs every process whose environment holds env, until
// none is left (bounded).
func killScripts(t *testing.T, env string) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var found []int
		procDirs, _ := os.ReadDir("/proc")
		for _, d := range procDirs {
			pid, err := strconv.Atoi(d.Name())
			if err != nil || pid == os.Getpid() {
				continue
			}
			b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "environ"))
			if err != nil {
				continue
			}
			for _, kv := range strings.Split(string(b), "\x00") {
				if kv == env {
					found = append(found, pid)
					break
				}
			}
		}
		if len(found) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("processes %v of the test's scripts would not die", found)
			return
		}
		for _, pid := range found {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *execRig) input(script string) ExecInput {
	return ExecInput{Context: r.sc, Command: []string{"sh", "-c", script}, Env: map[string]string{"P": r.dir},
		KillGrace: pipelines.Duration(200 * time.Millisecond)}
}

// pidFiles reads the pid files under dir (not *.tmp), by name.
func pidFiles(dir string) map[string]int {
	out := map[string]int{}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			out[e.Name()] = n
		}
	}
	return out
}

func (r *execRig) waitFor(what string, cond func() bool) {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			r.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (r *execRig) waitPIDs(names ...string) map[string]int {
	r.t.Helper()
	r.waitFor("pid files "+strings.Join(names, ", "), func() bool {
		p := pidFiles(r.dir)
		for _, n := range names {
			if p[n] == 0 {
				return false
			}
		}
		return true
	})
	return pidFiles(r.dir)
}

func (r *execRig) records() map[string]attemptRecord {
	r.t.Helper()
	recs, err := readRecords(r.a.attemptsDir(), "")
	require.NoError(r.t, err)
	return recs
}

// alive reports whether pid runs (exists and is no zombie).
func alive(pid int) bool {
	st, err := procs.ReadStat(pid)
	return err == nil && st.State != 'Z' && st.State != 'X'
}

// runExec runs the step in the background; the result comes on the channel.
type execResult struct {
	out *ExecOutput
	err error
}

func (r *execRig) start(ctx context.Context, in ExecInput, at attemptInfo) <-chan execResult {
	ch := make(chan execResult, 1)
	go func() {
		out, err := r.a.exec(ctx, in, at)
		ch <- execResult{out, err}
	}()
	return ch
}

func await(t *testing.T, ch <-chan execResult) execResult {
	t.Helper()
	select {
	case res := <-ch:
		return res
	case <-time.After(30 * time.Second):
		t.Fatal("exec did not return")
		return execResult{}
	}
}

// A trainer-like tree: a setsid'd grandchild (tagged, out of the group), a
// background child, and a foreground loop waiting for $P/go.
const treeScript = `
echo started >> "$P/starts"
setsid sh -c 'echo $$ > "$P/grandchild.tmp" && mv "$P/grandchild.tmp" "$P/grandchild"; exec sleep 300' &
sleep 300 & echo $! > "$P/child"
echo $$ > "$P/leader"
echo "attempt $RLFLOW_ATTEMPT running"
while [ ! -e "$P/go" ]; do sleep 0.05; done
echo "value=42" >> "$RLFLOW_OUTPUTS"
echo finished`

// When the step is cancelled (or times out), the command's whole tree goes:
// its group and the tagged setsid'd grandchild; the record goes with it.
func TestExecCancelKillsGroupAndTaggedDescendants(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cause error
	}{
		{"workflow cancel", temporal.NewCanceledError()},
		{"worker shutdown", context.Canceled},
		{"activity paused", activity.ErrActivityPaused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newExecRig(t)
			ctx, cancel := context.WithCancelCause(context.Background())
			res := r.start(ctx, r.input(treeScript), attemptN(1))
			pids := r.waitPIDs("leader", "child", "grandchild")
			require.Len(t, r.records(), 1, "the running attempt's record")
			cancel(tc.cause)
			got := await(t, res)
			require.ErrorIs(t, got.err, context.Canceled)
			for name, pid := range pids {
				assert.False(t, alive(pid), "%s (pid %d) survived the cancel", name, pid)
			}
			assert.Empty(t, r.records())
		})
	}
}

func TestExecTimeoutKillsTree(t *testing.T) {
	r := newExecRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	// The attempt's own deadline passing, as Temporal's start-to-close.
	ctx, cancelDeadline := context.WithDeadline(ctx, time.Now().Add(300*time.Millisecond))
	defer cancelDeadline()
	res := r.start(ctx, r.input(treeScript), attemptN(1))
	pids := r.waitPIDs("leader", "child", "grandchild")
	got := await(t, res)
	require.ErrorIs(t, got.err, context.DeadlineExceeded)
	for name, pid := range pids {
		assert.False(t, alive(pid), "%s (pid %d) survived the timeout", name, pid)
	}
	assert.Empty(t, r.records())
}

// The Temporal-outage case: attempt 1's heartbeat finds the server gone or
// the attempt gone, so the command runs on detached; attempt 2 of the same
// activity on this worker adopts it instead of starting a second one, and
// finishes with its exit code, log and outputs.
func TestExecLostAttemptIsAdopted(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cause error
	}{
		{"attempt not found", serviceerror.NewNotFound("workflow execution not found")},
		{"server unavailable", serviceerror.NewUnavailable("connection refused")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newExecRig(t)
			ctx1, lose := context.WithCancelCause(context.Background())
			res1 := r.start(ctx1, r.input(treeScript), attemptN(1))
			pids := r.waitPIDs("leader", "child", "grandchild")
			lose(tc.cause)
			got1 := await(t, res1)
			require.ErrorIs(t, got1.err, context.Canceled)
			for name, pid := range pids {
				assert.True(t, alive(pid), "%s (pid %d) of the lost attempt was killed", name, pid)
			}
			require.Len(t, r.records(), 1, "the detached command keeps its record")

			res2 := r.start(context.Background(), r.input(treeScript), attemptN(2))
			r.waitFor("attempt 2's adoption note", func() bool {
				b, _ := os.ReadFile(filepath.Join(stepDir(r.a.LogDir, r.sc), "attempt-2.log"))
				return strings.Contains(string(b), "adopted the command of attempt 1")
			})
			require.NoError(t, os.WriteFile(filepath.Join(r.dir, "go"), nil, 0o644))
			got2 := await(t, res2)
			require.NoError(t, got2.err)
			logDir := stepDir(r.a.LogDir, r.sc)
			assert.Equal(t, &ExecOutput{ExitCode: 0, Log: filepath.Join(logDir, "attempt-1.log"),
				Values: map[string]any{"value": 42.0}, Attempt: 2, AdoptedAttempt: 1}, got2.out)
			starts, err := os.ReadFile(filepath.Join(r.dir, "starts"))
			require.NoError(t, err)
			assert.Equal(t, "started\n", string(starts), "the command started once")
			log1, err := os.ReadFile(filepath.Join(logDir, "attempt-1.log"))
			require.NoError(t, err)
			assert.Equal(t, "attempt 1 running\nfinished\n", string(log1))
			log2, err := os.ReadFile(filepath.Join(logDir, "attempt-2.log"))
			require.NoError(t, err)
			assert.NotContains(t, string(log2), "running", "attempt 2 ran no command of its own")
			assert.Empty(t, r.records())
			r.a.execs.mu.Lock()
			assert.Empty(t, r.a.execs.slots, "the table forgets the step")
			r.a.execs.mu.Unlock()

			b, err := got2.out.MarshalJSON()
			require.NoError(t, err)
			assert.JSONEq(t, `{"value": 42, "exit_code": 0, "log": "`+filepath.Join(logDir, "attempt-1.log")+`", "_attempt": 2, "_adopted_attempt": 1}`, string(b))
		})
	}
}

// A detached command that ended before the next attempt came is adopted
// too: its result stands (here a failure, typed as if attempt 1 had
// reported it), nothing runs twice.
func TestExecLostAttemptAdoptedAfterItEnded(t *testing.T) {
	r := newExecRig(t)
	script := `echo started >> "$P/starts"; echo $$ > "$P/leader"; while [ ! -e "$P/go" ]; do sleep 0.05; done; echo boom; exit 3`
	ctx1, lose := context.WithCancelCause(context.Background())
	res1 := r.start(ctx1, r.input(script), attemptN(1))
	r.waitPIDs("leader")
	lose(serviceerror.NewNotFound("activity not found"))
	require.ErrorIs(t, await(t, res1).err, context.Canceled)
	require.NoError(t, os.WriteFile(filepath.Join(r.dir, "go"), nil, 0o644))
	r.waitFor("the detached command to end and its record to go", func() bool { return len(r.records()) == 0 })

	got := await(t, r.start(context.Background(), r.input(script), attemptN(2)))
	require.Equal(t, pipelines.ErrTypeExit, errType(t, got.err))
	assert.Contains(t, got.err.Error(), "exited with code 3 (log "+filepath.Join(stepDir(r.a.LogDir, r.sc), "attempt-1.log")+", attempt 1's command)")
	assert.Contains(t, got.err.Error(), "boom")
	starts, err := os.ReadFile(filepath.Join(r.dir, "starts"))
	require.NoError(t, err)
	assert.Equal(t, "started\n", string(starts))
}

// An adopting attempt lost to the server in turn detaches the command
// until its own deadline, so attempt 3 can adopt it after attempt 1's
// deadline has passed; attempt 1's expiry no longer applies.
func TestExecAdoptedCommandIsAdoptedAgain(t *testing.T) {
	r := newExecRig(t)
	first := attemptN(1)
	first.Deadline = time.Now().Add(500 * time.Millisecond)
	ctx1, lose1 := context.WithCancelCause(context.Background())
	res1 := r.start(ctx1, r.input(treeScript), first)
	pids := r.waitPIDs("leader", "child", "grandchild")
	lose1(serviceerror.NewUnavailable("connection refused"))
	require.ErrorIs(t, await(t, res1).err, context.Canceled)

	ctx2, lose2 := context.WithCancelCause(context.Background())
	res2 := r.start(ctx2, r.input(treeScript), attemptN(2))
	r.waitFor("attempt 2's adoption", func() bool {
		b, _ := os.ReadFile(filepath.Join(stepDir(r.a.LogDir, r.sc), "attempt-2.log"))
		return strings.Contains(string(b), "adopted the command of attempt 1")
	})
	lose2(serviceerror.NewNotFound("activity not found"))
	require.ErrorIs(t, await(t, res2).err, context.Canceled)
	time.Sleep(time.Until(first.Deadline.Add(300 * time.Millisecond)))
	for name, pid := range pids {
		require.True(t, alive(pid), "%s (pid %d) died at attempt 1's deadline, though attempt 2 held it since", name, pid)
	}

	res3 := r.start(context.Background(), r.input(treeScript), attemptN(3))
	require.NoError(t, os.WriteFile(filepath.Join(r.dir, "go"), nil, 0o644))
	got := await(t, res3)
	require.NoError(t, got.err)
	assert.Equal(t, 3, got.out.Attempt)
	assert.Equal(t, 1, got.out.AdoptedAttempt)
	assert.Equal(t, 42.0, got.out.Values["value"])
	starts, err := os.ReadFile(filepath.Join(r.dir, "starts"))
	require.NoError(t, err)
	assert.Equal(t, "started\n", string(starts))
}

// What an earlier attempt's live command meets when the next attempt of
// the step starts on this worker: adoption only for a later attempt of the
// same activity before the earlier one's deadline; otherwise it is killed
// (tree and all) before the new command starts.
func TestExecEarlierAttemptKilledUnlessAdoptable(t *testing.T) {
	for _, tc := range []struct {
		name string
		// first is attempt 1's info, second the next attempt's.
		first, second attemptInfo
		// cause ends attempt 1's context; nil leaves it running (the
		// server gave it up without the worker noticing yet).
		cause   error
		adopted bool
	}{
		{"lost, then retried", attemptN(1), attemptN(2), serviceerror.NewNotFound("gone"), true},
		{"still waiting when the retry comes", attemptN(1), attemptN(2), nil, true},
		{"another workflow run (reset)", attemptN(1), func() attemptInfo { a := attemptN(1); a.WorkflowRunID = "other"; return a }(), nil, false},
		{"another activity id (rerouted)", attemptN(1), func() attemptInfo { a := attemptN(2); a.ActivityID = "train/attempt-2"; return a }(), nil, false},
		{"not a later attempt", attemptN(3), attemptN(2), nil, false},
		{"earlier attempt past its deadline", func() attemptInfo { a := attemptN(1); a.Deadline = time.Now().Add(-time.Second); return a }(), attemptN(2), nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newExecRig(t)
			ctx1, end1 := context.WithCancelCause(context.Background())
			defer end1(nil)
			res1 := r.start(ctx1, r.input(treeScript), tc.first)
			pids := r.waitPIDs("leader", "child", "grandchild")
			if tc.cause != nil {
				end1(tc.cause)
				require.ErrorIs(t, await(t, res1).err, context.Canceled)
			}
			res2 := r.start(context.Background(), r.input(treeScript), tc.second)
			if tc.adopted {
				r.waitFor("the adoption", func() bool {
					b, _ := os.ReadFile(filepath.Join(stepDir(r.a.LogDir, r.sc), "attempt-2.log"))
					return strings.Contains(string(b), "adopted")
				})
				if tc.cause == nil {
					got1 := await(t, res1)
					require.Equal(t, pipelines.ErrTypeIO, errType(t, got1.err))
					assert.Contains(t, got1.err.Error(), "a later attempt of this step adopted attempt 1's command")
				}
				for name, pid := range pids {
					assert.True(t, alive(pid), "%s (pid %d) killed although adopted", name, pid)
				}
			} else {
				r.waitFor("the new command to start", func() bool {
					starts, _ := os.ReadFile(filepath.Join(r.dir, "starts"))
					return strings.Count(string(starts), "started") == 2
				})
				for name, pid := range pids {
					assert.False(t, alive(pid), "%s (pid %d) of the earlier attempt alive next to the new one", name, pid)
				}
				if tc.cause == nil {
					got1 := await(t, res1)
					require.Equal(t, pipelines.ErrTypeSignal, errType(t, got1.err), "%v", got1.err)
				}
			}
			require.NoError(t, os.WriteFile(filepath.Join(r.dir, "go"), nil, 0o644))
			got2 := await(t, res2)
			require.NoError(t, got2.err)
			if tc.adopted {
				assert.Equal(t, 1, got2.out.AdoptedAttempt)
			} else {
				assert.Zero(t, got2.out.AdoptedAttempt)
				assert.Equal(t, filepath.Join(stepDir(r.a.LogDir, r.sc), "attempt-"+strconv.Itoa(tc.second.Attempt)+".log"), got2.out.Log)
			}
			assert.Empty(t, r.records())
		})
	}
}

// A lost attempt's command does not detach when no later attempt could
// adopt it (the last allowed attempt, or no known deadline), and a detached
// one nobody adopts dies at its attempt's deadline.
func TestExecLostCommandBounded(t *testing.T) {
	last := attemptN(3)
	last.Last = true
	noDeadline := attemptN(1)
	noDeadline.Deadline = time.Time{}
	soon := attemptN(1)
	soon.Deadline = time.Now().Add(time.Second)
	for _, tc := range []struct {
		name string
		at   attemptInfo
	}{
		{"last attempt", last},
		{"no deadline", noDeadline},
		{"deadline passes", soon},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newExecRig(t)
			ctx, lose := context.WithCancelCause(context.Background())
			res := r.start(ctx, r.input(treeScript), tc.at)
			pids := r.waitPIDs("leader", "child", "grandchild")
			lose(serviceerror.NewUnavailable("connection refused"))
			require.ErrorIs(t, await(t, res).err, context.Canceled)
			r.waitFor("the lost command to die", func() bool {
				for _, pid := range pids {
					if alive(pid) {
						return false
					}
				}
				return len(r.records()) == 0
			})
		})
	}
}

// writeDeadRecord records a tagged tree as an attempt of a worker process
// that no longer exists, as a SIGKILLed worker leaves it.
func (r *execRig) writeDeadRecord(attempt int, script string) (attemptRecord, map[string]int) {
	t := r.t
	tag, err := procs.NewTag()
	require.NoError(t, err)
	cmd := exec.Command("sh", "-c", script)
	cmd.Env = append(os.Environ(), "P="+r.dir, "RLFLOW_ATTEMPT="+strconv.Itoa(attempt), procs.TagEnv+"="+tag)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	go func() { _ = cmd.Wait() }()
	leader, err := procs.Of(cmd.Process.Pid)
	require.NoError(t, err)
	h, err := r.a.execs.self()
	require.NoError(t, err)
	gone := exec.Command("true")
	require.NoError(t, gone.Run())
	rec := attemptRecord{RunID: r.sc.RunID, Iteration: r.sc.Iteration, StepID: r.sc.StepID, Attempt: attempt,
		Leader: leader, Tag: tag, KillGrace: pipelines.Duration(100 * time.Millisecond), Started: time.Now(),
		Owner: procs.Identity{PID: gone.Process.Pid, Start: 1}, Host: h.Name, BootID: h.BootID}
	require.NoError(t, writeRecord(recordPath(r.a.attemptsDir(), stepKey(r.sc), tag), rec))
	return rec, r.waitPIDs("leader", "child", "grandchild")
}

// The next attempt of a step whose earlier attempt's worker died kills
// that attempt's tree before starting its own command.
func TestExecKillsDeadWorkersAttemptBeforeStarting(t *testing.T) {
	r := newExecRig(t)
	_, pids := r.writeDeadRecord(1, treeScript)
	res := r.start(context.Background(), r.input(`
for p in $(cat "$P/leader" "$P/child" "$P/grandchild"); do
  if kill -0 "$p" 2>/dev/null && ! grep -q '^State:.*Z' /proc/$p/status; then echo "alive $p"; fi
done
echo "value=$RLFLOW_ATTEMPT" >> "$RLFLOW_OUTPUTS"`), attemptN(2))
	got := await(t, res)
	require.NoError(t, got.err)
	log, err := os.ReadFile(got.out.Log)
	require.NoError(t, err)
	assert.Empty(t, string(log), "attempt 1's processes were alive when attempt 2's command started")
	assert.Equal(t, 2.0, got.out.Values["value"])
	for name, pid := range pids {
		assert.False(t, alive(pid), "%s (pid %d)", name, pid)
	}
	assert.Empty(t, r.records())
}

// The worker's start-up sweep ends the attempts of dead workers and leaves
// those of live workers and other hosts; a record from an earlier boot
// goes.
func TestExecSweepEndsDeadWorkersAttempts(t *testing.T) {
	r := newExecRig(t)
	rec, pids := r.writeDeadRecord(1, treeScript)
	h, err := r.a.execs.self()
	require.NoError(t, err)
	dir := r.a.attemptsDir()
	keep := map[string]attemptRecord{
		"live worker": {RunID: "r", StepID: "s", Attempt: 1, Tag: "live", Owner: h.Self, Host: h.Name, BootID: h.BootID},
		"other host":  {RunID: "r", StepID: "s", Attempt: 1, Tag: "far", Owner: procs.Identity{PID: 1, Start: 1}, Host: h.Name + "-other", BootID: "x"},
	}
	for name, k := range keep {
		require.NoError(t, writeRecord(filepath.Join(dir, k.Tag+".json"), k), name)
	}
	stale := attemptRecord{RunID: "r", StepID: "s", Attempt: 1, Tag: "stale", Owner: procs.Identity{PID: 1, Start: 1}, Host: h.Name, BootID: "earlier-boot"}
	require.NoError(t, writeRecord(filepath.Join(dir, "stale.json"), stale))

	swept, err := r.a.SweepAttempts(context.Background())
	require.NoError(t, err)
	require.Len(t, swept, 1)
	s := swept[0]
	require.NoError(t, s.Err)
	assert.Equal(t, []any{"run-1", 2, "train", 1, rec.Owner.PID}, []any{s.RunID, s.Iteration, s.StepID, s.Attempt, s.Worker})
	var killed []int
	for _, k := range s.Killed {
		killed = append(killed, k.PID)
	}
	assert.Subset(t, killed, []int{pids["leader"], pids["child"], pids["grandchild"]})
	for name, pid := range pids {
		assert.False(t, alive(pid), "%s (pid %d)", name, pid)
	}
	left := r.records()
	assert.Len(t, left, 2)
	for name, k := range keep {
		assert.Equal(t, k, left[filepath.Join(dir, k.Tag+".json")], name)
	}

	again, err := r.a.SweepAttempts(context.Background())
	require.NoError(t, err)
	assert.Empty(t, again)
}

func TestExecRecordErrors(t *testing.T) {
	a := newActivities(t)
	dir := a.attemptsDir()
	require.NoError(t, os.MkdirAll(dir, 0o755))
	bad := filepath.Join(dir, "x.json")
	require.NoError(t, os.WriteFile(bad, []byte("{"), 0o644))
	_, err := a.SweepAttempts(context.Background())
	require.EqualError(t, err, "sweeping exec attempts in "+dir+": attempt record "+bad+
		" is not one (unexpected end of JSON input): remove it once no process of its step runs")
}

func TestExecLostToServer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cause error
		lost  bool
	}{
		{"heartbeat: attempt not found", serviceerror.NewNotFound("x"), true},
		{"heartbeat: server unavailable", serviceerror.NewUnavailable("x"), true},
		{"heartbeat: rpc deadline", serviceerror.NewDeadlineExceeded("x"), true},
		{"heartbeat: wrapped", errors.Join(errors.New("heartbeat"), serviceerror.NewUnavailable("x")), true},
		{"workflow cancelled the step", temporal.NewCanceledError(), false},
		{"activity paused", activity.ErrActivityPaused, false},
		{"activity reset", activity.ErrActivityReset, false},
		{"attempt deadline", context.DeadlineExceeded, false},
		{"worker shutdown", worker.ErrWorkerShutdown, false},
		{"context cancelled", context.Canceled, false},
		{"namespace gone", serviceerror.NewNamespaceNotFound("ns"), false},
		{"no cause", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.lost, lostToServer(tc.cause))
		})
	}
}

func TestExecStepKeyTellsIDsApart(t *testing.T) {
	a := stepKey(pipelines.StepContext{RunID: "a/b", Iteration: 1, StepID: "s"})
	b := stepKey(pipelines.StepContext{RunID: "a_b", Iteration: 1, StepID: "s"})
	assert.NotEqual(t, a, b)
	assert.True(t, strings.HasPrefix(a, "a_b~iter-1~s~"), a)
}
