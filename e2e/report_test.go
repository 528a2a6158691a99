package e2e

import (
	"context"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/html"
)

// runDemoChain is runDemo on a dev server the caller keeps (to read the
// run afterwards), continuing as new every `every` iterations.
func runDemoChain(t *testing.T, address string, iterations, every int, d *rlhfDouble) (*workflows.PipelineResult, string) {
	t.Helper()
	bin := testutil.RlflowBinary(t)
	spec, params, work := demoSpec(t, bin, iterations, d.URL)
	spec.Loop.ContinueAsNewEvery = every

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "report-" + t.Name()
	startWorker(t, bin, address, queue, filepath.Join(work, "logs"), "--data-dir", filepath.Join(work, "data"))
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)
	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	return &res, run.GetID()
}

func htmlAttr(n *html.Node, key string) (string, bool) {
	for _, a := range n.Attr {
		if a.Key == key {
			return a.Val, true
		}
	}
	return "", false
}

func htmlFind(n *html.Node, match func(*html.Node) bool) []*html.Node {
	var out []*html.Node
	for c := range n.Descendants() {
		if c.Type == html.ElementNode && match(c) {
			out = append(out, c)
		}
	}
	return out
}

// The demo for 3 iterations over two runs of a continue-as-new chain:
// `rlflow report` writes a page whose iterations table holds each
// iteration's eval score, equal to the run's result, a chart of
// eval.score and of the step durations, every succeeded step timed; and
// --format png writes one chart.
func TestReportOfTheDemoRun(t *testing.T) {
	const iterations = 3
	srv := testutil.DevServer(t)
	res, id := runDemoChain(t, srv.Address, iterations, 2, startDouble(t, double.Faults{}))
	require.Len(t, res.Recent, iterations)

	bin := testutil.RlflowBinary(t)
	dir := t.TempDir()
	page := filepath.Join(dir, "report.html")
	report := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, append([]string{"report", "--address", srv.Address, "--namespace", "default"}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := report(id, "--out", page)
	require.NoError(t, err, out)
	assert.Contains(t, out, "wrote "+page+" (3 iterations, 2 runs)")

	f, err := os.Open(page)
	require.NoError(t, err)
	defer f.Close()
	doc, err := html.Parse(f)
	require.NoError(t, err)

	rows := htmlFind(doc, func(n *html.Node) bool {
		_, it := htmlAttr(n, "data-iteration")
		_, step := htmlAttr(n, "data-step")
		return n.Data == "tr" && it && !step
	})
	require.Len(t, rows, iterations, "one row per iteration, across the chain")
	for i, row := range rows {
		want := res.Recent[i]
		n, _ := htmlAttr(row, "data-iteration")
		assert.Equal(t, strconv.Itoa(want.Iteration), n)
		st, _ := htmlAttr(row, "data-status")
		assert.Equal(t, want.Status, st, "iteration %d", want.Iteration)
		score, ok := want.Outputs["eval"]["score"].(float64)
		require.True(t, ok, "iteration %d: eval outputs %v", want.Iteration, want.Outputs["eval"])
		cells := htmlFind(row, func(n *html.Node) bool { m, _ := htmlAttr(n, "data-metric"); return m == "eval.score" })
		require.Len(t, cells, 1, "iteration %d has an eval.score cell", want.Iteration)
		got, ok := htmlAttr(cells[0], "data-value")
		require.True(t, ok, "iteration %d: eval.score has a value", want.Iteration)
		v, err := strconv.ParseFloat(got, 64)
		require.NoError(t, err)
		assert.Equal(t, score, v, "iteration %d eval.score", want.Iteration)
		for _, m := range []string{"train.loss", "train.reward", "sync.seconds", "after.tokens_per_s"} {
			assert.Len(t, htmlFind(row, func(n *html.Node) bool {
				v, _ := htmlAttr(n, "data-metric")
				_, has := htmlAttr(n, "data-value")
				return v == m && has
			}), 1,
				"iteration %d has %s", want.Iteration, m)
		}
	}

	for _, chart := range []string{"eval.score", "step-durations"} {
		figs := htmlFind(doc, func(n *html.Node) bool { v, _ := htmlAttr(n, "data-chart"); return v == chart })
		require.Len(t, figs, 1, chart)
		assert.Len(t, htmlFind(figs[0], func(n *html.Node) bool { return n.Data == "svg" }), 1, "%s is an inline SVG", chart)
	}
	steps := htmlFind(doc, func(n *html.Node) bool { _, ok := htmlAttr(n, "data-step"); return n.Data == "tr" && ok })
	require.Len(t, steps, iterations*7, "the demo's 7 steps per iteration")
	for _, s := range steps {
		id, _ := htmlAttr(s, "data-step")
		st, _ := htmlAttr(s, "data-status")
		require.Equal(t, workflows.StatusSucceeded, st, id)
		cells := htmlFind(s, func(n *html.Node) bool { _, ok := htmlAttr(n, "data-seconds"); return ok })
		require.Len(t, cells, 1)
		secs, _ := htmlAttr(cells[0], "data-seconds")
		v, err := strconv.ParseFloat(secs, 64)
		require.NoError(t, err)
		assert.Greater(t, v, 0.0, "step %s has a duration", id)
	}

	chart := filepath.Join(dir, "score.png")
	out, err = report(id, "--format", "png", "--metric", "eval.score", "--out", chart)
	require.NoError(t, err, out)
	pf, err := os.Open(chart)
	require.NoError(t, err)
	defer pf.Close()
	_, err = png.Decode(pf)
	require.NoError(t, err, "the chart is a PNG")

	out, err = report(id, "--format", "svg", "--metric", "eval.accuracy", "--out", filepath.Join(dir, "x.svg"))
	require.Error(t, err)
	assert.Contains(t, out, `has no metric "eval.accuracy": it has step-durations, `)
	out, err = report("no-such-run")
	require.Error(t, err)
	assert.Contains(t, strings.TrimSpace(out), `no run with id "no-such-run"`)
}
