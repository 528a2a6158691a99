package runs

import (
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/temporal"
)

// Failure is why a run or a step did not succeed, as the CLI says it: one
// sentence, and the failed step's log tail (exec steps) apart from it, so
// that the cause the tail holds is printed whole rather than cut at its
// first line.
type Failure struct {
	Sentence string `json:"sentence"`
	LogTail  string `json:"log_tail,omitempty"`
}

// String is the sentence, then the log tail as an indented block.
func (f Failure) String() string {
	if f.LogTail == "" {
		return f.Sentence
	}
	var b strings.Builder
	b.WriteString(f.Sentence)
	b.WriteString("\n  log tail:")
	for _, l := range strings.Split(f.LogTail, "\n") {
		b.WriteString("\n    ")
		b.WriteString(l)
	}
	return b.String()
}

// RunError is a run that closed without succeeding (failed, cancelled,
// terminated, timed out). Err is Temporal's error, for errors.As.
type RunError struct {
	WorkflowID string
	Failure    Failure
	Err        error
}

func (e *RunError) Error() string {
	return fmt.Sprintf("run %s: %s", e.WorkflowID, e.Failure)
}

func (e *RunError) Unwrap() error { return e.Err }

// logTailMark separates an exec step's message from its log tail (see
// activities/exec.go).
const logTailMark = "; log tail:\n"

// sdkAnnotation matches what the SDK's Error methods add to a message: an
// ApplicationError's " (type: T, retryable: B)", an ActivityError's or a
// child workflow's "(type: T, scheduledEventID: ...)" and the like. A step's
// error text is such an Error() string (the interpreter stores it), so the
// annotation sits after the log tail.
var sdkAnnotation = regexp.MustCompile(`\s*\(type: [^()]*\)`)

// sdkPrefix matches the wrapper messages of the SDK's error chain that say
// nothing of the cause: "workflow execution error", "activity error", ...
var sdkPrefix = regexp.MustCompile(`^(workflow execution error|child workflow execution error|activity error)(: )?`)

// clean strips the SDK's annotations and wrapper messages from s.
func clean(s string) string {
	s = sdkAnnotation.ReplaceAllString(s, "")
	for {
		t := sdkPrefix.ReplaceAllString(s, "")
		if t == s {
			break
		}
		s = t
	}
	return strings.TrimSpace(s)
}

// splitMessage cuts a failure message into its sentence and its log tail.
func splitMessage(msg string) Failure {
	head, tail, found := strings.Cut(msg, logTailMark)
	f := Failure{Sentence: clean(head)}
	if found {
		f.LogTail = strings.TrimRight(clean(tail), "\n")
	}
	return f
}

// ExplainError turns Temporal's error chain (a workflow execution error
// around a child workflow's, an activity's, an application error) into one
// sentence: the innermost message that says what happened, without the
// SDK's type names and event ids.
func ExplainError(err error) Failure {
	// The outermost error that says what happened wins: a timeout's
	// cause is its last failure, not the reason it ended.
	for e := err; e != nil; e = errors.Unwrap(e) {
		switch e := e.(type) {
		case *temporal.ApplicationError:
			msg := e.Message()
			if c := errors.Unwrap(e); c != nil {
				msg += ": " + ExplainError(c).String()
			}
			return splitMessage(msg)
		case *temporal.CanceledError:
			var why string
			if e.HasDetails() && e.Details(&why) == nil && why != "" {
				return Failure{Sentence: why}
			}
			return Failure{Sentence: "cancelled"}
		case *temporal.TimeoutError:
			f := Failure{Sentence: "timed out (" + timeoutName(e.TimeoutType().String()) + ")"}
			if c := errors.Unwrap(e); c != nil {
				last := ExplainError(c)
				f.Sentence += "; last failure: " + last.Sentence
				f.LogTail = last.LogTail
			}
			return f
		case *temporal.TerminatedError:
			return Failure{Sentence: "terminated"}
		case *temporal.PanicError:
			return Failure{Sentence: "the workflow panicked: " + e.Error()}
		}
	}
	return splitMessage(err.Error())
}

// timeoutName is a Temporal timeout type as words: "TimeoutTypeStartToClose"
// or "StartToClose" becomes "start-to-close timeout".
func timeoutName(t string) string {
	t = strings.TrimPrefix(t, "TimeoutType")
	var b strings.Builder
	for i, r := range t {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('-')
		}
		b.WriteRune(r)
	}
	return strings.ToLower(b.String()) + " timeout"
}

// StepFailure is a failed step's failure: "iteration 3: step train (exec)
// failed on attempt 2: <what happened>", and its log tail.
func StepFailure(iteration int, s workflows.StepResult) Failure {
	f := splitMessage(s.Error)
	on := ""
	if s.Attempts > 0 {
		on = fmt.Sprintf(" on attempt %d", s.Attempts)
	}
	prefix := fmt.Sprintf("step %s (%s) failed%s: ", s.ID, s.Uses, on)
	if iteration > 0 {
		prefix = fmt.Sprintf("iteration %d: %s", iteration, prefix)
	}
	f.Sentence = prefix + f.Sentence
	return f
}

// runFailure is why a closed run did not succeed: its failed step as the
// last status shows it (with the attempt), else Temporal's error.
func runFailure(st *RunStatus, err error) Failure {
	if st != nil && st.Execution != "Canceled" {
		for _, s := range st.Steps {
			if s.Status == workflows.StatusFailed {
				return StepFailure(st.Progress.Iteration, s.StepResult)
			}
		}
	}
	return ExplainError(err)
}
