package transfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/rlflow/rlflow/vllm"
)

// Kind says what a failure means for the step.
type Kind int

const (
	// BadInput: the request can never work (a checkpoint that is not one,
	// a dtype the backend cannot convert, no master address). A retry
	// would fail the same way.
	BadInput Kind = iota + 1
	// ServerFailed: a vLLM server failed, timed out or refused; the wrapped
	// error is a *vllm.Error or *vllm.FleetError, whose status says
	// whether a retry can help.
	ServerFailed
	// NCCLFailed: the NCCL group failed or was lost; the next attempt
	// re-initialises it.
	NCCLFailed
	// DeviceLost: this worker's GPU cannot serve the run any more (the
	// device cannot be opened, or it needs a reset); the step must move to
	// another GPU worker.
	DeviceLost
)

func (k Kind) String() string {
	switch k {
	case BadInput:
		return "bad input"
	case ServerFailed:
		return "server failed"
	case NCCLFailed:
		return "NCCL failed"
	case DeviceLost:
		return "device lost"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Error is every failure an Engine returns, except a context's end.
type Error struct {
	Kind Kind
	// Msg says what failed, without the cause.
	Msg string
	Err error
}

func (e *Error) Error() string {
	if e.Err == nil {
		return e.Msg
	}
	return e.Msg + ": " + e.Err.Error()
}

func (e *Error) Unwrap() error { return e.Err }

// Errorf returns an *Error of kind with cause err (nil for none).
func Errorf(kind Kind, err error, format string, args ...any) error {
	return &Error{Kind: kind, Msg: fmt.Sprintf(format, args...), Err: err}
}

// BadInputf is Errorf for a request that can never work.
func BadInputf(format string, args ...any) error {
	return &Error{Kind: BadInput, Msg: fmt.Sprintf(format, args...)}
}

// TransportErrorf types a failure of the transport: when ctx ended, an error
// wrapping ctx's (the step was cancelled or timed out, and says so); a
// vLLM server's failure is ServerFailed; anything else NCCLFailed.
func TransportErrorf(ctx context.Context, err error, format string, args ...any) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w (%w)", fmt.Sprintf(format, args...), ctx.Err(), err)
	}
	var ve *vllm.Error
	var fe *vllm.FleetError
	kind := NCCLFailed
	if errors.As(err, &ve) || errors.As(err, &fe) {
		kind = ServerFailed
	}
	return Errorf(kind, err, format, args...)
}
