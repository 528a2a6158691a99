package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestWorkerStartedWhileServerDownConnects starts a control worker and a
// GPU worker (its NCCL the test double) while Temporal is down: both stay
// up, logging a warning per attempt with the address and the reason, and
// start once the server is back; a run then completes on the control
// worker. A worker for a namespace the server lacks fails at once.
func TestWorkerStartedWhileServerDownConnects(t *testing.T) {
	srv := testutil.RestartableDevServer(t)
	srv.Down()
	dir := t.TempDir()
	queue := "outage-worker"
	common := []string{"--address", srv.Address, "--task-queue", queue}
	control := startOutageProc(t, "worker", append([]string{"worker", "--log-dir", filepath.Join(dir, "logs"),
		"--data-dir", filepath.Join(dir, "data")}, common...)...)
	gpu := startOutageProc(t, "worker --gpu", append([]string{"worker", "--gpu", "--fake-nccl", "--advertise", "127.0.0.1",
		"--gpu-task-queue", queue + "-gpu", "--log-dir", filepath.Join(dir, "gpu-logs")}, common...)...)

	retrying := regexp.MustCompile(`level=WARN msg="temporal unreachable; retrying" address=` + regexp.QuoteMeta(srv.Address) +
		` namespace=default attempt=(\d+) reason="Unavailable: connection refused" retry_in=\S+`)
	start := time.Now()
	for _, w := range []*outageProc{control, gpu} {
		testutil.Eventually(t, 30*time.Second, w.name+" to log a second attempt", func() bool {
			time.Sleep(50 * time.Millisecond)
			return len(retrying.FindAllString(w.Output(), -1)) >= 2
		})
	}
	time.Sleep(time.Until(start.Add(6 * time.Second)))
	for _, w := range []*outageProc{control, gpu} {
		require.False(t, w.Exited(), "%s exited while the server was down:\n%s", w.name, w.Output())
		assert.NotContains(t, w.Output(), "running", "%s started without a server", w.name)
	}
	srv.Up()

	control.WaitFor(t, 2*time.Minute, "rlflow worker running")
	gpu.WaitFor(t, 2*time.Minute, "rlflow GPU worker running")
	for _, w := range []*outageProc{control, gpu} {
		assert.Regexp(t, regexp.MustCompile(`level=INFO msg="temporal reachable" address=`+regexp.QuoteMeta(srv.Address)+` namespace=default attempts=\d+ waited=\S+`), w.Output())
	}

	file := filepath.Join(dir, "quick.yaml")
	require.NoError(t, os.WriteFile(file, []byte("version: 1\nname: quick\nsteps:\n  - {id: only, uses: noop, with: {sleep: 1s}}\n"), 0o644))
	run := startOutageProc(t, "run --wait", append([]string{"run", file, "--wait", "--id", "after-outage"}, common...)...)
	require.Equal(t, 0, run.ExitCode(t, 2*time.Minute), "run --wait output:\n%s", run.Output())
	assert.Contains(t, run.Output(), "run after-outage succeeded: 1 iteration(s)")
	assert.False(t, control.Exited())
	t.Logf("worker output:\n%s", control.Output())

	// A missing namespace is an answer, not an outage: no waiting.
	wrong := startOutageProc(t, "worker --namespace nope", "worker", "--address", srv.Address, "--namespace", "nope",
		"--task-queue", queue, "--log-dir", filepath.Join(dir, "logs"))
	assert.Equal(t, 1, wrong.ExitCode(t, 30*time.Second))
	assert.Contains(t, wrong.Output(), fmt.Sprintf("rlflow: connecting to Temporal at %s (namespace nope): describing namespace nope: ", srv.Address))
	assert.NotContains(t, wrong.Output(), "retrying")
}
