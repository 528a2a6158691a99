package runs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/rlflow/rlflow/workflows"
	enumspb "go.temporal.io/api/enums/v1"
	failurepb "go.temporal.io/api/failure/v1"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/proto"
)

// StepView is one step as `status` shows it: the interpreter's state merged
// with Temporal's live view of a running activity (attempt, last failure).
type StepView struct {
	workflows.StepResult
	LastFailure string `json:"last_failure,omitempty"`
}

// RunStatus is everything `rlflow status` prints about a run.
type RunStatus struct {
	WorkflowID string             `json:"workflow_id"`
	RunID      string             `json:"run_id"`
	Execution  string             `json:"execution"` // Temporal's status: Running, Completed, Failed, ...
	Progress   workflows.Progress `json:"progress"`
	Steps      []StepView         `json:"steps,omitempty"`
	// ProgressErr is set when the workflow could not be queried (no worker).
	ProgressErr string `json:"progress_error,omitempty"`
	// Failure is why a closed run did not succeed (failed, cancelled,
	// terminated, timed out); nil for a running or completed one.
	Failure *Failure `json:"failure,omitempty"`
	// Iterations are the finished iterations' outputs, oldest first, when
	// FillIterations was asked for them: every one up to IterationsDone,
	// each read from its iteration workflow's result.
	Iterations []workflows.IterationSummary `json:"iterations,omitempty"`
	// IterationsErr says which iterations' results could not be read.
	IterationsErr string `json:"iterations_error,omitempty"`
}

// Done reports whether the run has closed.
func (s *RunStatus) Done() bool { return s.Execution != "" && s.Execution != "Running" }

// Unsuccessful reports whether the run closed without succeeding: failed,
// cancelled, terminated or timed out.
func (s *RunStatus) Unsuccessful() bool {
	return s.Done() && s.Execution != "Completed" && s.Execution != "ContinuedAsNew"
}

// GetStatus collects a run's status; runID may be empty (latest run). It
// asks Temporal once: an unreachable frontend is an error.
func GetStatus(ctx context.Context, c client.Client, workflowID, runID string) (*RunStatus, error) {
	return getStatus(ctx, c, workflowID, runID, once)
}

// WaitStatus is GetStatus waiting out a Temporal outage of any length at
// address, telling say when it starts and ends (as run --wait does).
func WaitStatus(ctx context.Context, c client.Client, address, workflowID, runID string, say func(string)) (*RunStatus, error) {
	return getStatus(ctx, c, workflowID, runID, newOutages(address, say).do)
}

// once is a call that does not wait out outages.
func once(ctx context.Context, fn func(context.Context) error) error { return fn(ctx) }

// getStatus is GetStatus with the run's description made through call,
// which may wait out an outage. The queries are not: a query that fails
// leaves ProgressErr set, never ends the command, and most often means no
// worker answers rather than no frontend.
func getStatus(ctx context.Context, c client.Client, workflowID, runID string, call func(context.Context, func(context.Context) error) error) (*RunStatus, error) {
	var d *workflowservice.DescribeWorkflowExecutionResponse
	err := call(ctx, func(ctx context.Context) error {
		desc, err := c.DescribeWorkflow(ctx, workflowID, runID)
		if err == nil {
			d = desc.RawResponse
		}
		return err
	})
	if err != nil {
		var nf *serviceerror.NotFound
		if errors.As(err, &nf) {
			return nil, fmt.Errorf("no run with id %q", workflowID)
		}
		return nil, fmt.Errorf("describing %s: %w", workflowID, err)
	}
	info := d.GetWorkflowExecutionInfo()
	st := &RunStatus{
		WorkflowID: workflowID,
		RunID:      info.GetExecution().GetRunId(),
		Execution:  executionName(info.GetStatus()),
	}
	if st.Unsuccessful() {
		// A closed run's error is in its close event: no worker needed.
		defer func() {
			runErr := call(ctx, func(ctx context.Context) error {
				return c.GetWorkflow(ctx, workflowID, st.RunID).Get(ctx, nil)
			})
			if runErr == nil {
				return
			}
			f := runFailure(st, runErr)
			st.Failure = &f
		}()
	}
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := query(qctx, c, workflowID, st.RunID, &st.Progress); err != nil {
		st.ProgressErr = err.Error()
		return st, nil
	}
	if st.Progress.Child == "" {
		return st, nil
	}
	var child workflows.Progress
	if err := query(qctx, c, st.Progress.Child, "", &child); err != nil {
		return st, nil // the child may not have started yet
	}
	pending := map[string]StepView{}
	if cd, err := c.DescribeWorkflow(qctx, st.Progress.Child, ""); err == nil {
		for _, pa := range cd.RawResponse.GetPendingActivities() {
			v := StepView{
				StepResult:  workflows.StepResult{Attempts: int(pa.GetAttempt())},
				LastFailure: failureMessage(pa.GetLastFailure()),
			}
			id := pa.GetActivityId()
			if step, ok := workflows.RoutedStepID(id); ok {
				// A step on a GPU worker runs one activity per attempt; the
				// interpreter, not Temporal, counts its attempts.
				id, v.Attempts = step, 0
			}
			pending[id] = v
		}
	}
	for _, s := range child.Steps {
		v := StepView{StepResult: s}
		if p, ok := pending[s.ID]; ok && s.Status == workflows.StatusRunning {
			v.LastFailure = p.LastFailure
			if p.Attempts > 0 {
				v.Attempts = p.Attempts
			}
		}
		st.Steps = append(st.Steps, v)
	}
	if child.LastError != "" && st.Progress.LastError == "" {
		st.Progress.LastError = child.LastError
	}
	return st, nil
}

func query(ctx context.Context, c client.Client, id, runID string, out any) error {
	v, err := c.QueryWorkflow(ctx, id, runID, workflows.QueryProgress)
	if err != nil {
		return fmt.Errorf("querying %s: %w", id, err)
	}
	return v.Get(out)
}

func executionName(s enumspb.WorkflowExecutionStatus) string {
	name := s.String() // e.g. "Running", "Completed", "ContinuedAsNew"
	return strings.TrimPrefix(name, "WorkflowExecutionStatus")
}

// PrintStatus writes a human-readable status: metrics whole, floats
// rounded to 6 significant digits, and a failure's log tail in full.
func PrintStatus(w io.Writer, st *RunStatus) {
	p := st.Progress
	fmt.Fprintf(w, "run:        %s (%s)\n", st.WorkflowID, st.RunID)
	fmt.Fprintf(w, "execution:  %s\n", st.Execution)
	if st.Failure != nil {
		fmt.Fprintf(w, "error:      %s\n", st.Failure)
	}
	if st.ProgressErr != "" {
		fmt.Fprintf(w, "progress:   unavailable: %s\n", st.ProgressErr)
		return
	}
	fmt.Fprintf(w, "pipeline:   %s\n", p.Pipeline)
	fmt.Fprintf(w, "iteration:  %d (%d done)%s\n", p.Iteration, p.IterationsDone, map[bool]string{true: ", PAUSED", false: ""}[p.Paused])
	if p.LastError != "" && st.Failure == nil {
		fmt.Fprintf(w, "last error: %s\n", splitMessage(p.LastError))
	}
	if len(st.Iterations) > 0 {
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "ITERATION\tSTATUS\tOUTPUTS\n")
		for _, it := range st.Iterations {
			fmt.Fprintf(tw, "%d\t%s\t%s\n", it.Iteration, it.Status, formatStepOutputs(it.Outputs))
		}
		tw.Flush()
	}
	if st.IterationsErr != "" {
		fmt.Fprintf(w, "iterations: %s\n", st.IterationsErr)
	}
	if len(st.Steps) == 0 {
		return
	}
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "STEP\tUSES\tSTATUS\tATTEMPT\tDETAIL\n")
	for _, s := range st.Steps {
		detail := s.Reason
		switch {
		case s.LastFailure != "":
			detail = "last failure: " + splitMessage(s.LastFailure).Sentence
		case s.Error != "":
			detail = splitMessage(s.Error).Sentence
		case s.Status == workflows.StatusSucceeded:
			detail = formatOutputs(s.Outputs)
		}
		if h := s.GPUHost; h != nil {
			detail = fmt.Sprintf("[gpu %s:%d] %s", h.Host, h.Device, detail)
		}
		att := ""
		if s.Attempts > 0 {
			att = fmt.Sprint(s.Attempts)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", s.ID, s.Uses, s.Status, att, detail)
	}
	tw.Flush()
}

// formatOutputs is a step's outputs as "k=v ..." sorted by key, every one,
// without the log path.
func formatOutputs(m map[string]any) string {
	ks := make([]string, 0, len(m))
	for k := range m {
		if k != "log" {
			ks = append(ks, k)
		}
	}
	sort.Strings(ks)
	parts := make([]string, 0, len(ks))
	for _, k := range ks {
		parts = append(parts, k+"="+FormatValue(m[k]))
	}
	return strings.Join(parts, " ")
}

// formatStepOutputs is an iteration's outputs as "step.k=v ...", steps in
// name order.
func formatStepOutputs(m map[string]map[string]any) string {
	ids := make([]string, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var parts []string
	for _, id := range ids {
		ks := make([]string, 0, len(m[id]))
		for k := range m[id] {
			if k != "log" {
				ks = append(ks, k)
			}
		}
		sort.Strings(ks)
		for _, k := range ks {
			parts = append(parts, id+"."+k+"="+FormatValue(m[id][k]))
		}
	}
	return strings.Join(parts, " ")
}

// FormatValue prints an output value for people: a whole number as one
// (JSON makes every number a float64), any other float rounded to 6
// significant digits (0.6000000000000001 is 0.6), the rest as JSON.
func FormatValue(v any) string {
	switch v := v.(type) {
	case float64:
		return formatFloat(v, 64)
	case float32:
		return formatFloat(float64(v), 32)
	case string:
		return v
	case nil:
		return "null"
	}
	b, err := json.Marshal(roundFloats(v))
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// roundFloats is v with every float inside its maps and lists rounded as
// FormatValue rounds one (json.Number keeps the printed digits).
func roundFloats(v any) any {
	switch v := v.(type) {
	case float64:
		return json.Number(formatFloat(v, 64))
	case map[string]any:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[k] = roundFloats(x)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = roundFloats(x)
		}
		return out
	}
	return v
}

func formatFloat(v float64, bits int) string {
	if v == math.Trunc(v) && math.Abs(v) < 1e15 {
		return strconv.FormatFloat(v, 'f', -1, bits)
	}
	return strconv.FormatFloat(v, 'g', 6, bits)
}

// failureMessage is a failure's message, decrypted when the payload codec is
// on (the failure converter then encodes it; see clientOptions).
func failureMessage(f *failurepb.Failure) string {
	if dc, _ := payloadCodec(); dc != nil && f != nil {
		f = proto.Clone(f).(*failurepb.Failure)
		converter.DecodeCommonFailureAttributes(dc, f)
	}
	return f.GetMessage()
}

// truncate cuts s to n bytes with "..." (network reasons only: outputs
// and failures are printed whole).
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}
