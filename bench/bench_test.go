// Package bench measures rlflow's orchestration overhead on the Temporal
// dev server and on a real cluster (Temporal server on PostgreSQL with the
// shipped dynamic config, internal/testutil.StartCluster), each figure
// against a baseline measured in the same run; the run ends with a table
// of both (bench/RESULTS.md):
//
//	make bench    (go test -run '^$' -bench . -benchtime 1x ./bench/)
package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker"
	"go.temporal.io/sdk/client"
)

// server is one Temporal server the benchmarks run on.
type server struct {
	name  string
	start func(b *testing.B) string // the frontend's address
}

// servers: the dev server as `make demo` runs it, and a real cluster as
// docker-compose.yml runs it (one process, 4 history shards, PostgreSQL).
var servers = []server{
	{"devserver", func(b *testing.B) string { return testutil.DevServer(b).Address }},
	{"cluster", func(b *testing.B) string { return testutil.StartCluster(b, testutil.ClusterOptions{}).Address }},
}

type env struct {
	c     client.Client
	queue string
	acts  *activities.Activities
}

func setup(b *testing.B, addr string) *env {
	b.Helper()
	ctx := context.Background()
	c, err := runs.Connect(ctx, addr, "default")
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
	for _, s := range servers {
		b.Run(s.name, func(b *testing.B) { overhead(b, s) })
	}
}

func overhead(b *testing.B, s server) {
	e := setup(b, s.start(b))
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
		singles := e.times(b, single, 7)
		chains := e.times(b, chain, 3)
		fans := e.times(b, fan, 5)
		tDirect := e.direct(b, n)
		tSingle, tChain, tFan := median(singles), median(chains), median(fans)
		perStep := func(chain time.Duration) float64 { return ms(chain-tSingle) / (n - 1) }
		fanRatio := func(fan time.Duration) float64 { return float64(fan) / float64(tSingle) }
		b.ReportMetric(perStep(tChain), "ms/seq-step")
		b.ReportMetric(ms(tDirect)/n, "ms/direct-call")
		b.ReportMetric(fanRatio(tFan), "fanout/single")
		b.Logf("medians: single-step run %s; 50-step chain %s (%.1f ms per extra step); 50-wide fan-out %s = %.2fx the single-step run; 50 direct in-process calls %s",
			tSingle.Round(time.Millisecond), tChain.Round(time.Millisecond), perStep(tChain),
			tFan.Round(time.Millisecond), fanRatio(tFan), tDirect)
		record(s.name, figure{
			order: 0, what: "overhead per sequential step (50-step chain, median of 3; single-step run median of 7)",
			value:    fmt.Sprintf("%.1f ms", perStep(tChain)),
			spread:   fmt.Sprintf("%.1f-%.1f ms", perStep(chains[0]), perStep(chains[len(chains)-1])),
			baseline: fmt.Sprintf("direct in-process call %.4f ms; single-step run %s", ms(tDirect)/n, tSingle.Round(time.Millisecond)),
			target:   "< 30 ms", met: perStep(tChain) < 30,
		})
		record(s.name, figure{
			order: 1, what: "50-wide fan-out vs a single-step run (medians of 5 and 7)",
			value:    fmt.Sprintf("%.2fx (%s)", fanRatio(tFan), tFan.Round(time.Millisecond)),
			spread:   fmt.Sprintf("%.2f-%.2fx", fanRatio(fans[0]), fanRatio(fans[len(fans)-1])),
			baseline: fmt.Sprintf("single-step run %s (%s-%s)", tSingle.Round(time.Millisecond), singles[0].Round(time.Millisecond), singles[len(singles)-1].Round(time.Millisecond)),
			target:   "<= 3x", met: fanRatio(tFan) <= 3,
		})
	}
}

// times runs p k times and returns the wall times, sorted.
func (e *env) times(b *testing.B, p *pipelines.Pipeline, k int) []time.Duration {
	b.Helper()
	ts := make([]time.Duration, k)
	for i := range ts {
		ts[i], _ = e.run(b, p)
	}
	slices.Sort(ts)
	return ts
}

func median[T any](sorted []T) T { return sorted[len(sorted)/2] }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// thousandRuns is how many 1,000-iteration runs the last/first ratio is
// the median of.
const thousandRuns = 3

func BenchmarkThousandIterations(b *testing.B) {
	for _, s := range servers {
		b.Run(s.name, func(b *testing.B) { thousand(b, s) })
	}
}

func thousand(b *testing.B, s server) {
	e := setup(b, s.start(b))
	const iters, block = 1000, 100
	p := &pipelines.Pipeline{Version: 1, Name: "iters", Loop: pipelines.Loop{Iterations: iters},
		Steps: []pipelines.Step{noop("a"), noop("b", "a")}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var ratios, firsts, lasts []float64
		var blockMin, blockMax float64
		for r := 0; r < thousandRuns; r++ {
			total, id := e.run(b, p)
			b.StopTimer()
			blocks := e.blocks(b, id, iters, block)
			first, last := blocks[0], blocks[len(blocks)-1]
			ratios, firsts, lasts = append(ratios, last/first), append(firsts, first), append(lasts, last)
			for _, x := range blocks {
				if blockMin == 0 || x < blockMin {
					blockMin = x
				}
				blockMax = max(blockMax, x)
			}
			b.Logf("run %d: %d iterations in %s; ms per iteration by block of %d: %s; last/first %.2f",
				r+1, iters, total.Round(time.Millisecond), block, fmtFloats(blocks, "%.1f"), last/first)
			b.StartTimer()
		}
		order := func(xs []float64) []float64 { ys := slices.Clone(xs); sort.Float64s(ys); return ys }
		ratio := median(order(ratios))
		b.ReportMetric(median(order(firsts)), "ms/iter-first100")
		b.ReportMetric(median(order(lasts)), "ms/iter-last100")
		b.ReportMetric(ratio, "last/first")
		record(s.name, figure{
			order: 2, what: fmt.Sprintf("1,000 iterations of a 2-step pipeline: last/first 100 (median of %d runs)", thousandRuns),
			value:    fmt.Sprintf("%.2f (%.1f -> %.1f ms/iter)", ratio, median(order(firsts)), median(order(lasts))),
			spread:   fmt.Sprintf("ratios %s; 100-iteration blocks %.1f-%.1f ms/iter", fmtFloats(order(ratios), "%.2f"), blockMin, blockMax),
			baseline: "the same run's first 100 iterations",
			target:   "< 1.2", met: ratio < 1.2,
		})
	}
}

// blocks is the mean time per iteration of each block of n iterations of
// run id: from the start of the block's first iteration to the start of
// the next block's (the close of the last iteration, for the last block).
func (e *env) blocks(b *testing.B, id string, iters, n int) []float64 {
	b.Helper()
	ctx := context.Background()
	var bounds []time.Time
	for k := 1; k <= iters; k += n {
		d, err := e.c.DescribeWorkflow(ctx, fmt.Sprintf("%s/iter-%d", id, k), "")
		if err != nil {
			b.Fatal(err)
		}
		bounds = append(bounds, d.RawResponse.GetWorkflowExecutionInfo().GetStartTime().AsTime())
	}
	d, err := e.c.DescribeWorkflow(ctx, fmt.Sprintf("%s/iter-%d", id, iters), "")
	if err != nil {
		b.Fatal(err)
	}
	bounds = append(bounds, d.RawResponse.GetWorkflowExecutionInfo().GetCloseTime().AsTime())
	out := make([]float64, len(bounds)-1)
	for i := range out {
		out[i] = ms(bounds[i+1].Sub(bounds[i])) / float64(n)
	}
	return out
}

func fmtFloats(xs []float64, format string) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprintf(format, x)
	}
	return strings.Join(s, " ")
}

// figure is one measured figure of one server, for the closing table.
type figure struct {
	order                                 int
	what, value, spread, baseline, target string
	met                                   bool
}

var (
	figuresMu sync.Mutex
	figures   = map[string][]figure{} // by server name
)

func record(server string, f figure) {
	figuresMu.Lock()
	defer figuresMu.Unlock()
	figures[server] = append(figures[server], f)
}

// TestMain prints, after the benchmarks, every server's figures beside its
// baselines as a Markdown table (bench/RESULTS.md's).
func TestMain(m *testing.M) {
	code := m.Run()
	figuresMu.Lock()
	defer figuresMu.Unlock()
	if len(figures) > 0 {
		fmt.Println("\n| figure | server | measured | spread | baseline (same run) | target |")
		fmt.Println("|---|---|---|---|---|---|")
		var all []struct {
			server string
			f      figure
		}
		for _, s := range servers {
			for _, f := range figures[s.name] {
				all = append(all, struct {
					server string
					f      figure
				}{s.name, f})
			}
		}
		sort.SliceStable(all, func(i, j int) bool { return all[i].f.order < all[j].f.order })
		for _, r := range all {
			verdict := "**not met**"
			if r.f.met {
				verdict = "met"
			}
			fmt.Printf("| %s | %s | %s | %s | %s | %s: %s |\n", r.f.what, r.server, r.f.value, r.f.spread, r.f.baseline, r.f.target, verdict)
		}
	}
	os.Exit(code)
}
