package report

import (
	"bytes"
	"image/png"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/html"
)

var t0 = time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)

func step(id, uses, status string, startS, secs float64, attempts int, metrics map[string]float64) Step {
	s := Step{ID: id, Uses: uses, Status: status, Attempts: attempts, Metrics: metrics}
	if status != workflows.StatusSkipped && status != workflows.StatusPending {
		s.Executions = 1
		s.Scheduled = t0.Add(time.Duration(startS * float64(time.Second)))
		s.Started = s.Scheduled.Add(10 * time.Millisecond)
		s.Closed = s.Scheduled.Add(time.Duration(secs * float64(time.Second)))
	}
	return s
}

// fixture is a run of three iterations over two runs of a continue-as-new
// chain: the second retried train, the third failed at sync.
func fixture() *Run {
	it := func(n int, status, errMsg string, steps ...Step) Iteration {
		return Iteration{Number: n, WorkflowID: "demo/iter-" + strconv.Itoa(n), RunID: "r" + strconv.Itoa(n), Status: status, Error: errMsg,
			Start: t0, End: t0.Add(10 * time.Second), Steps: steps}
	}
	return &Run{
		WorkflowID: "demo", Pipeline: "rlhf-demo", Status: "Failed", Error: "iteration 3: step sync (broadcast) failed: injected fault",
		RunIDs: []string{"run-a", "run-b"},
		Iterations: []Iteration{
			it(1, workflows.StatusSucceeded, "",
				step("train", "exec", workflows.StatusSucceeded, 0, 2, 1, map[string]float64{"loss": 2.5, "reward": 0.1}),
				step("sync", "broadcast", workflows.StatusSucceeded, 2, 0.5, 1, map[string]float64{"seconds": 0.25}),
				step("eval", "evaluate", workflows.StatusSucceeded, 3, 1, 1, map[string]float64{"score": 0.1})),
			it(2, workflows.StatusSucceeded, "",
				step("train", "exec", workflows.StatusSucceeded, 0, 3, 2, map[string]float64{"loss": 1.75, "reward": 0.30000000000000004}),
				step("sync", "broadcast", workflows.StatusSucceeded, 3, 0.5, 1, map[string]float64{"seconds": 0.125}),
				step("eval", "evaluate", workflows.StatusSucceeded, 4, 1, 1, map[string]float64{"score": 0.6000000000000001})),
			it(3, workflows.StatusFailed, "iteration 3: step sync (broadcast) failed: injected fault",
				step("train", "exec", workflows.StatusSucceeded, 0, 2, 1, map[string]float64{"loss": 1.5, "reward": 0.4}),
				step("sync", "broadcast", workflows.StatusFailed, 2, 1, 3, nil),
				step("eval", "evaluate", workflows.StatusSkipped, 0, 0, 0, nil)),
		},
	}
}

func TestMetricsInStepOrder(t *testing.T) {
	assert.Equal(t, []string{"train.loss", "train.reward", "sync.seconds", "eval.score"}, fixture().Metrics())
	assert.Equal(t, []string{DurationsChart, "train.loss", "train.reward", "sync.seconds", "eval.score"}, fixture().Charts())
}

// parse is the page's element tree.
func parse(t *testing.T, page string) *html.Node {
	t.Helper()
	doc, err := html.Parse(strings.NewReader(page))
	require.NoError(t, err)
	return doc
}

func attr(n *html.Node, key string) (string, bool) {
	for _, a := range n.Attr {
		if a.Key == key {
			return a.Val, true
		}
	}
	return "", false
}

// findAll lists the elements under n for which match holds, in order.
func findAll(n *html.Node, match func(*html.Node) bool) []*html.Node {
	var out []*html.Node
	for c := range n.Descendants() {
		if c.Type == html.ElementNode && match(c) {
			out = append(out, c)
		}
	}
	return out
}

func byID(id string) func(*html.Node) bool {
	return func(n *html.Node) bool { v, _ := attr(n, "id"); return v == id }
}

func tag(name string) func(*html.Node) bool {
	return func(n *html.Node) bool { return n.Data == name }
}

// TestHTMLTablesHoldTheRunsNumbers reads the page as a browser would and
// checks every number of the iterations table, each row's status and the
// charts, against the run.
func TestHTMLTablesHoldTheRunsNumbers(t *testing.T) {
	run := fixture()
	var b bytes.Buffer
	require.NoError(t, run.WriteHTML(&b, t0))
	doc := parse(t, b.String())

	tables := findAll(doc, byID("iterations"))
	require.Len(t, tables, 1)
	rows := findAll(tables[0], func(n *html.Node) bool { _, ok := attr(n, "data-iteration"); return n.Data == "tr" && ok })
	require.Len(t, rows, len(run.Iterations))
	for i, row := range rows {
		it := run.Iterations[i]
		n, _ := attr(row, "data-iteration")
		assert.Equal(t, strconv.Itoa(it.Number), n)
		st, _ := attr(row, "data-status")
		assert.Equal(t, it.Status, st)
		class, _ := attr(row, "class")
		assert.Equal(t, it.Status != workflows.StatusSucceeded, class == "bad", "iteration %d marked bad", it.Number)
		cells := findAll(row, func(n *html.Node) bool { _, ok := attr(n, "data-metric"); return ok })
		require.Len(t, cells, len(run.Metrics()))
		for j, cell := range cells {
			name, _ := attr(cell, "data-metric")
			assert.Equal(t, run.Metrics()[j], name)
			want, has := it.Metric(name)
			got, ok := attr(cell, "data-value")
			require.Equal(t, has, ok, "iteration %d %s has a value", it.Number, name)
			if has {
				v, err := strconv.ParseFloat(got, 64)
				require.NoError(t, err)
				assert.Equal(t, want, v, "iteration %d %s", it.Number, name) // exact, not rounded
			}
		}
	}

	figures := findAll(doc, tag("figure"))
	require.Len(t, figures, len(run.Charts()))
	for i, f := range figures {
		name, _ := attr(f, "data-chart")
		assert.Equal(t, run.Charts()[i], name)
		assert.Len(t, findAll(f, tag("svg")), 1, "chart %s is inline SVG", name)
	}

	steps := findAll(doc, func(n *html.Node) bool { v, _ := attr(n, "data-step"); return v == "sync" })
	require.Len(t, steps, 3)
	st, _ := attr(steps[2], "data-status")
	assert.Equal(t, workflows.StatusFailed, st)
	cells := findAll(steps[0], func(n *html.Node) bool { _, ok := attr(n, "data-seconds"); return ok })
	require.Len(t, cells, 1)
	secs, _ := attr(cells[0], "data-seconds")
	assert.Equal(t, "0.5", secs)
	assert.Len(t, findAll(doc, func(n *html.Node) bool { v, _ := attr(n, "class"); return strings.Contains(v, "retried") }), 2,
		"train's 2 attempts in iteration 2 and sync's 3 in iteration 3")
	assert.Contains(t, b.String(), "injected fault")
}

// The page needs nothing from the network: no scripts, style sheets,
// images or fonts it would fetch.
func TestHTMLIsSelfContained(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, fixture().WriteHTML(&b, t0))
	doc := parse(t, b.String())
	for _, n := range findAll(doc, func(*html.Node) bool { return true }) {
		for _, key := range []string{"src", "href", "xlink:href"} {
			if v, ok := attr(n, key); ok {
				assert.True(t, strings.HasPrefix(v, "#") || strings.HasPrefix(v, "data:"), "<%s %s=%q> fetches", n.Data, key, v)
			}
		}
		assert.NotContains(t, []string{"script", "link", "img", "iframe"}, n.Data)
	}
	assert.NotContains(t, b.String(), "@import")
	assert.NotContains(t, b.String(), "url(")
}

// A failed iteration draws the failure colour on every chart, a retried
// step the retry colour on its metrics; a clean run draws neither.
func TestChartsMarkFailuresAndRetries(t *testing.T) {
	failed, retried := "stroke:#D62728", "stroke:#FF7F0E"
	run := fixture()
	for _, name := range run.Charts() {
		svg, err := run.svg(name)
		require.NoError(t, err)
		assert.True(t, strings.Contains(svg, failed), "%s marks the failed iteration", name)
		if name != DurationsChart {
			assert.True(t, strings.Contains(svg, retried), "%s marks the retried steps", name)
		}
	}
	clean := fixture()
	clean.Iterations = clean.Iterations[:1]
	for _, name := range clean.Charts() {
		svg, err := clean.svg(name)
		require.NoError(t, err)
		assert.False(t, strings.Contains(svg, failed), "%s marks no failure", name)
		assert.False(t, strings.Contains(svg, retried), "%s marks no retry", name)
	}
}

func TestWriteChartFormats(t *testing.T) {
	run := fixture()
	var b bytes.Buffer
	require.NoError(t, run.WriteChart(&b, "eval.score", "png"))
	img, err := png.Decode(&b)
	require.NoError(t, err)
	assert.Greater(t, img.Bounds().Dx(), 100)

	b.Reset()
	require.NoError(t, run.WriteChart(&b, DurationsChart, "svg"))
	assert.Contains(t, b.String(), "<svg")
	assert.Contains(t, b.String(), "step durations")
}

func TestWriteChartErrors(t *testing.T) {
	for _, tc := range []struct{ name, format, want string }{
		{"eval.accuracy", "svg", `run demo has no metric "eval.accuracy": it has step-durations, train.loss, train.reward, sync.seconds, eval.score`},
		{"eval.score", "pdf", `chart format "pdf": want one of svg, png`},
		{"score", "png", `run demo has no metric "score": it has step-durations, train.loss, train.reward, sync.seconds, eval.score`},
	} {
		err := fixture().WriteChart(&bytes.Buffer{}, tc.name, tc.format)
		require.Error(t, err, tc.name)
		assert.Equal(t, tc.want, err.Error())
	}
	empty := &Run{WorkflowID: "nothing"}
	assert.EqualError(t, empty.WriteChart(&bytes.Buffer{}, DurationsChart, "svg"), "run nothing has no iterations to chart")
	var b bytes.Buffer
	require.NoError(t, empty.WriteHTML(&b, t0), "a run that has not started an iteration still has a page")
	assert.Contains(t, b.String(), "<h1>rlflow report: nothing</h1>")
}

func TestStepOfActivity(t *testing.T) {
	for id, want := range map[string]string{"sync": "sync", "sync/attempt-2": "sync", "eval/rerun-1": "eval"} {
		assert.Equal(t, want, stepOfActivity(id), id)
	}
}
