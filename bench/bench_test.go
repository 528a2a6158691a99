// Package bench measures rlflow's orchestration overhead on a real Temporal
// dev server, each figure against a baseline measured in the same run:
//
//	make bench    (go test -run '^$' -bench . -benchtime 1x ./bench/)
package bench

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker"
	"go.temporal.io/sdk/client"
)

type env struct {
	c     client.Client
	queue string
	acts  *activities.Activities
}

func setup(b *testing.B) *env {
	b.Helper()
	srv := testutil.DevServer(b)
	ctx := context.Background()
	c, err := runs.Connect(ctx, srv.Address, "default")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Close)
	queue := "bench"
	deps := activities.Deps{LogDir: b.TempDir()}
	w, err := worker.NewControl(c, worker.Options{TaskQueue: queue, Deps: deps})
	if err != nil {
		b.Fatal(err)
	}
	if err := w.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(w.Stop)
	return &env{c: c, queue: queue, acts: activities.New(deps)}
}

func noop(id string, needs ...string) pipelines.Step {
	return pipelines.Step{ID: id, Uses: pipelines.StepNoop, Needs: needs, With: map[string]any{"outputs": map[string]any{"v": 1}}}
}

func (e *env) run(b *testing.B, p *pipelines.Pipeline) (time.Duration, string) {
	b.Helper()
	ctx := context.Background()
	// A run's spec needs a base_dir (the worker validates it); noop
	// steps read nothing from it.
	p.BaseDir = b.TempDir()
	start := time.Now()
	run, err := runs.Start(ctx, e.c, runs.StartOptions{Spec: p, TaskQueue: e.queue})
	if err != nil {
		b.Fatal(err)
	}
	if err := run.Get(ctx, nil); err != nil {
		b.Fatal(err)
	}
	return time.Since(start), run.GetID()
}

// direct calls the same activity in-process n times: the baseline.
func (e *env) direct(b *testing.B, n int) time.Duration {
	start := time.Now()
	for i := 0; i < n; i++ {
		if _, err := e.acts.Noop(context.Background(), activities.NoopInput{Outputs: map[string]any{"v": 1}}); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(start)
}

func BenchmarkOverhead(b *testing.B) {
	e := setup(b)
	const n = 50
	chain := &pipelines.Pipeline{Version: 1, Name: "chain", Loop: pipelines.Loop{Iterations: 1}}
	fan := &pipelines.Pipeline{Version: 1, Name: "fanout", Loop: pipelines.Loop{Iterations: 1}}
	single := &pipelines.Pipeline{Version: 1, Name: "single", Loop: pipelines.Loop{Iterations: 1}, Steps: []pipelines.Step{noop("s0")}}
	for i := 0; i < n; i++ {
		var needs []string
		if i > 0 {
			needs = []string{fmt.Sprintf("s%d", i-1)}
		}
		chain.Steps = append(chain.Steps, noop(fmt.Sprintf("s%d", i), needs...))
		fan.Steps = append(fan.Steps, noop(fmt.Sprintf("s%d", i)))
	}
	e.run(b, single) // warm the worker and server caches
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		// Medians of repeated runs: on a 2-core box one run of a shape can
		// be several times slower than the next, and the ratios would then
		// measure the noise rather than the orchestration.
		tSingle := e.median(b, single, 7)
		tChain := e.median(b, chain, 3)
		tFan := e.median(b, fan, 5)
		tDirect := e.direct(b, n)
		perStep := (tChain - tSingle) / (n - 1)
		b.ReportMetric(float64(perStep.Microseconds())/1000, "ms/seq-step")
		b.ReportMetric(float64(tDirect.Microseconds())/1000/n, "ms/direct-call")
		b.ReportMetric(float64(tFan)/float64(tSingle), "fanout/single")
		b.Logf("medians: single-step run %s; 50-step chain %s (%.1f ms per extra step); 50-wide fan-out %s = %.2fx the single-step run; 50 direct in-process calls %s",
			tSingle.Round(time.Millisecond), tChain.Round(time.Millisecond), float64(perStep.Microseconds())/1000,
			tFan.Round(time.Millisecond), float64(tFan)/float64(tSingle), tDirect)
	}
}

// median runs p k times and returns the median wall time.
func (e *env) median(b *testing.B, p *pipelines.Pipeline, k int) time.Duration {
	b.Helper()
	ts := make([]time.Duration, k)
	for i := range ts {
		ts[i], _ = e.run(b, p)
	}
	slices.Sort(ts)
	return ts[k/2]
}

func BenchmarkThousandIterations(b *testing.B) {
	e := setup(b)
	const iters = 1000
	p := &pipelines.Pipeline{Version: 1, Name: "iters", Loop: pipelines.Loop{Iterations: iters},
		Steps: []pipelines.Step{noop("a"), noop("b", "a")}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		total, id := e.run(b, p)
		b.StopTimer()
		starts := make([]time.Time, iters+2)
		for _, k := range append(rangeInts(1, 102), rangeInts(iters-100, iters+1)...) {
			d, err := e.c.DescribeWorkflow(context.Background(), fmt.Sprintf("%s/iter-%d", id, k), "")
			if err != nil {
				b.Fatal(err)
			}
			starts[k] = d.RawResponse.GetWorkflowExecutionInfo().GetStartTime().AsTime()
		}
		first := starts[101].Sub(starts[1]) / 100
		last := starts[iters].Sub(starts[iters-100]) / 100
		b.ReportMetric(float64(first.Microseconds())/1000, "ms/iter-first100")
		b.ReportMetric(float64(last.Microseconds())/1000, "ms/iter-last100")
		b.ReportMetric(float64(last)/float64(first), "last/first")
		b.Logf("%d iterations in %s; first 100: %s per iteration; last 100: %s per iteration; ratio %.2f",
			iters, total.Round(time.Millisecond), first, last, float64(last)/float64(first))
		b.StartTimer()
	}
}

func rangeInts(from, to int) []int {
	var out []int
	for i := from; i < to; i++ {
		out = append(out, i)
	}
	return out
}
