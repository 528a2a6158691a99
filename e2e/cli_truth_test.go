package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// truthFailing fails its trainer twice; the cause is in the log tail.
const truthFailing = `version: 1
name: truth-failing
defaults:
  timeout: 1m
  retry: {max_attempts: 2, initial_interval: 100ms}
steps:
  - id: train
    uses: exec
    with:
      command: [sh, -c, 'echo "epoch 1"; echo "ValueError: loss is nan"; exit 1']
`

// truthSlow runs long enough to be cancelled or interrupted.
const truthSlow = `version: 1
name: truth-slow
defaults: {timeout: 5m}
steps:
  - {id: wait, uses: noop, with: {sleep: 2m}}
`

// rlflowCmd runs the rlflow binary to its end and returns its combined
// output and exit status.
func rlflowCmd(t *testing.T, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, testutil.RlflowBinary(t), args...).CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	}
	require.NoError(t, err, "rlflow %s:\n%s", strings.Join(args, " "), out)
	return string(out), 0
}

func writeTruthFile(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
	return p
}

// Issue 16: the CLI tells the truth about a run that did not succeed.
// run --wait ends with one sentence and the log tail; status exits 1 and
// prints the cause for a failed and for a cancelled run; a queue that no
// worker polls is reported while run --wait waits, and Ctrl-C says how to
// cancel the run it stops following.
func TestCLITruth(t *testing.T) {
	srv := testutil.DevServer(t)
	dir := t.TempDir()
	queue := "cli-truth"
	common := []string{"--address", srv.Address, "--task-queue", queue}
	worker := startOutageProc(t, "worker", append([]string{"worker", "--log-dir", filepath.Join(dir, "logs"), "--data-dir", filepath.Join(dir, "data")}, common...)...)
	worker.WaitFor(t, time.Minute, "rlflow worker running")

	t.Run("failed run", func(t *testing.T) {
		file := writeTruthFile(t, dir, "failing.yaml", truthFailing)
		out, code := rlflowCmd(t, append([]string{"run", file, "--wait", "--id", "truth-failed"}, common...)...)
		assert.Equal(t, 1, code, out)
		sentence := "iteration 1: step train (exec) failed on attempt 2: exec: sh exited with code 1 (log "
		assert.Contains(t, out, "rlflow: run truth-failed: "+sentence, out)
		assert.Contains(t, out, "\n  log tail:\n    epoch 1\n    ValueError: loss is nan\n", out)
		assert.NotContains(t, out, "(type:", "no SDK type chain:\n%s", out)

		out, code = rlflowCmd(t, append([]string{"status", "truth-failed"}, common...)...)
		assert.Equal(t, 1, code, "status of a failed run:\n%s", out)
		assert.Contains(t, out, "execution:  Failed\n", out)
		assert.Contains(t, out, "error:      "+sentence, out)
		assert.Contains(t, out, "    ValueError: loss is nan\n", "the cause, past `log tail:`:\n%s", out)
	})

	t.Run("cancelled run", func(t *testing.T) {
		file := writeTruthFile(t, dir, "slow.yaml", truthSlow)
		out, code := rlflowCmd(t, append([]string{"run", file, "--id", "truth-cancelled"}, common...)...)
		require.Equal(t, 0, code, out)
		testutil.Eventually(t, time.Minute, "the step to run", func() bool {
			out, _ := rlflowCmd(t, append([]string{"status", "truth-cancelled"}, common...)...)
			return strings.Contains(out, "running")
		})
		out, code = rlflowCmd(t, append([]string{"status", "truth-cancelled"}, common...)...)
		assert.Equal(t, 0, code, "status of a running run:\n%s", out)
		out, code = rlflowCmd(t, append([]string{"cancel", "truth-cancelled"}, common...)...)
		require.Equal(t, 0, code, out)
		testutil.Eventually(t, time.Minute, "the run to close", func() bool {
			out, _ := rlflowCmd(t, append([]string{"status", "truth-cancelled"}, common...)...)
			return !strings.Contains(out, "execution:  Running")
		})
		out, code = rlflowCmd(t, append([]string{"status", "truth-cancelled"}, common...)...)
		assert.Equal(t, 1, code, "status of a cancelled run:\n%s", out)
		assert.Contains(t, out, "execution:  Canceled\n", out)
		assert.Contains(t, out, "error:      cancelled", out)
	})

	t.Run("no worker, then Ctrl-C", func(t *testing.T) {
		file := writeTruthFile(t, dir, "slow.yaml", truthSlow)
		follow := startOutageProc(t, "run --wait", "run", file, "--wait", "--id", "truth-no-worker", "--address", srv.Address, "--task-queue", "nobody-polls")
		follow.WaitFor(t, 15*time.Second, "no worker is polling task queue nobody-polls; start one with `rlflow worker --task-queue nobody-polls`")
		assert.False(t, follow.Exited(), "run --wait keeps waiting:\n%s", follow.Output())
		require.NoError(t, follow.cmd.Process.Signal(syscall.SIGINT))
		assert.Equal(t, 1, follow.ExitCode(t, 10*time.Second), follow.Output())
		assert.Contains(t, follow.Output(), "rlflow: stopped following truth-no-worker (the run goes on; rlflow status truth-no-worker); to cancel it: rlflow cancel truth-no-worker\n")
		_, _ = rlflowCmd(t, "cancel", "truth-no-worker", "--address", srv.Address, "--task-queue", "nobody-polls")
	})
}
