// Package activities implements rlflow's step types as Temporal activities,
// registered under the step type's name (pipelines.Step.Uses).
//
// Invariants: each activity takes one Input struct (the rendered `with`
// values plus the pipelines.StepContext under "context") and returns one
// Output struct whose JSON keys are the step's outputs; keys starting with
// "_" are metadata and never outputs. Errors are ApplicationErrors typed with
// the ErrType* constants below; the non-retryable ones fail a step at once
// whatever its retry policy. Dependencies (paths, clocks, environment) come
// in through the Deps struct, never from globals.
package activities

import (
	"context"
	"errors"
	"fmt"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
)

// Error types. Non-retryable ones describe failures a retry cannot fix.
const (
	ErrTypeBadInput        = "BadInput"        // non-retryable: the step's arguments are wrong
	ErrTypeCommandNotFound = "CommandNotFound" // non-retryable: exec's program does not exist
	ErrTypeOutputMissing   = "OutputMissing"   // non-retryable: a declared output was not written
	ErrTypeExit            = "ExitError"       // retryable: exec's command exited non-zero
	ErrTypeSignal          = "Signaled"        // retryable: exec's command was killed by a signal
	ErrTypeIO              = "IOError"         // retryable: local file or process trouble
	// ErrTypeServerError: a vLLM server (or an http scorer) failed, timed
	// out, or could not be reached: a 5xx, 408, 409, 425, 429 or a transport
	// error. Retryable: a retried generate resumes where it stopped.
	ErrTypeServerError = "ServerError"
	// ErrTypeServerRejected: a server refused the request for good (400,
	// 401, 403, 404, 405, 422, ...: a prompt over the context length, a
	// wrong API key, dev-mode routes missing), or the client refused to send
	// it (a payload the server's API generation cannot take). Non-retryable.
	ErrTypeServerRejected = "ServerRejected"
	// ErrTypeNoGPUWorker: an nccl transfer step reached a worker without
	// the NCCL weight path (start the worker with `rlflow worker --gpu`).
	// Non-retryable: the retry would land on the same task queue.
	ErrTypeNoGPUWorker = "NoGPUWorker"
)

// NonRetryable lists the error types every step treats as final.
var NonRetryable = []string{ErrTypeBadInput, ErrTypeCommandNotFound, ErrTypeOutputMissing, ErrTypeServerRejected, ErrTypeNoGPUWorker}

func isNonRetryable(errType string) bool {
	for _, t := range NonRetryable {
		if t == errType {
			return true
		}
	}
	return false
}

// stepError builds the ApplicationError an activity returns: typed, with the
// attempt as its detail so the interpreter can report it.
func stepError(ctx context.Context, errType string, cause error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	attempt := 0
	if activity.IsActivity(ctx) {
		attempt = int(activity.GetInfo(ctx).Attempt)
	}
	return temporal.NewApplicationErrorWithOptions(msg, errType, temporal.ApplicationErrorOptions{
		NonRetryable: isNonRetryable(errType),
		Cause:        cause,
		Details:      []any{pipelines.AttemptDetail{Attempt: attempt}},
	})
}

// badInput is the error for arguments that can never work.
func badInput(ctx context.Context, format string, args ...any) error {
	return stepError(ctx, ErrTypeBadInput, nil, format, args...)
}

// IsType reports whether err is an ApplicationError of the given type.
func IsType(err error, errType string) bool {
	var app *temporal.ApplicationError
	return errors.As(err, &app) && app.Type() == errType
}
