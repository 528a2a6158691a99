package workflows

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// What the Temporal UI shows of a run, set by the workflows themselves so
// that it holds however the run was started:
//
//   - every activity carries a summary naming its step (`before · generate`),
//     and every iteration child a static one (`rlhf-demo · iteration 2`);
//   - both workflows keep their current details (Markdown) up to date: the
//     iteration its step table, the pipeline its per-iteration metrics and
//     the last finished iteration's step table;
//   - the pipeline upserts the Rlflow* search attributes, RlflowStatus
//     spelled as Temporal spells execution statuses plus Paused, and
//     RlflowHeadline, the latest value of metrics.headline.
//
// Upserting an attribute the namespace has not registered fails the
// workflow task, and a workflow cannot look: SearchAttributesActivity, a
// local activity run once per run, asks the server which ones it has.
// Summaries and current details are no commands (replay ignores them);
// the new upserts are behind the visibility change version.

// RlflowStatus values: Temporal's execution status names, plus Paused for a
// run that starts no new steps until resumed.
const (
	RunRunning        = "Running"
	RunPaused         = "Paused"
	RunCompleted      = "Completed"
	RunFailed         = "Failed"
	RunCanceled       = "Canceled"
	RunContinuedAsNew = "ContinuedAsNew"
)

// SearchAttributesActivity is a local activity of the control worker: it
// returns the names of SearchAttributeTypes the run's namespace has
// registered with their type, so the run upserts only those.
const SearchAttributesActivity = "search_attributes_registered"

// visibilityChange versions the upserts added for the UI (pause and resume
// during an iteration, the headline, continue-as-new) and the namespace
// check that lets runs upsert without the starter's search_attributes.
const visibilityChange = "visibility"

var searchAttributesCheck = workflow.LocalActivityOptions{
	StartToCloseTimeout: 10 * time.Second,
	RetryPolicy:         &temporal.RetryPolicy{MaximumAttempts: 3},
	Summary:             "check search attributes",
}

// registeredSearchAttributes is the set of rlflow's search attributes the
// run may upsert: those the namespace has, as SearchAttributesActivity
// reports. The starter's search_attributes is not trusted for it (a form
// can set it; a wrong true would fail every workflow task). An error
// leaves the set empty: the run goes on without them.
func registeredSearchAttributes(ctx workflow.Context) map[string]bool {
	set := map[string]bool{}
	var names []string
	lctx := workflow.WithLocalActivityOptions(ctx, searchAttributesCheck)
	if err := workflow.ExecuteLocalActivity(lctx, SearchAttributesActivity).Get(ctx, &names); err != nil {
		workflow.GetLogger(ctx).Warn("not setting search attributes: could not list the namespace's", "error", err)
		return set
	}
	for _, n := range names {
		if _, ours := SearchAttributeTypes[n]; ours {
			set[n] = true
		}
	}
	if len(set) < len(SearchAttributeTypes) {
		workflow.GetLogger(ctx).Warn("the namespace lacks some of rlflow's search attributes; the run sets the others (rlflow run or rlflow dev registers them)",
			"registered", names)
	}
	return set
}

// activitySummary names a step in the UI's event history and timeline.
func activitySummary(s *pipelines.Step) string {
	return s.ID + " · " + s.Uses
}

// iterationSummary is an iteration child's static summary.
func iterationSummary(pipeline string, iteration int) string {
	return fmt.Sprintf("%s · iteration %d", pipeline, iteration)
}

// headlineOf returns the pipeline's headline metric in an iteration's
// outputs, if the pipeline declares one and the iteration produced it as
// a number.
func headlineOf(spec *pipelines.Pipeline, outputs map[string]map[string]any) (float64, bool) {
	step, key, ok := spec.HeadlineRef()
	if !ok {
		return 0, false
	}
	return number(outputs[step][key])
}

func number(v any) (float64, bool) {
	switch n := v.(type) {
	case float64:
		return n, true
	case int:
		return float64(n), true
	case int64:
		return float64(n), true
	}
	return 0, false
}

// formatNumber prints a metric compactly, without float noise (0.6, not
// 0.6000000000000001).
func formatNumber(f float64) string {
	return strconv.FormatFloat(f, 'g', 4, 64)
}

// maxMetricColumns bounds the per-iteration table's width: the headline
// first, then numeric outputs in step order.
const maxMetricColumns = 8

// metricColumns lists "step.key" of every numeric output in the recent
// iterations, the headline first, then in step file order and key order.
func metricColumns(spec *pipelines.Pipeline, recent []IterationSummary) []string {
	seen := map[string]bool{}
	var cols []string
	if spec.Metrics != nil && spec.Metrics.Headline != "" {
		cols, seen[spec.Metrics.Headline] = append(cols, spec.Metrics.Headline), true
	}
	for _, s := range spec.Steps {
		var keys []string
		for _, it := range recent {
			// Map to sorted slice: the order of the loop never shows.
			//workflowcheck:ignore
			for k, v := range it.Outputs[s.ID] {
				if _, ok := number(v); ok && !seen[s.ID+"."+k] {
					seen[s.ID+"."+k] = true
					keys = append(keys, k)
				}
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			cols = append(cols, s.ID+"."+k)
		}
	}
	if len(cols) > maxMetricColumns {
		cols = cols[:maxMetricColumns]
	}
	return cols
}

// pipelineDetails is the pipeline run's current details: its state, the
// recent iterations' metrics and the last finished iteration's steps.
func pipelineDetails(spec *pipelines.Pipeline, status string, iteration, limit int, headline *float64, recent []IterationSummary, steps []StepResult, stepsOf int, servers []pipelines.VLLMServer) string {
	var b strings.Builder
	b.WriteString(fmt.Sprintf("**%s** · %s · iteration %d of %d", mdCell(spec.Name), status, iteration, limit))
	if headline != nil {
		b.WriteString(fmt.Sprintf(" · %s %s", mdCell(spec.Metrics.Headline), formatNumber(*headline)))
	}
	b.WriteString("\n")
	if len(recent) > 0 {
		cols := metricColumns(spec, recent)
		b.WriteString("\n| iteration | status |")
		for _, c := range cols {
			b.WriteString(" " + mdCell(c) + " |")
		}
		b.WriteString("\n|---|---|" + strings.Repeat("---|", len(cols)) + "\n")
		for _, it := range recent {
			b.WriteString(fmt.Sprintf("| %d | %s |", it.Iteration, it.Status))
			for _, c := range cols {
				step, key, _ := strings.Cut(c, ".")
				cell := ""
				if v, ok := number(it.Outputs[step][key]); ok {
					cell = formatNumber(v)
				}
				b.WriteString(" " + cell + " |")
			}
			b.WriteString("\n")
		}
	}
	if len(steps) > 0 {
		b.WriteString(fmt.Sprintf("\nSteps of iteration %d:\n\n", stepsOf))
		writeStepTable(&b, steps, nil)
	}
	writeServers(&b, servers)
	return b.String()
}

// writeServers lists the vLLM servers the run talked to, with their vLLM
// version and weight-transfer API generation.
func writeServers(b *strings.Builder, servers []pipelines.VLLMServer) {
	if len(servers) == 0 {
		return
	}
	b.WriteString("\n| vLLM server | version | API |\n|---|---|---|\n")
	for _, s := range servers {
		version, api := s.Version, s.API
		if version == "" {
			version = "unknown"
		}
		if api == "" {
			api = "unknown"
		}
		if s.Error != "" {
			api += " (" + clipText(s.Error, 80) + ")"
		}
		b.WriteString(fmt.Sprintf("| %s | %s | %s |\n", mdCell(s.URL), mdCell(version), mdCell(api)))
	}
}

// iterationDetails is an iteration's current details: its state and one
// row per step. A running step shows when it started (details are set at
// events, so a running duration would be stale).
func iterationDetails(spec *pipelines.Pipeline, iteration int, status string, runs []*stepRun, servers []pipelines.VLLMServer) string {
	var b strings.Builder
	b.WriteString(fmt.Sprintf("**%s** · iteration %d · %s\n\n", mdCell(spec.Name), iteration, status))
	steps := make([]StepResult, len(runs))
	started := make([]time.Time, len(runs))
	for i, r := range runs {
		steps[i], started[i] = r.result, r.started
	}
	writeStepTable(&b, steps, started)
	writeServers(&b, servers)
	return b.String()
}

func writeStepTable(b *strings.Builder, steps []StepResult, started []time.Time) {
	b.WriteString("| step | state | attempt | duration | outputs |\n|---|---|---|---|---|\n")
	for i, s := range steps {
		attempt := ""
		if s.Attempts > 0 {
			attempt = strconv.Itoa(s.Attempts)
		}
		duration := ""
		switch {
		case s.Seconds > 0:
			duration = (time.Duration(s.Seconds * float64(time.Second))).Round(100 * time.Millisecond).String()
		case s.Status == StatusRunning && started != nil && !started[i].IsZero():
			duration = "since " + started[i].UTC().Format("15:04:05") + " UTC"
		}
		note := keyOutputs(s.Outputs)
		switch {
		case s.Error != "":
			note = s.Error
		case s.Reason != "":
			note = s.Reason
		}
		b.WriteString(fmt.Sprintf("| %s · %s | %s | %s | %s | %s |\n", mdCell(s.ID), mdCell(s.Uses), s.Status, attempt, duration, mdCell(clipText(note, 120))))
	}
}

// keyOutputs shows a step's numeric outputs (the metrics; paths and logs
// are in the result) as `key=value`, in key order.
func keyOutputs(out map[string]any) string {
	var parts []string
	for _, k := range sortedKeys(out) {
		if v, ok := number(out[k]); ok {
			parts = append(parts, k+"="+formatNumber(v))
		}
	}
	return strings.Join(parts, " ")
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	//workflowcheck:ignore
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// mdCell keeps text inside one Markdown table cell.
func mdCell(s string) string {
	s = strings.ReplaceAll(s, "|", `\|`)
	return strings.Join(strings.Fields(s), " ")
}

func clipText(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}
