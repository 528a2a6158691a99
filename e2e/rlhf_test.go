package e2e

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rlhfDouble is a vLLM test double served by the test process, as `rlflow
// dev` serves it: stock vLLM of the newest API generation (no draft disk
// backend: checkpoints load through /collective_rpc), the untrained model
// of seed 0.
type rlhfDouble struct {
	*double.Server
	URL string
}

func startDouble(t *testing.T, faults double.Faults) *rlhfDouble {
	t.Helper()
	d, err := double.New(double.Config{Generation: double.GenE, Backend: double.BackendNCCL, DevMode: true, Faults: faults})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = d.Serve(ctx, ln); close(done) }()
	t.Cleanup(func() { cancel(); <-done; d.Close() })
	return &rlhfDouble{Server: d, URL: "http://" + ln.Addr().String()}
}

// isPaused asks the double over HTTP, as a client would.
func (d *rlhfDouble) isPaused(t *testing.T) bool {
	t.Helper()
	return isPaused(t, d.URL)
}

// runDemo runs pipelines/examples/rlhf-demo.yaml for the given iterations
// against the doubles, on a real dev server with a worker process, and
// returns the run's result or error.
func runDemo(t *testing.T, iterations int, ds ...*rlhfDouble) (*workflows.PipelineResult, string, error) {
	t.Helper()
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	urls := make([]string, len(ds))
	for i, d := range ds {
		urls[i] = d.URL
	}
	spec, params, work := demoSpec(t, bin, iterations, urls...)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	t.Cleanup(c.Close)
	queue := "rlhf-" + t.Name()
	startWorker(t, bin, srv.Address, queue, filepath.Join(work, "logs"), "--data-dir", filepath.Join(work, "data"))
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)
	var res workflows.PipelineResult
	if err := run.Get(ctx, &res); err != nil {
		return nil, run.GetID(), err
	}
	return &res, run.GetID(), nil
}

// The demo pipeline against two doubles: every iteration succeeds, the eval
// score improves, both doubles end on the last iteration's weights and are
// not paused, and every pause and resume reached both.
func TestRLHFDemoImprovesScoreOnTwoDoubles(t *testing.T) {
	const iterations = 3
	ds := []*rlhfDouble{startDouble(t, double.Faults{}), startDouble(t, double.Faults{})}
	res, runID, err := runDemo(t, iterations, ds...)
	require.NoError(t, err)
	require.Equal(t, iterations, res.Iterations)
	require.Len(t, res.Recent, iterations)

	var scores []float64
	for _, it := range res.Recent {
		require.Equal(t, workflows.StatusSucceeded, it.Status, "iteration %d", it.Iteration)
		score, ok := it.Outputs["eval"]["score"].(float64)
		require.True(t, ok, "iteration %d: eval score %v", it.Iteration, it.Outputs["eval"])
		scores = append(scores, score)
	}
	t.Logf("eval scores by iteration: %v", scores)
	assert.Greater(t, scores[len(scores)-1], scores[0], "the score must improve from the first iteration to the last")

	last := res.Recent[len(res.Recent)-1]
	version, _ := last.Outputs["sync"]["version"].(string)
	require.NotEmpty(t, version, "sync outputs %v", last.Outputs["sync"])
	assert.Equal(t, fmt.Sprintf("%s/iter-%d", runID, iterations), version, "broadcast's default version label")
	assert.Equal(t, []any{"collective_rpc", "collective_rpc"}, last.Outputs["sync"]["methods"], "how each server loaded the checkpoint")
	ckpt, _ := last.Outputs["train"]["checkpoint"].(string)
	require.Len(t, res.VLLM, len(ds), "the run records every server")
	for i, d := range ds {
		assert.Equal(t, pipelines.VLLMServer{URL: d.URL, Version: d.Config().Version, API: "E"}, res.VLLM[i], "the run's record of double %d", i)
		assert.Equal(t, version, d.WeightVersion(), "double %d weight version", i)
		assert.False(t, d.isPaused(t), "double %d is left paused", i)
		st := d.Stats()
		assert.Equal(t, iterations, st.Requests["POST /pause"], "double %d: pauses", i)
		assert.Equal(t, iterations, st.Requests["POST /resume"], "double %d: resumes", i)
		assert.Equal(t, iterations, st.Requests["POST /collective_rpc"], "double %d: checkpoint reloads", i)
		assert.Zero(t, st.Requests["POST /update_weights"], "double %d: stock vLLM has no draft disk backend", i)
		want, err := bigram.Load(ckpt)
		require.NoError(t, err)
		assert.Equal(t, want.Checksum(), d.Model().Checksum(), "double %d serves the last checkpoint", i)
	}
}

// A double whose checkpoint reload (/collective_rpc) answers 500: the run
// fails naming the broadcast step and the server's reason, and resume
// (always: true) still resumes both doubles.
func TestRLHFDemoFailedBroadcastLeavesDoublesResumed(t *testing.T) {
	bad := startDouble(t, double.Faults{ErrorRate: map[string]float64{"/collective_rpc": 1}})
	good := startDouble(t, double.Faults{})
	_, _, err := runDemo(t, 1, good, bad)
	require.Error(t, err)
	msg := err.Error()
	t.Logf("run error: %s", msg)
	assert.Contains(t, msg, "step sync (broadcast) failed")
	assert.Contains(t, msg, "injected fault")
	for name, d := range map[string]*rlhfDouble{"good": good, "bad": bad} {
		assert.False(t, d.isPaused(t), "%s double is left paused", name)
		st := d.Stats()
		assert.GreaterOrEqual(t, st.Requests["POST /pause"], 1, "%s double: pauses", name)
		assert.GreaterOrEqual(t, st.Requests["POST /resume"], 1, "%s double: resumes", name)
	}
	assert.GreaterOrEqual(t, bad.Stats().Faults["error"], 1)
}

// `rlflow dev --exit` (what `make demo ARGS=--exit` runs): its own dev
// server, worker and double, the RLHF demo for 3 iterations, the samples
// and scores printed per iteration, exit status 0.
func TestDevRunsTheRLHFDemo(t *testing.T) {
	temporal := testutil.TemporalCLI(t)
	bin := testutil.RlflowBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "dev", "--exit", "--no-build", "--temporal", temporal,
		"--address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)), "--ui-port", fmt.Sprint(testutil.FreePort(t)), "--state-dir", t.TempDir())
	out, err := cmd.CombinedOutput()
	t.Logf("rlflow dev output:\n%s", out)
	require.NoError(t, err)
	text := string(out)
	assert.Contains(t, text, "vLLM TEST AND DEMO DOUBLE")
	for it := 1; it <= 3; it++ {
		assert.Contains(t, text, fmt.Sprintf("── iteration %d ──", it))
	}
	assert.Regexp(t, `before +"the cat " -> `, text)
	assert.Regexp(t, `after +"the cat " -> `, text)
	assert.Regexp(t, `eval score by iteration: 1: [0-9.]+, 2: [0-9.]+, 3: [0-9.]+`, text)
	assert.Contains(t, text, "succeeded: 3 iteration(s)")
}

// demoSpec is the demo pipeline (pipelines/examples/rlhf-demo.yaml) in a
// fresh work directory with its example data, against the servers at urls,
// for iterations, and its launch params resolved for the rlflow binary bin.
func demoSpec(t *testing.T, bin string, iterations int, urls ...string) (spec *pipelines.Pipeline, params map[string]any, work string) {
	t.Helper()
	spec, err := pipelines.LoadFile(filepath.Join(testutil.ModuleRoot(), "pipelines/examples/rlhf-demo.yaml"))
	require.NoError(t, err)
	work = t.TempDir()
	require.NoError(t, pipelines.CopyExampleData(work))
	spec.BaseDir = work
	spec.Loop.Iterations = iterations
	spec.Servers = nil
	for _, u := range urls {
		spec.Servers = append(spec.Servers, pipelines.Server{URL: u})
	}
	params, err = spec.ResolveParams(map[string]string{"rlflow": bin})
	require.NoError(t, err)
	return spec, params, work
}
