package activities

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/redact"
)

// stepError masks the worker's secrets in its message and its cause; a
// cause without one stays itself, so errors.As still finds it.
func TestStepErrorMasks(t *testing.T) {
	a := newSecretActivities(t, ExecEnvMinimal)
	key, err := a.apiKey("OPENAI_API_KEY")
	require.NoError(t, err)
	require.Equal(t, serverKey, key)
	ctx := withMasker(context.Background(), a.secrets)

	err = stepError(ctx, pipelines.ErrTypeServerError, fmt.Errorf("POST /v1/completions: %w", errors.New("401: bad key "+key)), "generate: servers[0] with key %s", key)
	assert.Equal(t, "generate: servers[0] with key *** (type: ServerError, retryable: true): POST /v1/completions: 401: bad key ***", err.Error())
	assert.NotContains(t, err.Error(), serverKey)

	err = stepError(ctx, pipelines.ErrTypeServerError, fmt.Errorf("wrapped: %w", &testCause{}), "generate")
	var tc *testCause
	assert.ErrorAs(t, err, &tc, "a cause without a secret is kept")

	// Without the masker in the context (a caller outside the worker),
	// nothing is masked: the exec and interceptor paths always set it.
	assert.Contains(t, stepError(context.Background(), pipelines.ErrTypeIO, nil, "%s", key).Error(), serverKey)
}

type testCause struct{}

func (c *testCause) Error() string { return "test cause" }

// leakyActivities build their errors, results and heartbeats without
// stepError, holding the worker's secrets: the interceptor masks them all.
type leakyActivities struct{ a *Activities }

func (l leakyActivities) Plain(ctx context.Context) (string, error) {
	key, _ := l.a.apiKey("OPENAI_API_KEY")
	return "", fmt.Errorf("dial with key %s: %w", key, errors.New("refused"))
}

func (l leakyActivities) Typed(ctx context.Context) (string, error) {
	key, _ := l.a.apiKey("OPENAI_API_KEY")
	activity.RecordHeartbeat(ctx, map[string]string{"progress": "sent " + key})
	return "", temporal.NewApplicationErrorWithOptions("server said "+key, pipelines.ErrTypeServerRejected, temporal.ApplicationErrorOptions{
		NonRetryable: true,
		Details:      []any{pipelines.AttemptDetail{Attempt: 3}, map[string]string{"echo": key}},
	})
}

func (l leakyActivities) Result(ctx context.Context) (map[string]any, error) {
	key, _ := l.a.apiKey("OPENAI_API_KEY")
	return map[string]any{"url": "http://h/?k=" + key, "n": 3, key: "as a key"}, nil
}

func (l leakyActivities) Clean(ctx context.Context) (map[string]any, error) {
	return map[string]any{"n": 3}, errors.New("nothing secret")
}

func TestInterceptorMasksWhatActivitiesReturn(t *testing.T) {
	a := newSecretActivities(t, ExecEnvMinimal)
	l := leakyActivities{a}
	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.SetWorkerOptions(worker.Options{Interceptors: []interceptor.WorkerInterceptor{a.Interceptor()}})
	var beats []string
	env.SetOnActivityHeartbeatListener(func(_ *activity.Info, details converter.EncodedValues) {
		var m map[string]string
		if details.Get(&m) == nil {
			beats = append(beats, m["progress"])
		}
	})
	env.RegisterActivityWithOptions(l.Plain, activity.RegisterOptions{Name: "plain"})
	env.RegisterActivityWithOptions(l.Typed, activity.RegisterOptions{Name: "typed"})
	env.RegisterActivityWithOptions(l.Result, activity.RegisterOptions{Name: "result"})
	env.RegisterActivityWithOptions(l.Clean, activity.RegisterOptions{Name: "clean"})

	_, err := env.ExecuteActivity("plain")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "dial with key ***: refused")
	assert.NotContains(t, err.Error(), serverKey)

	_, err = env.ExecuteActivity("typed")
	require.Error(t, err)
	assert.NotContains(t, err.Error(), serverKey)
	var app *temporal.ApplicationError
	require.ErrorAs(t, err, &app)
	assert.Equal(t, "server said ***", app.Message())
	assert.Equal(t, pipelines.ErrTypeServerRejected, app.Type())
	assert.True(t, app.NonRetryable())
	var detail pipelines.AttemptDetail
	var echo map[string]string
	require.NoError(t, app.Details(&detail, &echo))
	assert.Equal(t, 3, detail.Attempt, "details survive the rebuild")
	assert.Equal(t, map[string]string{"echo": redact.Mask}, echo)
	assert.Equal(t, []string{"sent ***"}, beats)

	val, err := env.ExecuteActivity("result")
	require.NoError(t, err)
	var out map[string]any
	require.NoError(t, val.Get(&out))
	assert.Equal(t, map[string]any{"url": "http://h/?k=***", "n": 3.0, redact.Mask: "as a key"}, out)

	_, err = env.ExecuteActivity("clean")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "nothing secret")
}

func TestMaskValue(t *testing.T) {
	m := redact.New()
	m.Add("1234567890")
	m.Add("secret-value")
	for _, tc := range []struct {
		name string
		in   any
		want any
	}{
		{"nil", nil, nil},
		{"untouched struct", pipelines.AttemptDetail{Attempt: 2}, pipelines.AttemptDetail{Attempt: 2}},
		{"string", "a secret-value b", "a *** b"},
		{"number", 1234567890, "***"},
		{"nested", map[string]any{"l": []any{"x", "secret-value"}, "m": map[string]any{"secret-value": 1}},
			map[string]any{"l": []any{"x", "***"}, "m": map[string]any{"***": json.Number("1")}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, maskValue(m, tc.in))
		})
	}
}
