package metrics

import (
	"context"
	"encoding/json"
	"errors"

	"time"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/temporal"
)

// Interceptor observes every activity the worker runs: its duration and
// outcome by step type, its retries, and, for a step that succeeded, its
// numeric outputs under its run; and hands m to the activity (From). Nil
// m gives an interceptor that does nothing.
func (m *Metrics) Interceptor() interceptor.WorkerInterceptor {
	return &workerInterceptor{m: m}
}

type workerInterceptor struct {
	interceptor.WorkerInterceptorBase
	m *Metrics
}

func (w *workerInterceptor) InterceptActivity(ctx context.Context, next interceptor.ActivityInboundInterceptor) interceptor.ActivityInboundInterceptor {
	i := &activityInterceptor{m: w.m}
	i.Next = next
	return i
}

type activityInterceptor struct {
	interceptor.ActivityInboundInterceptorBase
	m *Metrics
}

func (a *activityInterceptor) ExecuteActivity(ctx context.Context, in *interceptor.ExecuteActivityInput) (any, error) {
	m := a.m
	if m == nil {
		return a.Next.ExecuteActivity(ctx, in)
	}
	info := activity.GetInfo(ctx)
	stepType := info.ActivityType.Name
	if info.Attempt > 1 {
		m.stepRetries.WithLabelValues(stepType).Inc()
	}
	running := m.stepsRunning.WithLabelValues(stepType)
	running.Inc()
	start := time.Now()
	res, err := a.Next.ExecuteActivity(WithContext(ctx, m), in)
	running.Dec()
	outcome := Outcome(ctx, err)
	m.stepSeconds.WithLabelValues(stepType, outcome).Observe(time.Since(start).Seconds())
	if outcome == OutcomeFailed {
		m.stepFailures.WithLabelValues(stepType, ErrorType(err)).Inc()
	}
	if err == nil {
		if sc, ok := stepContext(in.Args); ok {
			m.recordOutputs(sc.Pipeline, sc.RunID, sc.StepID, sc.Iteration, numericOutputs(res))
		}
	}
	return res, err
}

// Outcome is the outcome label of an attempt that returned err.
func Outcome(ctx context.Context, err error) string {
	switch {
	case err == nil:
		return OutcomeSucceeded
	case errors.Is(err, context.Canceled) || temporal.IsCanceledError(err) || (ctx.Err() != nil && errors.Is(err, ctx.Err())):
		return OutcomeCanceled
	default:
		return OutcomeFailed
	}
}

// ErrorType is the error_type label of a failed attempt: the
// ApplicationError's type (one of pipelines.ErrorTypes for rlflow's own
// steps), or "timeout" and "unknown"; never the message, which is
// unbounded.
func ErrorType(err error) string {
	var app *temporal.ApplicationError
	switch {
	case errors.As(err, &app) && app.Type() != "":
		return app.Type()
	case errors.Is(err, context.DeadlineExceeded) || temporal.IsTimeoutError(err):
		return "timeout"
	default:
		return "unknown"
	}
}

// stepContext finds the pipelines.StepContext of a step's input: every
// step type's Input has it under "context"; other activities
// (load_pipeline, gpu_acquire) have none.
func stepContext(args []any) (pipelines.StepContext, bool) {
	if len(args) != 1 {
		return pipelines.StepContext{}, false
	}
	b, err := json.Marshal(args[0])
	if err != nil {
		return pipelines.StepContext{}, false
	}
	var in struct {
		Context *pipelines.StepContext `json:"context"`
	}
	if json.Unmarshal(b, &in) != nil || in.Context == nil || in.Context.RunID == "" || in.Context.StepID == "" {
		return pipelines.StepContext{}, false
	}
	return *in.Context, true
}

// numericOutputs are the top-level numeric and boolean (0, 1) values of a
// step's result as its outputs map renders it.
func numericOutputs(res any) map[string]float64 {
	b, err := json.Marshal(res)
	if err != nil {
		return nil
	}
	var out map[string]any
	if json.Unmarshal(b, &out) != nil {
		return nil
	}
	nums := make(map[string]float64, len(out))
	for k, v := range out {
		switch v := v.(type) {
		case float64:
			nums[k] = v
		case bool:
			nums[k] = map[bool]float64{false: 0, true: 1}[v]
		}
	}
	return nums
}
