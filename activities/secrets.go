package activities

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"

	"github.com/rlflow/rlflow/redact"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/temporal"
)

// The worker's secrets are every value it read to use as one: each
// server's and scorer's api_key_env key (fleet.go) and each secret an exec
// step requested by name (execenv.go). They live in Activities.secrets, a
// redact.Masker, from the moment they are read until the worker exits, and
// are masked in everything the activities hand Temporal: errors built by
// stepError (message and cause), exec's log tails and outputs, and, through
// Interceptor, any error, result or heartbeat detail that still holds one.

// maskerKey carries the worker's masker in an activity's context, where
// stepError, which has no Activities, finds it.
type maskerKey struct{}

func withMasker(ctx context.Context, m *redact.Masker) context.Context {
	if maskerOf(ctx) == m {
		return ctx
	}
	return context.WithValue(ctx, maskerKey{}, m)
}

// maskerOf is the context's masker; nil (which masks nothing) outside an
// activity run through Interceptor or exec.
func maskerOf(ctx context.Context) *redact.Masker {
	m, _ := ctx.Value(maskerKey{}).(*redact.Masker)
	return m
}

// maskedError stands for an error whose text held a secret: its text
// masked, and no cause, since every level of the chain repeats the secret
// (Temporal records each level's text).
type maskedError struct{ msg string }

func (e *maskedError) Error() string { return e.msg }

// chainHolds reports whether err or any error it wraps has a secret in
// its text.
func chainHolds(m *redact.Masker, err error) bool {
	if m.Len() == 0 {
		return false
	}
	for ; err != nil; err = errors.Unwrap(err) {
		if m.Contains(err.Error()) {
			return true
		}
	}
	return false
}

// maskCause returns err itself unless its chain holds a secret, then a
// maskedError of its masked text: errors.As on a cause keeps working
// whenever there is nothing to hide.
func maskCause(m *redact.Masker, err error) error {
	if !chainHolds(m, err) {
		return err
	}
	return &maskedError{msg: m.Mask(err.Error())}
}

// maskReturned is the last check on an activity's error: one that still
// holds a secret (built without stepError) is rebuilt with its text masked,
// keeping its ApplicationError type, retryability and details. Context
// errors and Temporal's cancellation are left as they are: the SDK reports
// them by their type, and their text is Go's.
func maskReturned(ctx context.Context, m *redact.Masker, err error) error {
	if !chainHolds(m, err) {
		return err
	}
	var canceled *temporal.CanceledError
	if errors.As(err, &canceled) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	var app *temporal.ApplicationError
	if !errors.As(err, &app) {
		return &maskedError{msg: m.Mask(err.Error())}
	}
	details := applicationDetails(app)
	for i, d := range details {
		details[i] = maskValue(m, d)
	}
	return temporal.NewApplicationErrorWithOptions(m.Mask(app.Message()), app.Type(), temporal.ApplicationErrorOptions{
		NonRetryable:   app.NonRetryable(),
		Cause:          maskCause(m, app.Unwrap()),
		Details:        details,
		NextRetryDelay: app.NextRetryDelay(),
		Category:       app.Category(),
	})
}

// maxDetails bounds the details applicationDetails looks for; rlflow's
// errors carry at most two.
const maxDetails = 8

// applicationDetails returns an ApplicationError's details as values. The
// SDK tells their number only by refusing to fill more pointers than there
// are values, so it asks for maxDetails, then fewer. (It panics filling a
// pointer with a nil detail: such details are dropped.)
func applicationDetails(app *temporal.ApplicationError) (details []any) {
	if !app.HasDetails() {
		return nil
	}
	defer func() {
		if recover() != nil {
			details = nil
		}
	}()
	for n := maxDetails; n > 0; n-- {
		vals := make([]any, n)
		ptrs := make([]any, n)
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if app.Details(ptrs...) == nil {
			return vals
		}
	}
	return nil
}

// maskValue returns v unchanged unless its JSON holds a secret; then v's
// JSON decoded to plain values (maps, lists, strings, json.Number) with
// every secret masked in keys and strings, and a number holding one made
// a masked string. Temporal encodes the result as JSON, so the workflow
// decodes it as it would have decoded v.
func maskValue(m *redact.Masker, v any) any {
	if v == nil || m.Len() == 0 {
		return v
	}
	b, err := json.Marshal(v)
	if err != nil || !m.Contains(string(b)) {
		return v // a value JSON cannot encode fails in the SDK's converter, as it would have
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var plain any
	if dec.Decode(&plain) != nil {
		return redact.Mask
	}
	return maskPlain(m, plain)
}

func maskPlain(m *redact.Masker, v any) any {
	switch x := v.(type) {
	case string:
		return m.Mask(x)
	case json.Number:
		if m.Contains(x.String()) {
			return m.Mask(x.String())
		}
		return x
	case []any:
		for i := range x {
			x[i] = maskPlain(m, x[i])
		}
		return x
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[m.Mask(k)] = maskPlain(m, e)
		}
		return out
	}
	return v
}

// Interceptor returns the worker interceptor that every Temporal worker
// running these activities installs (worker.Options.Interceptors): it
// gives each activity's context the worker's masker, so stepError masks,
// and masks what the activity returns (its error and result) and the
// details it heartbeats, as the last check before they reach history.
func (a *Activities) Interceptor() interceptor.WorkerInterceptor {
	return &maskingInterceptor{m: a.secrets}
}

type maskingInterceptor struct {
	interceptor.WorkerInterceptorBase
	m *redact.Masker
}

func (i *maskingInterceptor) InterceptActivity(ctx context.Context, next interceptor.ActivityInboundInterceptor) interceptor.ActivityInboundInterceptor {
	in := &maskingInbound{m: i.m}
	in.Next = next
	return in
}

type maskingInbound struct {
	interceptor.ActivityInboundInterceptorBase
	m *redact.Masker
}

func (i *maskingInbound) Init(outbound interceptor.ActivityOutboundInterceptor) error {
	out := &maskingOutbound{m: i.m}
	out.Next = outbound
	return i.Next.Init(out)
}

func (i *maskingInbound) ExecuteActivity(ctx context.Context, in *interceptor.ExecuteActivityInput) (any, error) {
	ctx = withMasker(ctx, i.m)
	res, err := i.Next.ExecuteActivity(ctx, in)
	return maskValue(i.m, res), maskReturned(ctx, i.m, err)
}

type maskingOutbound struct {
	interceptor.ActivityOutboundInterceptorBase
	m *redact.Masker
}

func (o *maskingOutbound) RecordHeartbeat(ctx context.Context, details ...any) {
	for j, d := range details {
		details[j] = maskValue(o.m, d)
	}
	o.Next.RecordHeartbeat(ctx, details...)
}
