package report

import (
	"fmt"
	"html/template"
	"io"
	"strconv"
	"time"

	"github.com/rlflow/rlflow/workflows"
)

// The page's tables carry the exact numbers as data attributes (a metric's
// data-value is strconv's shortest round-trip form), so that a test or a
// script reads the same values the charts plot.
var page = template.Must(template.New("report").Funcs(template.FuncMap{
	"exact":   func(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) },
	"short":   func(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) },
	"seconds": func(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 3, 64) },
	"when": func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return t.UTC().Format(time.RFC3339)
	},
	"ok": func(status string) bool { return status == workflows.StatusSucceeded },
}).Parse(`<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>rlflow report: {{.Run.WorkflowID}}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 2em; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; }
dt { font-weight: bold; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0; border: 1px solid #ddd; padding: .5em; }
table { border-collapse: collapse; margin-top: .5em; }
th, td { border: 1px solid #ccc; padding: .2em .6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fde2e2; }
td.retried { background: #ffe9cc; }
.error { color: #a40000; white-space: pre-wrap; font-family: monospace; }
</style>
</head>
<body>
<h1>rlflow report: {{.Run.WorkflowID}}</h1>
<dl id="summary">
<dt>pipeline</dt><dd>{{.Run.Pipeline}}</dd>
<dt>status</dt><dd id="status">{{.Run.Status}}</dd>
<dt>iterations</dt><dd>{{len .Run.Iterations}}</dd>
<dt>runs</dt><dd>{{len .Run.RunIDs}} (continue-as-new chain: {{range $i, $r := .Run.RunIDs}}{{if $i}}, {{end}}{{$r}}{{end}})</dd>
{{- if .Run.Error}}
<dt>error</dt><dd class="error">{{.Run.Error}}</dd>
{{- end}}
<dt>generated</dt><dd>{{when .Generated}}</dd>
</dl>
<p>Red dashed lines mark iterations that did not succeed; orange triangles, iterations in which a step was retried.</p>

<h2>Metrics</h2>
<div class="charts">
{{- range .Charts}}
<figure class="chart" data-chart="{{.Name}}">{{.SVG}}</figure>
{{- end}}
</div>

<h2>Iterations</h2>
<table id="iterations">
<thead><tr><th>iteration</th><th>status</th><th>seconds</th>{{range .Metrics}}<th>{{.}}</th>{{end}}<th>error</th></tr></thead>
<tbody>
{{- range .Rows}}
<tr data-iteration="{{.It.Number}}" data-status="{{.It.Status}}"{{if not (ok .It.Status)}} class="bad"{{end}}>
<td><span title="{{.It.WorkflowID}} ({{.It.RunID}})">{{.It.Number}}</span></td><td>{{.It.Status}}{{if .It.Retried}} (retried){{end}}</td><td class="num">{{seconds .It.Duration}}</td>
{{- range .Values}}
<td class="num" data-metric="{{.Name}}"{{if .Has}} data-value="{{exact .Value}}">{{short .Value}}{{else}}>{{end}}</td>
{{- end}}
<td class="error">{{.It.Error}}</td>
</tr>
{{- end}}
</tbody>
</table>

<h2>Steps</h2>
<table id="steps">
<thead><tr><th>iteration</th><th>step</th><th>uses</th><th>status</th><th>attempt</th><th>executions</th><th>scheduled</th><th>queued s</th><th>seconds</th><th>error or reason</th></tr></thead>
<tbody>
{{- range .Run.Iterations}}{{$it := .}}
{{- range .Steps}}
<tr data-iteration="{{$it.Number}}" data-step="{{.ID}}" data-status="{{.Status}}"{{if eq .Status "failed" "cancelled"}} class="bad"{{end}}>
<td>{{$it.Number}}</td><td>{{.ID}}</td><td>{{.Uses}}</td><td>{{.Status}}</td>
<td class="num{{if .Retried}} retried{{end}}">{{if .Attempts}}{{.Attempts}}{{end}}</td><td class="num{{if gt .Executions 1}} retried{{end}}">{{.Executions}}</td>
<td>{{when .Scheduled}}</td><td class="num">{{if .QueueWait}}{{seconds .QueueWait}}{{end}}</td><td class="num" data-seconds="{{.Duration.Seconds}}">{{if .Duration}}{{seconds .Duration}}{{end}}</td>
<td class="error">{{.Error}}</td>
</tr>
{{- end}}
{{- end}}
</tbody>
</table>
</body>
</html>
`))

type chartView struct {
	Name string
	SVG  template.HTML
}

type valueView struct {
	Name  string
	Value float64
	Has   bool
}

type rowView struct {
	It     Iteration
	Values []valueView
}

// WriteHTML writes the run's report as one self-contained HTML page; now
// is the time it names as generated.
func (r *Run) WriteHTML(w io.Writer, now time.Time) error {
	metrics := r.Metrics()
	data := struct {
		Run       *Run
		Generated time.Time
		Charts    []chartView
		Metrics   []string
		Rows      []rowView
	}{Run: r, Generated: now, Metrics: metrics}
	if len(r.Iterations) > 0 {
		for _, name := range r.Charts() {
			svg, err := r.svg(name)
			if err != nil {
				return err
			}
			// The SVG is gonum/plot's own output, its text escaped.
			data.Charts = append(data.Charts, chartView{Name: name, SVG: template.HTML(svg)})
		}
	}
	for _, it := range r.Iterations {
		row := rowView{It: it}
		for _, m := range metrics {
			v, ok := it.Metric(m)
			row.Values = append(row.Values, valueView{Name: m, Value: v, Has: ok})
		}
		data.Rows = append(data.Rows, row)
	}
	if err := page.Execute(w, data); err != nil {
		return fmt.Errorf("writing the report of %s: %w", r.WorkflowID, err)
	}
	return nil
}
