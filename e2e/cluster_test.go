package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// These tests take a real cluster's parts away (`make test-cluster`): the
// Temporal server's processes, SIGKILLed, and its PostgreSQL, stopped.
// Every exec command appends "<step> start <attempt>" and "<step> end
// <attempt>" to $D/runs, so the tests count executions exactly.

// finishDuringOutagePipeline: prepare -> train -> finish. train's command
// waits for the file $D/go, which the test creates once Temporal is away,
// so that the command finishes, and its completion must be reported, while
// the server cannot take it. train has a timeout and no heartbeat, as most
// training steps are written.
const finishDuringOutagePipeline = `version: 1
name: finish-during-outage
params:
  dir: {type: string, required: true}
defaults:
  timeout: 1m
  retry: {max_attempts: 3, initial_interval: 1s}
steps:
  - id: prepare
    uses: exec
    with:
      command: [sh, -c, 'echo "prepare start $RLFLOW_ATTEMPT" >> "$D/runs"; echo "prepare end $RLFLOW_ATTEMPT" >> "$D/runs"']
      env: {D: "${{ params.dir }}"}
  - id: train
    uses: exec
    needs: [prepare]
    outputs: [attempt]
    with:
      command:
        - sh
        - -c
        - |
          echo "train start $RLFLOW_ATTEMPT" >> "$D/runs"
          while [ ! -e "$D/go" ]; do sleep 0.1; done
          echo "attempt=$RLFLOW_ATTEMPT" >> "$RLFLOW_OUTPUTS"
          echo "train end $RLFLOW_ATTEMPT" >> "$D/runs"
      env: {D: "${{ params.dir }}"}
  - id: finish
    uses: exec
    needs: [train]
    with:
      command: [sh, -c, 'echo "finish start $RLFLOW_ATTEMPT" >> "$D/runs"; echo "finish end $RLFLOW_ATTEMPT" >> "$D/runs"']
      env: {D: "${{ params.dir }}"}
`

// The acceptance's outage: 20 s away, and the run done within 30 s of the
// return.
const (
	finishOutage = 20 * time.Second
	finishAfter  = 30 * time.Second
)

// A Temporal server SIGKILL, or a PostgreSQL stop, of 20 s while an exec
// step's command finishes: the command ran once, and the run completes
// within 30 s of the return.
func TestClusterOutageWhileExecStepFinishes(t *testing.T) {
	for _, tc := range []struct {
		name       string
		down, up   func(*testutil.Cluster)
		whatIsAway string
	}{
		{"server-SIGKILL", (*testutil.Cluster).Down, (*testutil.Cluster).Up, "the Temporal server (SIGKILL)"},
		{"postgres-stop",
			func(c *testutil.Cluster) { c.Postgres.Stop() },
			func(c *testutil.Cluster) { c.Postgres.Start() },
			"PostgreSQL (stopped)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := testutil.ClusterUnderTest(t)
			bin := testutil.RlflowBinary(t)
			dir := t.TempDir()
			runsDir := filepath.Join(dir, "runs")
			require.NoError(t, os.MkdirAll(runsDir, 0o755))
			spec, params := loadWithParams(t, dir, "finish.yaml", finishDuringOutagePipeline, map[string]string{"dir": runsDir})

			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			cl, err := runs.Connect(ctx, c.Address, "default")
			require.NoError(t, err)
			defer cl.Close()
			queue := "finish-" + tc.name
			startWorker(t, bin, c.Address, queue, filepath.Join(dir, "logs"), "--data-dir", filepath.Join(dir, "data"))
			run, err := runs.Start(ctx, cl, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
			require.NoError(t, err)

			lines := func() string { b, _ := os.ReadFile(filepath.Join(runsDir, "runs")); return string(b) }
			testutil.Eventually(t, time.Minute, "train to start", func() bool { return strings.Contains(lines(), "train start 1") })
			tc.down(c)
			downAt := time.Now()
			t.Logf("%s away at %s", tc.whatIsAway, downAt.Format(time.TimeOnly))
			require.NoError(t, os.WriteFile(filepath.Join(runsDir, "go"), nil, 0o644))
			testutil.Eventually(t, 10*time.Second, "train's command to finish", func() bool { return strings.Contains(lines(), "train end 1") })
			time.Sleep(time.Until(downAt.Add(finishOutage)))
			tc.up(c)
			upAt := time.Now()
			t.Logf("%s back at %s", tc.whatIsAway, upAt.Format(time.TimeOnly))

			var res workflows.PipelineResult
			require.NoError(t, run.Get(ctx, &res))
			took := time.Since(upAt)
			t.Logf("run completed %s after the return; commands run:\n%s", took.Round(100*time.Millisecond), lines())
			require.Len(t, res.Recent, 1)
			assert.Equal(t, workflows.StatusSucceeded, res.Recent[0].Status)
			assert.Equal(t, []string{
				"prepare start 1", "prepare end 1",
				"train start 1", "train end 1",
				"finish start 1", "finish end 1",
			}, strings.Split(strings.TrimSpace(lines()), "\n"), "every command runs once")
			assert.LessOrEqual(t, took, finishAfter, "the run completes within %s of the return", finishAfter)
		})
	}
}

// restartPipelineHead and restartStep make a chain of exec steps of about
// a second each.
const (
	restartPipelineHead = `version: 1
name: postgres-restart
params:
  dir: {type: string, required: true}
defaults:
  timeout: 1m
  retry: {max_attempts: 3, initial_interval: 1s}
steps:
`
	restartStep = `  - id: s%[1]d
    uses: exec
    needs: %[2]s
    with:
      command: [sh, -c, 'echo "$S start $RLFLOW_ATTEMPT" >> "$D/runs"; sleep 1; echo "$S end $RLFLOW_ATTEMPT" >> "$D/runs"']
      env: {D: "${{ params.dir }}", S: s%[1]d}
`
)

// restartDown is how long PostgreSQL stays stopped in a restart: a
// restart's few seconds, not an outage.
const restartDown = 3 * time.Second

// A PostgreSQL restart in the middle of a run of short exec steps: the run
// completes and no command runs twice.
func TestClusterPostgresRestartMidRun(t *testing.T) {
	c := testutil.ClusterUnderTest(t)
	bin := testutil.RlflowBinary(t)
	dir := t.TempDir()
	runsDir := filepath.Join(dir, "runs")
	require.NoError(t, os.MkdirAll(runsDir, 0o755))
	const steps = 8
	yaml := restartPipelineHead
	var want []string
	for i := 1; i <= steps; i++ {
		needs := "[]"
		if i > 1 {
			needs = fmt.Sprintf("[s%d]", i-1)
		}
		yaml += fmt.Sprintf(restartStep, i, needs)
		want = append(want, fmt.Sprintf("s%d start 1", i), fmt.Sprintf("s%d end 1", i))
	}
	spec, params := loadWithParams(t, dir, "restart.yaml", yaml, map[string]string{"dir": runsDir})

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cl, err := runs.Connect(ctx, c.Address, "default")
	require.NoError(t, err)
	defer cl.Close()
	queue := "postgres-restart"
	startWorker(t, bin, c.Address, queue, filepath.Join(dir, "logs"), "--data-dir", filepath.Join(dir, "data"))
	run, err := runs.Start(ctx, cl, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)

	lines := func() string { b, _ := os.ReadFile(filepath.Join(runsDir, "runs")); return string(b) }
	testutil.Eventually(t, time.Minute, "step s3 to start", func() bool { return strings.Contains(lines(), "s3 start 1") })
	stopAt := time.Now()
	c.Postgres.Stop()
	time.Sleep(restartDown) // the outage's length, not a wait for anything
	c.Postgres.Start()
	t.Logf("PostgreSQL away for %s", time.Since(stopAt).Round(time.Millisecond))

	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	require.Len(t, res.Recent, 1)
	assert.Equal(t, workflows.StatusSucceeded, res.Recent[0].Status)
	assert.Equal(t, want, strings.Split(strings.TrimSpace(lines()), "\n"), "every command runs once")
}
