package runs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
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
}

// Done reports whether the run has closed.
func (s *RunStatus) Done() bool { return s.Execution != "" && s.Execution != "Running" }

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

// PrintStatus writes a human-readable status.
func PrintStatus(w io.Writer, st *RunStatus) {
	p := st.Progress
	fmt.Fprintf(w, "run:        %s (%s)\n", st.WorkflowID, st.RunID)
	fmt.Fprintf(w, "execution:  %s\n", st.Execution)
	if st.ProgressErr != "" {
		fmt.Fprintf(w, "progress:   unavailable: %s\n", st.ProgressErr)
		return
	}
	fmt.Fprintf(w, "pipeline:   %s\n", p.Pipeline)
	fmt.Fprintf(w, "iteration:  %d (%d done)%s\n", p.Iteration, p.IterationsDone, map[bool]string{true: ", PAUSED", false: ""}[p.Paused])
	if p.LastError != "" {
		fmt.Fprintf(w, "last error: %s\n", firstLine(p.LastError))
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
			detail = "last failure: " + firstLine(s.LastFailure)
		case s.Error != "":
			detail = firstLine(s.Error)
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
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", s.ID, s.Uses, s.Status, att, truncate(detail, 100))
	}
	tw.Flush()
}

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
		parts = append(parts, fmt.Sprintf("%s=%v", k, m[k]))
	}
	return strings.Join(parts, " ")
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
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
