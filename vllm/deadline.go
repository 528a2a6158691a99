package vllm

import (
	"context"
	"fmt"
	"time"
)

// MaxReportMargin bounds the time a call leaves before its caller's
// deadline: a call whose own timeout would outlast the caller's deadline
// (an activity's StartToClose) gives up that much earlier, so its error,
// which names the server and the route, still reaches Temporal instead of
// a bare timeout that names neither. The margin is a tenth of the time
// left, at most this.
const MaxReportMargin = 2 * time.Second

// ErrStepDeadline is the cause of a call that stopped because its caller's
// deadline was near (it is a context.DeadlineExceeded): retrying it would
// only run into that deadline.
var ErrStepDeadline = fmt.Errorf("stopped before the caller's deadline: %w", context.DeadlineExceeded)

// callBudget is one call's deadline: its own timeout, or the caller's
// deadline less the report margin when that comes first.
type callBudget struct {
	timeout time.Duration
	byStep  bool // the caller's deadline, not the call's own timeout, set it
	own     time.Duration
	ownName string // the Timeouts field of the call's own timeout
}

func budgetFor(ctx context.Context, own time.Duration, ownName string) callBudget {
	b := callBudget{timeout: own, own: own, ownName: ownName}
	if d, ok := ctx.Deadline(); ok {
		left := time.Until(d)
		if cut := left - min(left/10, MaxReportMargin); cut < own {
			b.timeout, b.byStep = max(cut, time.Millisecond), true
		}
	}
	return b
}

// cause is the error a call that ran out of its budget wraps.
func (b callBudget) cause() error {
	if b.byStep {
		return ErrStepDeadline
	}
	return context.DeadlineExceeded
}

// expired says why a call that ran out of time stopped.
func (b callBudget) expired() string {
	if b.byStep {
		return fmt.Sprintf("no answer within %v, the time the step's deadline left it (its own timeout, Timeouts.%s, is %v)",
			b.timeout.Round(time.Millisecond), b.ownName, b.own)
	}
	return fmt.Sprintf("no answer within %v (Timeouts.%s)", b.own, b.ownName)
}
