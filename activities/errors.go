package activities

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/temporal"
)

// stepError builds the ApplicationError an activity returns: typed from
// pipelines.ErrorTypes (a non-retryable type fails the step whatever its
// retry policy), with the attempt as its detail so the interpreter can
// report it. The message says which step and which call failed and never
// repeats the cause: the error's text is the message, then the cause. Every
// secret the worker knows (the context's masker, secrets.go) is masked in
// the message and the cause.
func stepError(ctx context.Context, errType string, cause error, format string, args ...any) error {
	m := maskerOf(ctx)
	return temporal.NewApplicationErrorWithOptions(m.Mask(fmt.Sprintf(format, args...)), errType, temporal.ApplicationErrorOptions{
		NonRetryable: pipelines.IsNonRetryable(errType),
		Cause:        maskCause(m, cause),
		Details:      []any{pipelines.AttemptDetail{Attempt: attemptOf(ctx)}},
	})
}

// staleWeightsError is the StaleWeights error: its second detail names the
// servers, so the interpreter re-syncs exactly those.
func staleWeightsError(ctx context.Context, stale pipelines.StaleServers, format string, args ...any) error {
	return temporal.NewApplicationErrorWithOptions(maskerOf(ctx).Mask(fmt.Sprintf(format, args...)), pipelines.ErrTypeStaleWeights, temporal.ApplicationErrorOptions{
		Details: []any{pipelines.AttemptDetail{Attempt: attemptOf(ctx)}, stale},
	})
}

// badInput is the error for arguments that can never work.
func badInput(ctx context.Context, format string, args ...any) error {
	return stepError(ctx, pipelines.ErrTypeBadInput, nil, format, args...)
}

// resolveArgs fills in the step's unset arguments with the registry's
// defaults and checks the rest against the registry's ranges: the rules
// `rlflow validate` applies to literal values, applied here to what the
// expressions rendered.
func resolveArgs(ctx context.Context, step string, in any) error {
	if err := pipelines.ResolveArgs(step, in); err != nil {
		return badInput(ctx, "%s: %v", step, err)
	}
	return nil
}

// IsType reports whether err is an ApplicationError of the given type.
func IsType(err error, errType string) bool {
	var app *temporal.ApplicationError
	return errors.As(err, &app) && app.Type() == errType
}

// serverError types a vllm error: retryable unless the server (or the
// client, before sending) refused the request for good. When the step's own
// context ended, that is the error, so Temporal sees a cancel or timeout.
func serverError(ctx context.Context, err error, format string, args ...any) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return stepError(ctx, classify(err), err, format, args...)
}

// classify returns ErrTypeServerRejected when err is final: every failed
// server of a FleetError refused for good, or the one vllm.Error did.
func classify(err error) string {
	var fe *vllm.FleetError
	if errors.As(err, &fe) {
		for _, f := range fe.Failed {
			if classify(f.Err) != pipelines.ErrTypeServerRejected {
				return pipelines.ErrTypeServerError
			}
		}
		if len(fe.Failed) > 0 {
			return pipelines.ErrTypeServerRejected
		}
		return pipelines.ErrTypeServerError
	}
	var e *vllm.Error
	if !errors.As(err, &e) {
		return pipelines.ErrTypeServerError
	}
	if final(e.Status, e.Err) {
		return pipelines.ErrTypeServerRejected
	}
	return pipelines.ErrTypeServerError
}

// final reports whether an HTTP outcome can never change on a retry: a 4xx
// other than timeouts, conflicts and rate limits, or a request the client
// refused to send (no status, no transport error).
func final(status int, transportErr error) bool {
	switch {
	case status == 0:
		return transportErr == nil
	case status == http.StatusRequestTimeout, status == http.StatusConflict,
		status == http.StatusTooEarly, status == http.StatusTooManyRequests:
		return false
	}
	return status >= 400 && status < 500
}

// notAvailable reports whether err says the server has no such route (404:
// an older vLLM, or dev mode off) or its API generation lacks the call.
func notAvailable(err error) bool {
	var e *vllm.Error
	return errors.As(err, &e) && (e.Status == http.StatusNotFound || (e.Status == 0 && e.Err == nil))
}

// transferError types a weight-transfer engine's failure by its
// transfer.Kind; a step whose context ended gets the engine's error as is,
// so Temporal reports the cancellation or timeout.
func transferError(ctx context.Context, step string, err error) error {
	if ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return err
	}
	var te *transfer.Error
	if !errors.As(err, &te) {
		return serverError(ctx, err, "%s", step)
	}
	switch te.Kind {
	case transfer.BadInput:
		return stepError(ctx, pipelines.ErrTypeBadInput, te.Err, "%s: %s", step, te.Msg)
	case transfer.ServerFailed:
		return stepError(ctx, classify(te.Err), te.Err, "%s: %s", step, te.Msg)
	case transfer.DeviceLost:
		return stepError(ctx, pipelines.ErrTypeGPUWorkerLost, te.Err, "%s: %s", step, te.Msg)
	}
	return stepError(ctx, pipelines.ErrTypeNCCL, te.Err, "%s: %s", step, te.Msg)
}
