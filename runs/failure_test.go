package runs

import (
	"fmt"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	enumspb "go.temporal.io/api/enums/v1"
	failurepb "go.temporal.io/api/failure/v1"
	"go.temporal.io/sdk/temporal"
)

// execStepError is an exec step's error as the interpreter stores it: the
// activity's ApplicationError's Error(), the SDK's annotation after the
// log tail.
const execStepError = "exec: python exited with code 1 (log /runs/r1/1/train.log); log tail:\n" +
	"epoch 1\nTraceback (most recent call last):\nValueError: loss is nan\n (type: ExitError, retryable: true)"

// fromFailure is the error a client gets for a failure proto, as the SDK
// builds it from history.
func fromFailure(f *failurepb.Failure) error {
	return temporal.GetDefaultFailureConverter().FailureToError(f)
}

// The messages of failures, one sentence and the log tail: golden file
// testdata/failures.golden (newlines written as \n).
func TestExplainError(t *testing.T) {
	stepFailed := &failurepb.Failure{
		Message: "iteration 3: step train (exec) failed: " + execStepError,
		FailureInfo: &failurepb.Failure_ApplicationFailureInfo{ApplicationFailureInfo: &failurepb.ApplicationFailureInfo{
			Type: "StepFailed", NonRetryable: true,
		}},
	}
	childFailed := &failurepb.Failure{
		Message: "child workflow execution error",
		Cause:   stepFailed,
		FailureInfo: &failurepb.Failure_ChildWorkflowExecutionFailureInfo{ChildWorkflowExecutionFailureInfo: &failurepb.ChildWorkflowExecutionFailureInfo{
			WorkflowType: nil, InitiatedEventId: 5, StartedEventId: 6,
		}},
	}
	activityTimedOut := &failurepb.Failure{
		Message: "activity error",
		FailureInfo: &failurepb.Failure_ActivityFailureInfo{ActivityFailureInfo: &failurepb.ActivityFailureInfo{
			ScheduledEventId: 7, StartedEventId: 8, Identity: "worker@host",
		}},
		Cause: &failurepb.Failure{
			Message: "activity StartToClose timeout",
			FailureInfo: &failurepb.Failure_TimeoutFailureInfo{TimeoutFailureInfo: &failurepb.TimeoutFailureInfo{
				TimeoutType: enumspb.TIMEOUT_TYPE_START_TO_CLOSE,
			}},
			Cause: &failurepb.Failure{
				Message:     "vllm at http://127.0.0.1:8000 answered 503 on /v1/completions",
				FailureInfo: &failurepb.Failure_ApplicationFailureInfo{ApplicationFailureInfo: &failurepb.ApplicationFailureInfo{Type: "ServerError"}},
			},
		},
	}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"step failed in a child", fmt.Errorf("run: %w", fromFailure(childFailed))},
		{"bad input", temporal.NewNonRetryableApplicationError("params: lr: want a number, got \"x\"", "BadInput", nil)},
		{"cancelled with a reason", temporal.NewCanceledError("cancelled during iteration 2")},
		{"cancelled", temporal.NewCanceledError()},
		{"activity timed out", fromFailure(activityTimedOut)},
		{"terminated", fromFailure(&failurepb.Failure{Message: "terminated", FailureInfo: &failurepb.Failure_TerminatedFailureInfo{TerminatedFailureInfo: &failurepb.TerminatedFailureInfo{}}})},
		{"plain", fmt.Errorf("reading history: boom")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ExplainError(tc.err).String()
			assert.NotContains(t, got, "(type:", "no SDK type annotations")
			assert.NotContains(t, got, "EventID")
			checkGolden(t, "failures", tc.name, strings.ReplaceAll(got, "\n", `\n`))
		})
	}
}

func TestStepFailure(t *testing.T) {
	f := StepFailure(3, workflows.StepResult{ID: "train", Uses: "exec", Status: workflows.StatusFailed, Attempts: 3, Error: execStepError})
	assert.Equal(t, "iteration 3: step train (exec) failed on attempt 3: exec: python exited with code 1 (log /runs/r1/1/train.log)", f.Sentence)
	assert.Equal(t, "epoch 1\nTraceback (most recent call last):\nValueError: loss is nan", f.LogTail)
	assert.Equal(t, f.Sentence+"\n  log tail:\n    epoch 1\n    Traceback (most recent call last):\n    ValueError: loss is nan", f.String())

	noAttempt := StepFailure(0, workflows.StepResult{ID: "eval", Uses: "evaluate", Error: "evaluate: no server answered (type: ServerError, retryable: true)"})
	assert.Equal(t, Failure{Sentence: "step eval (evaluate) failed: evaluate: no server answered"}, noAttempt)
}

func TestFormatValue(t *testing.T) {
	for _, tc := range []struct {
		in   any
		want string
	}{
		{0.6000000000000001, "0.6"},
		{0.30000000000000004, "0.3"},
		{float64(3), "3"},
		{float64(1234567), "1234567"},
		{1234567.891, "1.23457e+06"},
		{0.000123456789, "0.000123457"},
		{-2.5, "-2.5"},
		{float32(0.1), "0.1"},
		{"a b", "a b"},
		{true, "true"},
		{nil, "null"},
		{[]any{1.0, "x"}, `[1,"x"]`},
		{map[string]any{"update": 0.00024675999999999995, "init": 0.0, "runs": []any{0.6000000000000001}}, `{"init":0,"runs":[0.6],"update":0.00024676}`},
	} {
		assert.Equal(t, tc.want, FormatValue(tc.in), "%#v", tc.in)
	}
}
