package e2e

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The demo pipeline on a worker started with --metrics-address: its
// metrics address serves rlflow's step and sync metrics, with values the
// run explains (one succeeded attempt per step and iteration, one update
// per iteration, the last eval score), beside the Temporal SDK's.
func TestMetricsOfTheDemo(t *testing.T) {
	const iterations = 2
	d := startDouble(t, double.Faults{})
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	spec, params, work := demoSpec(t, bin, iterations, d.URL)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "metrics-" + t.Name()
	addr := fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))
	startWorker(t, bin, srv.Address, queue, filepath.Join(work, "logs"), "--data-dir", filepath.Join(work, "data"), "--metrics-address", addr)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)
	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	require.Len(t, res.Recent, iterations)
	last := res.Recent[len(res.Recent)-1]
	score, ok := last.Outputs["eval"]["score"].(float64)
	require.True(t, ok, "eval outputs %v", last.Outputs["eval"])

	resp, err := http.Get("http://" + addr + metrics.Path)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)

	// series finds the one series of name whose labels include want.
	series := func(name string, want map[string]string) (float64, bool) {
		f := fams[name]
		if f == nil {
			return 0, false
		}
	next:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if got[k] != v {
					continue next
				}
			}
			switch {
			case m.Histogram != nil:
				return float64(m.GetHistogram().GetSampleCount()), true
			case m.Counter != nil:
				return m.GetCounter().GetValue(), true
			default:
				return m.GetGauge().GetValue(), true
			}
		}
		return 0, false
	}
	for _, step := range []string{pipelines.StepGenerate, pipelines.StepExec, pipelines.StepPause, pipelines.StepBroadcast, pipelines.StepResume, pipelines.StepEvaluate} {
		n, ok := series(metrics.StepSeconds, map[string]string{"step_type": step, "outcome": metrics.OutcomeSucceeded})
		assert.True(t, ok, "no %s series for %s", metrics.StepSeconds, step)
		assert.GreaterOrEqual(t, n, float64(iterations), "%s: succeeded attempts", step)
	}
	updates, ok := series(metrics.SyncSeconds, map[string]string{"backend": "disk", "phase": metrics.PhaseUpdate})
	assert.True(t, ok, "no %s update series", metrics.SyncSeconds)
	assert.Equal(t, float64(iterations), updates, "one weight update per iteration")
	bytes, _ := series(metrics.SyncBytes, map[string]string{"backend": "disk"})
	assert.Greater(t, bytes, 0.0, "bytes of weights moved")
	bps, _ := series(metrics.SyncBytesPerSecond, map[string]string{"backend": "disk", "phase": metrics.PhaseUpdate})
	assert.Greater(t, bps, 0.0)
	got, ok := series(metrics.StepOutput, map[string]string{"run_id": run.GetID(), "step": "eval", "output": "score"})
	assert.True(t, ok, "no eval score of run %s", run.GetID())
	assert.Equal(t, score, got, "the last iteration's eval score")
	it, _ := series(metrics.Iteration, map[string]string{"run_id": run.GetID()})
	assert.Equal(t, float64(iterations), it)
	paused, ok := series(metrics.ServerPaused, map[string]string{"server": d.URL})
	assert.True(t, ok)
	assert.Equal(t, 0.0, paused, "the run resumed the server")
	tps, _ := series(metrics.GenerateTokensPerS, map[string]string{"pipeline": spec.Name})
	assert.Greater(t, tps, 0.0, "generate tokens per second")
	assert.Contains(t, fams, "temporal_request", "the Temporal SDK's metrics")
}
