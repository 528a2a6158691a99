// Package e2e runs rlflow end to end on a real Temporal dev server: the CLI
// binary, worker processes that get SIGKILLed, and pipelines of exec steps.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// killPipeline: prepare -> long (heartbeats; killed mid-run) -> finish.
// Every attempt appends "<step> start <attempt>" and "<step> end <attempt>"
// to the marker file, so the test can count executions exactly.
const killPipeline = `version: 1
name: kill-test
params:
  marker: {type: string, required: true}
defaults:
  timeout: 2m
  heartbeat: 2s
  retry: {max_attempts: 3, initial_interval: 100ms}
steps:
  - id: prepare
    uses: exec
    outputs: [n]
    with:
      command: [sh, -c, 'echo "prepare start $RLFLOW_ATTEMPT" >> "$M"; echo n=7 >> "$RLFLOW_OUTPUTS"; echo "prepare end $RLFLOW_ATTEMPT" >> "$M"']
      env: {M: "${{ params.marker }}"}
  - id: long
    uses: exec
    needs: [prepare]
    outputs: [doubled]
    with:
      command: [sh, -c, 'echo "long start $RLFLOW_ATTEMPT" >> "$M"; sleep 4; echo "doubled=$((N*2))" >> "$RLFLOW_OUTPUTS"; echo "long end $RLFLOW_ATTEMPT" >> "$M"']
      env: {M: "${{ params.marker }}", N: "${{ steps.prepare.outputs.n }}"}
  - id: finish
    uses: exec
    needs: [long]
    with:
      command: [sh, -c, 'echo "finish start $RLFLOW_ATTEMPT got $D" >> "$M"; echo "finish end $RLFLOW_ATTEMPT" >> "$M"']
      env: {M: "${{ params.marker }}", D: "${{ steps.long.outputs.doubled }}"}
`

// startWorker starts a control worker process in its own process group, so
// that a test can SIGKILL the worker with everything it started
// (syscall.Kill(-pid, ...)) without signalling the test process.
func startWorker(t *testing.T, bin, addr, queue, logDir string, extra ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"worker", "--address", addr, "--task-queue", queue, "--log-dir", logDir}, extra...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_, _ = cmd.Process.Wait()
		if t.Failed() {
			t.Logf("worker %d output:\n%s", cmd.Process.Pid, out.String())
		}
	})
	return cmd
}

func TestWorkerSIGKILLDuringStep(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	dir := t.TempDir()
	marker := filepath.Join(dir, "marker")
	file := filepath.Join(dir, "kill.yaml")
	require.NoError(t, os.WriteFile(file, []byte(killPipeline), 0o644))
	spec, err := pipelines.LoadFile(file)
	require.NoError(t, err)
	params, err := spec.ResolveParams(map[string]string{"marker": marker})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "kill-test"
	w1 := startWorker(t, bin, srv.Address, queue, filepath.Join(dir, "logs"))
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	testutil.Eventually(t, time.Minute, "step long to start", func() bool {
		b, _ := os.ReadFile(marker)
		return strings.Contains(string(b), "long start 1")
	})
	require.NoError(t, w1.Process.Signal(syscall.SIGKILL))
	_, _ = w1.Process.Wait()
	startWorker(t, bin, srv.Address, queue, filepath.Join(dir, "logs"))

	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	assert.Equal(t, 1, res.Iterations)

	b, err := os.ReadFile(marker)
	require.NoError(t, err)
	got := strings.Split(strings.TrimSpace(string(b)), "\n")
	// prepare and finish ran once; long's first attempt died with its worker
	// (Pdeathsig killed its shell: no "long end 1"), the heartbeat timeout
	// retried it as attempt 2 on the new worker, which completed.
	assert.Equal(t, []string{
		"prepare start 1", "prepare end 1",
		"long start 1", "long start 2", "long end 2",
		"finish start 1 got 14", "finish end 1",
	}, got)

	st, err := runs.GetStatus(ctx, c, run.GetID(), "")
	require.NoError(t, err)
	assert.Equal(t, "Completed", st.Execution)
	steps := map[string]int{}
	for _, s := range st.Steps {
		steps[s.ID] = s.Attempts
	}
	assert.Equal(t, map[string]int{"prepare": 1, "long": 2, "finish": 1}, steps)
	fmt.Println(strings.Join(got, "\n"))
}
