package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/procs"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// execSIGKILLPipeline: one exec step whose first attempt is a wrapper
// starting a trainer-like tree (a background sleeper, one in a session of
// its own as a launcher's would be, and a foreground one), writing their
// pids to $D; later attempts finish at once.
const execSIGKILLPipeline = `version: 1
name: exec-sigkill
params:
  dir: {type: string, required: true}
defaults:
  timeout: 2m
  heartbeat: 2s
  retry: {max_attempts: 3, initial_interval: 100ms}
steps:
  - id: train
    uses: exec
    outputs: [attempt]
    with:
      command:
        - sh
        - -c
        - |
          echo "start $RLFLOW_ATTEMPT" >> "$D/starts"
          if [ "$RLFLOW_ATTEMPT" -ge 2 ]; then echo "attempt=$RLFLOW_ATTEMPT" >> "$RLFLOW_OUTPUTS"; exit 0; fi
          sleep 300 & echo $! > "$D/background"
          setsid sleep 300 & echo $! > "$D/session"
          sleep 300 & echo $! > "$D/foreground"
          echo $$ > "$D/wrapper"
          wait $!
          echo done
      env: {D: "${{ params.dir }}"}
`

// attemptPIDs are the pid files the first attempt writes.
var attemptPIDs = []string{"wrapper", "background", "session", "foreground"}

// readPIDFile reads one pid file, 0 when it is not (completely) there.
func readPIDFile(dir, name string) int {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil || !strings.HasSuffix(string(b), "\n") {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// running reports whether pid runs: it exists and is not a zombie.
func running(pid int) bool {
	st, err := procs.ReadStat(pid)
	return err == nil && st.State != 'Z' && st.State != 'X'
}

func loadWithParams(t *testing.T, dir, name, yaml string, params map[string]string) (*pipelines.Pipeline, map[string]any) {
	t.Helper()
	file := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(file, []byte(yaml), 0o644))
	spec, err := pipelines.LoadFile(file)
	require.NoError(t, err)
	resolved, err := spec.ResolveParams(params)
	require.NoError(t, err)
	return spec, resolved
}

// A SIGKILLed worker leaves its exec command's descendants running (the
// wrapper dies by Pdeathsig, its children are reparented to init). When a
// new worker starts with the same --log-dir, they are gone before the
// step's second attempt starts: one trainer per step, never two.
func TestExecWorkerSIGKILLKillsFirstAttempt(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	dir := t.TempDir()
	pidDir, logDir := filepath.Join(dir, "pids"), filepath.Join(dir, "logs")
	require.NoError(t, os.MkdirAll(pidDir, 0o755))
	spec, params := loadWithParams(t, dir, "sigkill.yaml", execSIGKILLPipeline, map[string]string{"dir": pidDir})
	t.Cleanup(func() {
		for _, name := range attemptPIDs {
			if pid := readPIDFile(pidDir, name); pid > 0 && running(pid) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "exec-sigkill"
	w1 := startWorker(t, bin, srv.Address, queue, logDir)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	pids := map[string]int{}
	testutil.Eventually(t, time.Minute, "attempt 1 to write its pids", func() bool {
		for _, name := range attemptPIDs {
			pids[name] = readPIDFile(pidDir, name)
			if pids[name] == 0 {
				return false
			}
		}
		return true
	})
	require.NoError(t, w1.Process.Signal(syscall.SIGKILL))
	_, _ = w1.Process.Wait()
	t.Logf("worker 1 (pid %d) SIGKILLed; attempt 1's processes: %v", w1.Process.Pid, pids)
	// What the bug looked like: the wrapper's children outlive the worker.
	testutil.Eventually(t, 10*time.Second, "the wrapper to die by Pdeathsig", func() bool { return !running(pids["wrapper"]) })
	for _, name := range []string{"background", "session", "foreground"} {
		require.True(t, running(pids[name]), "%s (pid %d) died with the worker: nothing left to test", name, pids[name])
	}

	startWorker(t, bin, srv.Address, queue, logDir)
	testutil.Eventually(t, time.Minute, "attempt 2 to start", func() bool {
		logs, _ := filepath.Glob(filepath.Join(logDir, "*", "iter-1", "train", "attempt-2.log"))
		return len(logs) == 1
	})
	for name, pid := range pids {
		assert.False(t, running(pid), "attempt 1's %s (pid %d) is alive next to attempt 2", name, pid)
	}

	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	require.Len(t, res.Recent, 1)
	it := res.Recent[0]
	require.Equal(t, workflows.StatusSucceeded, it.Status)
	assert.Equal(t, 2.0, it.Outputs["train"]["attempt"])
	starts, err := os.ReadFile(filepath.Join(pidDir, "starts"))
	require.NoError(t, err)
	assert.Equal(t, "start 1\nstart 2\n", string(starts))
	records, _ := filepath.Glob(filepath.Join(logDir, ".attempts", "*.json"))
	assert.Empty(t, records, "attempt records left behind")
}

// execOutagePipeline: one exec step of about 40 s that counts its starts
// and appends a line per second.
const execOutagePipeline = `version: 1
name: exec-outage
params:
  dir: {type: string, required: true}
defaults:
  timeout: 3m
  heartbeat: 5s
  retry: {max_attempts: 3, initial_interval: 100ms}
steps:
  - id: train
    uses: exec
    outputs: [ticks]
    with:
      command:
        - sh
        - -c
        - |
          echo "start $RLFLOW_ATTEMPT" >> "$D/starts"
          i=0
          while [ $i -lt 40 ]; do echo "tick $i"; echo "tick $i" >> "$D/ticks"; i=$((i+1)); sleep 1; done
          echo "ticks=$i" >> "$RLFLOW_OUTPUTS"
      env: {D: "${{ params.dir }}"}
`

// A Temporal outage longer than the heartbeat timeout loses the attempt
// that runs the trainer; the worker keeps the command running, and the
// retry that the server starts once it is back adopts it: the step
// succeeds, the command started once, and its output is in attempt-1.log.
func TestExecSurvivesTemporalOutage(t *testing.T) {
	const outage = 20 * time.Second // 4x the heartbeat timeout
	srv := testutil.RestartableDevServer(t)
	bin := testutil.RlflowBinary(t)
	dir := t.TempDir()
	countDir, logDir := filepath.Join(dir, "count"), filepath.Join(dir, "logs")
	require.NoError(t, os.MkdirAll(countDir, 0o755))
	spec, params := loadWithParams(t, dir, "outage.yaml", execOutagePipeline, map[string]string{"dir": countDir})

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "exec-outage"
	startWorker(t, bin, srv.Address, queue, logDir)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	ticks := func() int {
		b, _ := os.ReadFile(filepath.Join(countDir, "ticks"))
		return strings.Count(string(b), "\n")
	}
	testutil.Eventually(t, time.Minute, "the command to tick 3 times", func() bool { return ticks() >= 3 })
	srv.Down()
	t.Logf("server down at tick %d", ticks())
	time.Sleep(outage)
	srv.Up()
	t.Logf("server up at tick %d", ticks())

	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	require.Len(t, res.Recent, 1)
	it := res.Recent[0]
	require.Equal(t, workflows.StatusSucceeded, it.Status, "%+v", it)
	out := it.Outputs["train"]
	t.Logf("train outputs: %v", out)
	assert.Equal(t, 40.0, out["ticks"])

	starts, err := os.ReadFile(filepath.Join(countDir, "starts"))
	require.NoError(t, err)
	assert.Equal(t, "start 1\n", string(starts), "the command started more than once")

	st, err := runs.GetStatus(ctx, c, run.GetID(), "")
	require.NoError(t, err)
	require.Len(t, st.Steps, 1)
	t.Logf("train: %d attempt(s)", st.Steps[0].Attempts)
	assert.GreaterOrEqual(t, st.Steps[0].Attempts, 2, "the outage did not lose attempt 1: nothing was adopted")

	logs, err := filepath.Glob(filepath.Join(logDir, "*", "iter-1", "train", "attempt-*.log"))
	require.NoError(t, err)
	var withOutput []string
	for _, l := range logs {
		b, err := os.ReadFile(l)
		require.NoError(t, err)
		if strings.Contains(string(b), "tick") {
			withOutput = append(withOutput, filepath.Base(l))
		}
		if filepath.Base(l) != "attempt-1.log" {
			assert.Contains(t, string(b), "adopted the command of attempt 1", "%s", l)
		}
	}
	assert.Equal(t, []string{"attempt-1.log"}, withOutput, "logs holding the command's output")
	if log, _ := out["log"].(string); assert.NotEmpty(t, log) {
		assert.Equal(t, "attempt-1.log", filepath.Base(log), "the step's log output")
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(logs[0]), "attempt-1.log"))
	require.NoError(t, err)
	assert.Equal(t, 40, strings.Count(string(b), "tick "), "attempt-1.log:\n%s", b)
}
