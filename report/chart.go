package report

import (
	"bytes"
	"fmt"
	"image/color"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/rlflow/rlflow/workflows"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// DurationsChart names the chart of step durations per iteration, beside
// the metrics' names.
const DurationsChart = "step-durations"

// Chart formats Chart writes.
var Formats = []string{"svg", "png"}

const chartWidth, chartHeight = 16 * vg.Centimeter, 8 * vg.Centimeter

var (
	failedColor  = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
	retriedColor = color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}
	valueColor   = color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}
)

// Charts lists the charts a run has: DurationsChart, then one per metric.
func (r *Run) Charts() []string { return append([]string{DurationsChart}, r.Metrics()...) }

// WriteChart writes one chart (a metric's name, or DurationsChart) as
// format ("svg" or "png").
func (r *Run) WriteChart(w io.Writer, name, format string) error {
	if !slices.Contains(Formats, format) {
		return fmt.Errorf("chart format %q: want one of %s", format, strings.Join(Formats, ", "))
	}
	p, err := r.chart(name)
	if err != nil {
		return err
	}
	wt, err := p.WriterTo(chartWidth, chartHeight, format)
	if err != nil {
		return fmt.Errorf("rendering chart %s: %w", name, err)
	}
	_, err = wt.WriteTo(w)
	return err
}

func (r *Run) chart(name string) (*plot.Plot, error) {
	if name == DurationsChart {
		return r.durationsChart()
	}
	if !slices.Contains(r.Metrics(), name) {
		return nil, fmt.Errorf("run %s has no metric %q: it has %s", r.WorkflowID, name, strings.Join(r.Charts(), ", "))
	}
	return r.metricChart(name)
}

// svg renders a chart for inline use in HTML: the <svg> element alone.
func (r *Run) svg(name string) (string, error) {
	var b bytes.Buffer
	if err := r.WriteChart(&b, name, "svg"); err != nil {
		return "", err
	}
	s := b.String()
	i := strings.Index(s, "<svg")
	if i < 0 {
		return "", fmt.Errorf("rendering chart %s: no <svg> element in the output", name)
	}
	return s[i:], nil
}

func newPlot(title, yLabel string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "iteration"
	p.Y.Label.Text = yLabel
	p.X.Tick.Marker = iterationTicks{}
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	return p
}

// metricChart plots one metric's value per iteration; iterations that did
// not succeed get a red line, values from iterations with a retried step
// an orange triangle.
func (r *Run) metricChart(name string) (*plot.Plot, error) {
	p := newPlot(name, name)
	var values, retried plotter.XYs
	for _, it := range r.Iterations {
		v, ok := it.Metric(name)
		if !ok {
			continue
		}
		pt := plotter.XY{X: float64(it.Number), Y: v}
		values = append(values, pt)
		if it.Retried() {
			retried = append(retried, pt)
		}
	}
	line, points, err := plotter.NewLinePoints(values)
	if err != nil {
		return nil, fmt.Errorf("chart %s: %w", name, err)
	}
	line.Color = valueColor
	points.Color, points.Shape, points.Radius = valueColor, draw.CircleGlyph{}, vg.Points(3)
	p.Add(line, points)
	p.Legend.Add(name, line, points)
	lo, hi := yRange(values)
	marks, err := r.markIterations(p, lo, hi, retried)
	if err != nil {
		return nil, fmt.Errorf("chart %s: %w", name, err)
	}
	r.frame(p, lo, hi, 1+marks)
	return p, nil
}

// durationsChart stacks each iteration's step durations, in seconds.
func (r *Run) durationsChart() (*plot.Plot, error) {
	p := newPlot("step durations", "seconds")
	if len(r.Iterations) == 0 {
		return nil, fmt.Errorf("run %s has no iterations to chart", r.WorkflowID)
	}
	first := r.Iterations[0].Number
	last := r.Iterations[len(r.Iterations)-1].Number
	var below *plotter.BarChart
	for i, id := range r.StepIDs() {
		secs := make(plotter.Values, last-first+1)
		for _, it := range r.Iterations {
			for _, s := range it.Steps {
				if s.ID == id {
					secs[it.Number-first] = s.Duration().Seconds()
				}
			}
		}
		bars, err := plotter.NewBarChart(secs, barWidth(len(secs)))
		if err != nil {
			return nil, fmt.Errorf("chart %s: %w", DurationsChart, err)
		}
		bars.XMin = float64(first)
		bars.Color = plotutil.Color(i)
		bars.LineStyle.Width = 0
		if below != nil {
			bars.StackOn(below)
		}
		p.Add(bars)
		p.Legend.Add(id, bars)
		below = bars
	}
	hi := 0.0
	if below != nil {
		for i := range below.Values {
			hi = math.Max(hi, below.BarHeight(i))
		}
	}
	marks, err := r.markIterations(p, 0, hi, nil)
	if err != nil {
		return nil, fmt.Errorf("chart %s: %w", DurationsChart, err)
	}
	r.frame(p, 0, hi, len(r.StepIDs())+marks)
	return p, nil
}

// markIterations draws a red dashed line across [lo, hi] at every
// iteration that did not succeed, and an orange triangle at each retried
// point. It returns how many legend entries it added.
func (r *Run) markIterations(p *plot.Plot, lo, hi float64, retried plotter.XYs) (int, error) {
	if lo == hi {
		lo, hi = lo-0.5, hi+0.5
	}
	marked, entries := false, 0
	for _, it := range r.Iterations {
		if it.Status == workflows.StatusSucceeded || it.Status == workflows.StatusRunning {
			continue
		}
		x := float64(it.Number)
		l, err := plotter.NewLine(plotter.XYs{{X: x, Y: lo}, {X: x, Y: hi}})
		if err != nil {
			return 0, err
		}
		l.Color, l.Width, l.Dashes = failedColor, vg.Points(1.5), []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(l)
		if !marked {
			p.Legend.Add("iteration "+it.Status, l)
			marked, entries = true, entries+1
		}
	}
	if len(retried) > 0 {
		s, err := plotter.NewScatter(retried)
		if err != nil {
			return 0, err
		}
		s.Color, s.Shape, s.Radius = retriedColor, draw.TriangleGlyph{}, vg.Points(5)
		p.Add(s)
		p.Legend.Add("a step retried", s)
		entries++
	}
	return entries, nil
}

// frame leaves half an iteration of room on either side, and room above
// the data for the legend (top left), so that neither hides a point.
func (r *Run) frame(p *plot.Plot, lo, hi float64, legendEntries int) {
	if n := len(r.Iterations); n > 0 {
		p.X.Min = float64(r.Iterations[0].Number) - 0.5
		p.X.Max = float64(r.Iterations[n-1].Number) + 0.5
	}
	if lo == hi {
		lo, hi = lo-0.5, hi+0.5
	}
	p.Y.Max = math.Max(p.Y.Max, hi+(hi-lo)*0.1*float64(legendEntries+1))
	p.Legend.Left = true
}

// barWidth fits n bars in a chart's width, at most 18pt each.
func barWidth(n int) vg.Length {
	return vg.Points(math.Min(18, 300/float64(max(n, 1))))
}

func yRange(xys plotter.XYs) (lo, hi float64) {
	if len(xys) == 0 {
		return 0, 1
	}
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, v := range xys {
		lo, hi = math.Min(lo, v.Y), math.Max(hi, v.Y)
	}
	return lo, hi
}

// iterationTicks marks whole iterations only, at most about ten labels.
type iterationTicks struct{}

func (iterationTicks) Ticks(lo, hi float64) []plot.Tick {
	first, last := math.Ceil(lo), math.Floor(hi)
	step := math.Max(1, math.Ceil((last-first+1)/10))
	var ticks []plot.Tick
	for x := first; x <= last; x += step {
		ticks = append(ticks, plot.Tick{Value: x, Label: fmt.Sprint(int(x))})
	}
	return ticks
}
