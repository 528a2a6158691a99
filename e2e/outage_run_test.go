package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// outagePipeline: four noop steps of 5s in a row, long enough that a
// Temporal outage begins while the run is in its second step. The short
// heartbeat lets Temporal retry, after the outage, a step whose completion
// the worker could not report during it.
const outagePipeline = `version: 1
name: outage
defaults:
  timeout: 5m
  heartbeat: 10s
  retry: {max_attempts: 5, initial_interval: 1s}
steps:
  - {id: first, uses: noop, with: {sleep: 5s}}
  - {id: second, uses: noop, needs: [first], with: {sleep: 5s}}
  - {id: third, uses: noop, needs: [second], with: {sleep: 5s}}
  - {id: fourth, uses: noop, needs: [third], with: {sleep: 5s}}
`

// The outage's length: the acceptance's 60 s, longer than the SDK's 10 s
// RPC timeout and close to its 65 s history long poll.
const outageLength = 60 * time.Second

// TestRunWaitFollowsThroughOutage takes Temporal down for a minute while
// `rlflow run --wait` follows a run: the command says the frontend is
// unreachable, says when it is back, goes on reporting the steps and exits
// 0 when the run succeeds; the worker rode out the outage, and logged the
// SDK's warnings about it. A second follower interrupted during the outage
// stops at once (exit 1) while its run goes on. `rlflow status` then
// reports the run completed.
func TestRunWaitFollowsThroughOutage(t *testing.T) {
	srv := testutil.RestartableDevServer(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "outage.yaml")
	require.NoError(t, os.WriteFile(file, []byte(outagePipeline), 0o644))
	queue := "outage-run"
	common := []string{"--address", srv.Address, "--task-queue", queue}

	worker := startOutageProc(t, "worker", append([]string{"worker", "--log-dir", filepath.Join(dir, "logs"),
		"--data-dir", filepath.Join(dir, "data")}, common...)...)
	worker.WaitFor(t, time.Minute, "rlflow worker running")
	follow := startOutageProc(t, "run --wait", append([]string{"run", file, "--wait", "--id", "outage-followed"}, common...)...)
	quitter := startOutageProc(t, "interrupted run --wait", append([]string{"run", file, "--wait", "--id", "outage-interrupted"}, common...)...)

	// The outage begins in the second step.
	secondRunning := fmt.Sprintf("  %-14s %-10s %s", "second", "noop", "running") // Watch's step line
	follow.WaitFor(t, time.Minute, secondRunning)
	quitter.WaitFor(t, time.Minute, secondRunning)
	srv.Down()
	downAt := time.Now()
	t.Logf("temporal down at %s", downAt.Format(time.TimeOnly))

	waiting := fmt.Sprintf("temporal at %s unreachable (", srv.Address)
	follow.WaitFor(t, outageLength, waiting)
	quitter.WaitFor(t, outageLength, waiting)
	require.NoError(t, quitter.cmd.Process.Signal(syscall.SIGINT))
	assert.Equal(t, 1, quitter.ExitCode(t, 10*time.Second), "Ctrl-C stops following at once, with status 1")
	assert.Contains(t, quitter.Output(), "rlflow: stopped following outage-interrupted (the run goes on; rlflow status outage-interrupted)")
	assert.False(t, follow.Exited(), "run --wait gave up during the outage:\n%s", follow.Output())
	assert.False(t, worker.Exited(), "the worker died in the outage:\n%s", worker.Output())

	time.Sleep(time.Until(downAt.Add(outageLength)))
	require.False(t, follow.Exited(), "run --wait gave up during the outage:\n%s", follow.Output())
	srv.Up()
	t.Logf("temporal up again at %s", time.Now().Format(time.TimeOnly))

	require.Equal(t, 0, follow.ExitCode(t, 3*time.Minute), "run --wait's status; output:\n%s", follow.Output())
	out := follow.Output()
	t.Logf("run --wait output:\n%s", out)
	assert.Regexp(t, regexp.MustCompile(`(?m)^temporal at `+regexp.QuoteMeta(srv.Address)+` unreachable \([^)]*connection refused\); retrying with backoff up to 5s until it is back`), out)
	assert.Regexp(t, regexp.MustCompile(`(?m)^temporal reachable again after (\d+m)?\d+s$`), out)
	assert.Equal(t, 1, countMatches(out, `unreachable \(`), "the outage is announced once")
	for _, step := range []string{"first", "second", "third", "fourth"} {
		assert.Regexp(t, regexp.MustCompile(`(?m)^\s+`+step+`\s+noop\s+succeeded`), out)
	}
	assert.Contains(t, out, "run outage-followed succeeded: 1 iteration(s)")
	// Progress goes on after the outage: the last step's lines follow the
	// reachable-again line.
	assert.Regexp(t, regexp.MustCompile(`(?s)temporal reachable again.*fourth\s+noop\s+succeeded`), out)

	// The worker rode out the outage (it ran the rest of the run) and the
	// SDK's warnings about it are in its log.
	require.False(t, worker.Exited(), "worker output:\n%s", worker.Output())
	assert.Regexp(t, regexp.MustCompile(`level=WARN msg="Failed to poll for task." from=temporal-sdk`), worker.Output())
	assert.NotContains(t, worker.Output(), "level=INFO msg=\"Started Worker\"", "the SDK's info lines stay out")

	status := startOutageProc(t, "status", append([]string{"status", "outage-followed"}, common...)...)
	require.Equal(t, 0, status.ExitCode(t, time.Minute), "status output:\n%s", status.Output())
	st := status.Output()
	t.Logf("rlflow status:\n%s", st)
	assert.Regexp(t, regexp.MustCompile(`(?m)^execution:\s+Completed$`), st)
	assert.Equal(t, 4, countMatches(st, `(?m)^(first|second|third|fourth)\s+noop\s+succeeded`), "status:\n%s", st)

	// The interrupted follower's run went on without it.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.GetWorkflow(ctx, "outage-interrupted", "").Get(ctx, nil))
}

func countMatches(s, re string) int { return len(regexp.MustCompile(re).FindAllStringIndex(s, -1)) }
