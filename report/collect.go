package report

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/rlflow/rlflow/workflows"
	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	failurepb "go.temporal.io/api/failure/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/proto"
)

// maxChain bounds the continue-as-new chain Collect follows back: a cycle
// in a broken history must end in an error, not a hang.
const maxChain = 100000

// Collect reads the pipeline run workflowID (its latest continue-as-new
// chain) from Temporal's history. dc decodes payloads and failures; nil is
// Temporal's default converter (a run written with the payload codec on
// needs the same codec here).
func Collect(ctx context.Context, c client.Client, workflowID string, dc converter.DataConverter) (*Run, error) {
	if dc == nil {
		dc = converter.GetDefaultDataConverter()
	}
	h := historyReader{c: c, dc: dc}
	described, err := c.DescribeWorkflow(ctx, workflowID, "")
	if err != nil {
		var nf *serviceerror.NotFound
		if errors.As(err, &nf) {
			return nil, fmt.Errorf("no run with id %q", workflowID)
		}
		return nil, fmt.Errorf("describing %s: %w", workflowID, err)
	}
	info := described.RawResponse.GetWorkflowExecutionInfo()
	if t := info.GetType().GetName(); t != workflows.PipelineWorkflow {
		return nil, fmt.Errorf("%s is a %s workflow, not a pipeline run (%s)", workflowID, t, workflows.PipelineWorkflow)
	}
	run := &Run{WorkflowID: workflowID, Status: executionName(info.GetStatus())}

	// Follow the chain back from its last run: each run's first event names
	// the run it continued.
	var chain [][]*historypb.HistoryEvent
	seen := map[string]bool{}
	for runID := info.GetExecution().GetRunId(); runID != ""; {
		if seen[runID] || len(chain) >= maxChain {
			return nil, fmt.Errorf("%s: the continue-as-new chain loops back to run %s", workflowID, runID)
		}
		seen[runID] = true
		events, err := h.events(ctx, workflowID, runID)
		if err != nil {
			return nil, err
		}
		chain = append(chain, events)
		run.RunIDs = append(run.RunIDs, runID)
		runID = ""
		if st := events[0].GetWorkflowExecutionStartedEventAttributes(); st.GetInitiator() == enumspb.CONTINUE_AS_NEW_INITIATOR_WORKFLOW {
			runID = st.GetContinuedExecutionRunId()
		}
	}
	slices.Reverse(chain)
	slices.Reverse(run.RunIDs)
	run.Error = h.closeFailure(chain[len(chain)-1])

	for i, events := range chain {
		for _, child := range iterationChildren(events) {
			it, err := h.iteration(ctx, child)
			if err != nil {
				return nil, fmt.Errorf("%s (run %s): %w", workflowID, run.RunIDs[i], err)
			}
			if run.Pipeline == "" {
				run.Pipeline = it.pipeline
			}
			run.Iterations = append(run.Iterations, it.Iteration)
		}
	}
	return run, nil
}

func executionName(s enumspb.WorkflowExecutionStatus) string {
	return strings.TrimPrefix(s.String(), "WorkflowExecutionStatus")
}

type historyReader struct {
	c  client.Client
	dc converter.DataConverter
}

// events reads one run's whole history, as it stands now.
func (h historyReader) events(ctx context.Context, workflowID, runID string) ([]*historypb.HistoryEvent, error) {
	iter := h.c.GetWorkflowHistory(ctx, workflowID, runID, false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	var events []*historypb.HistoryEvent
	for iter.HasNext() {
		e, err := iter.Next()
		if err != nil {
			return nil, fmt.Errorf("reading the history of %s (run %s): %w", workflowID, runID, err)
		}
		events = append(events, e)
	}
	if len(events) == 0 || events[0].GetWorkflowExecutionStartedEventAttributes() == nil {
		return nil, fmt.Errorf("the history of %s (run %s) does not begin with its start", workflowID, runID)
	}
	return events, nil
}

// failure is a failure's message, decoded when the codec encoded it.
func (h historyReader) failure(f *failurepb.Failure) string {
	if f == nil {
		return ""
	}
	f = proto.Clone(f).(*failurepb.Failure)
	converter.DecodeCommonFailureAttributes(h.dc, f)
	return f.GetMessage()
}

// closeFailure is why a run ended, when it did not complete.
func (h historyReader) closeFailure(events []*historypb.HistoryEvent) string {
	last := events[len(events)-1]
	switch {
	case last.GetWorkflowExecutionFailedEventAttributes() != nil:
		return h.failure(last.GetWorkflowExecutionFailedEventAttributes().GetFailure())
	case last.GetWorkflowExecutionTimedOutEventAttributes() != nil:
		return "the run timed out"
	case last.GetWorkflowExecutionTerminatedEventAttributes() != nil:
		return "terminated: " + last.GetWorkflowExecutionTerminatedEventAttributes().GetReason()
	case last.GetWorkflowExecutionCanceledEventAttributes() != nil:
		return "cancelled"
	}
	return ""
}

// iterationChildren lists the iteration child workflows a pipeline run
// started, in order.
func iterationChildren(events []*historypb.HistoryEvent) []*commonpb.WorkflowExecution {
	var out []*commonpb.WorkflowExecution
	for _, e := range events {
		if a := e.GetChildWorkflowExecutionStartedEventAttributes(); a != nil && a.GetWorkflowType().GetName() == workflows.IterationWorkflow {
			out = append(out, a.GetWorkflowExecution())
		}
	}
	return out
}

// iterationInput is the part of workflows.IterationInput the report needs:
// decoding only it keeps the report independent of the spec's own rules.
type iterationInput struct {
	Iteration int `json:"iteration"`
	Spec      struct {
		Name  string `json:"name"`
		Steps []struct {
			ID   string `json:"id"`
			Uses string `json:"uses"`
		} `json:"steps"`
	} `json:"spec"`
}

type collected struct {
	Iteration
	pipeline string
}

// activity is one activity of an iteration, from its events.
type activity struct {
	id, status, err string
	attempt         int
	result          map[string]any
	step            *Step
}

// iteration reads one iteration's child workflow: the steps from its
// result when it completed, else from its activities.
func (h historyReader) iteration(ctx context.Context, ex *commonpb.WorkflowExecution) (collected, error) {
	events, err := h.events(ctx, ex.GetWorkflowId(), ex.GetRunId())
	if err != nil {
		return collected{}, err
	}
	first := events[0]
	var in iterationInput
	if err := h.dc.FromPayloads(first.GetWorkflowExecutionStartedEventAttributes().GetInput(), &in); err != nil {
		return collected{}, fmt.Errorf("decoding the input of %s: %w", ex.GetWorkflowId(), err)
	}
	it := Iteration{Number: in.Iteration, WorkflowID: ex.GetWorkflowId(), RunID: ex.GetRunId(), Status: workflows.StatusRunning, Start: first.GetEventTime().AsTime()}
	for _, s := range in.Spec.Steps {
		it.Steps = append(it.Steps, Step{ID: s.ID, Uses: s.Uses, Status: workflows.StatusPending})
	}
	byID := func(activityID string) *Step {
		for _, id := range []string{activityID, stepOfActivity(activityID)} {
			for i := range it.Steps {
				if it.Steps[i].ID == id {
					return &it.Steps[i]
				}
			}
		}
		return nil
	}

	var result *workflows.IterationResult
	scheduled := map[int64]*activity{}
	var order []*activity
	for _, e := range events {
		t := e.GetEventTime().AsTime()
		switch {
		case e.GetActivityTaskScheduledEventAttributes() != nil:
			a := &activity{id: e.GetActivityTaskScheduledEventAttributes().GetActivityId(), status: workflows.StatusRunning}
			a.step = byID(a.id)
			scheduled[e.GetEventId()] = a
			if a.step != nil {
				order = append(order, a)
				a.step.Executions++
				if a.step.Scheduled.IsZero() {
					a.step.Scheduled = t
				}
			}
		case e.GetActivityTaskStartedEventAttributes() != nil:
			ev := e.GetActivityTaskStartedEventAttributes()
			if a := scheduled[ev.GetScheduledEventId()]; a != nil && a.step != nil {
				a.attempt = int(ev.GetAttempt())
				// The started event is written when the activity closes, its
				// time that of the last attempt's start: the first attempt of a
				// retried activity started before it, at a time history lacks.
				if a.step.Started.IsZero() && a.attempt <= 1 {
					a.step.Started = t
				}
			}
		case e.GetActivityTaskCompletedEventAttributes() != nil:
			ev := e.GetActivityTaskCompletedEventAttributes()
			if a := h.closeActivity(scheduled, ev.GetScheduledEventId(), t, workflows.StatusSucceeded, ""); a != nil {
				var out map[string]any
				if err := h.dc.FromPayloads(ev.GetResult(), &out); err == nil {
					a.result = out
				}
			}
		case e.GetActivityTaskFailedEventAttributes() != nil:
			ev := e.GetActivityTaskFailedEventAttributes()
			h.closeActivity(scheduled, ev.GetScheduledEventId(), t, workflows.StatusFailed, h.failure(ev.GetFailure()))
		case e.GetActivityTaskTimedOutEventAttributes() != nil:
			ev := e.GetActivityTaskTimedOutEventAttributes()
			h.closeActivity(scheduled, ev.GetScheduledEventId(), t, workflows.StatusFailed, h.failure(ev.GetFailure()))
		case e.GetActivityTaskCanceledEventAttributes() != nil:
			ev := e.GetActivityTaskCanceledEventAttributes()
			h.closeActivity(scheduled, ev.GetScheduledEventId(), t, workflows.StatusCancelled, "cancelled")
		case e.GetWorkflowExecutionCompletedEventAttributes() != nil:
			it.End, it.Status = t, workflows.StatusSucceeded
			var res workflows.IterationResult
			if err := h.dc.FromPayloads(e.GetWorkflowExecutionCompletedEventAttributes().GetResult(), &res); err != nil {
				return collected{}, fmt.Errorf("decoding the result of %s: %w", ex.GetWorkflowId(), err)
			}
			result = &res
		case e.GetWorkflowExecutionFailedEventAttributes() != nil:
			it.End, it.Status = t, workflows.StatusFailed
			it.Error = h.failure(e.GetWorkflowExecutionFailedEventAttributes().GetFailure())
		case e.GetWorkflowExecutionCanceledEventAttributes() != nil:
			it.End, it.Status, it.Error = t, workflows.StatusCancelled, "cancelled"
		case e.GetWorkflowExecutionTerminatedEventAttributes() != nil:
			it.End, it.Status = t, "terminated"
			it.Error = "terminated: " + e.GetWorkflowExecutionTerminatedEventAttributes().GetReason()
		case e.GetWorkflowExecutionTimedOutEventAttributes() != nil:
			it.End, it.Status, it.Error = t, "timed_out", "the iteration timed out"
		}
	}

	// An activity's last state is its step's, unless the interpreter's
	// result (a completed iteration) says otherwise.
	for _, a := range order {
		s := a.step
		s.Status, s.Error = a.status, a.err
		s.Attempts = max(a.attempt, 1)
		if a.status == workflows.StatusSucceeded {
			s.Metrics = numeric(a.result)
		}
	}
	if result != nil {
		for _, rs := range result.Steps {
			s := byID(rs.ID)
			if s == nil {
				continue
			}
			s.Status, s.Error = rs.Status, rs.Error
			if rs.Status == workflows.StatusSkipped {
				s.Error = rs.Reason
			}
			if rs.Attempts > 0 {
				s.Attempts = rs.Attempts
			}
			s.Metrics = numeric(rs.Outputs)
		}
	}
	return collected{Iteration: it, pipeline: in.Spec.Name}, nil
}

// closeActivity records an activity's end on it and its step.
func (h historyReader) closeActivity(scheduled map[int64]*activity, id int64, t time.Time, status, msg string) *activity {
	a := scheduled[id]
	if a == nil || a.step == nil {
		return nil
	}
	a.status, a.err = status, msg
	a.step.Closed = t
	return a
}

// stepOfActivity is the step an activity id belongs to: a step's own id,
// or "<step>/attempt-N" (a GPU step's executions) and "<step>/rerun-N" (a
// step run again after a re-sync).
func stepOfActivity(activityID string) string {
	if step, ok := workflows.RoutedStepID(activityID); ok {
		return step
	}
	if i := strings.LastIndex(activityID, "/"); i > 0 {
		return activityID[:i]
	}
	return activityID
}

// numeric keeps a step's numeric outputs (JSON numbers decode as float64),
// leaving out rlflow's reserved "_" keys.
func numeric(outputs map[string]any) map[string]float64 {
	var m map[string]float64
	for k, v := range outputs {
		f, ok := v.(float64)
		if !ok || strings.HasPrefix(k, "_") {
			continue
		}
		if m == nil {
			m = map[string]float64{}
		}
		m[k] = f
	}
	return m
}
