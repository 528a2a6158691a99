package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	sdkworker "go.temporal.io/sdk/worker"
)

// value is the gathered value of the series of name with exactly labels
// among its labels; ok is false where there is none. Histograms give
// their count.
func value(t *testing.T, m *Metrics, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	fams, err := m.Registry.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, s := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range s.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue series
				}
			}
			switch {
			case s.Counter != nil:
				return s.GetCounter().GetValue(), true
			case s.Gauge != nil:
				return s.GetGauge().GetValue(), true
			case s.Histogram != nil:
				return float64(s.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}

type stepInput struct {
	Context pipelines.StepContext `json:"context"`
	Fail    string                `json:"fail,omitempty"`
}

type stepOutput struct {
	Score       float64 `json:"score"`
	Initialized bool    `json:"initialized"`
	Path        string  `json:"path"`
	Attempt     int     `json:"_attempt"`
}

// runStep runs one activity named stepType through m's interceptor in the
// SDK's test environment.
func runStep(t *testing.T, m *Metrics, stepType string, in stepInput) error {
	t.Helper()
	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.SetWorkerOptions(sdkworker.Options{Interceptors: []interceptor.WorkerInterceptor{m.Interceptor()}})
	env.RegisterActivityWithOptions(func(ctx context.Context, in stepInput) (*stepOutput, error) {
		if From(ctx) != m {
			return nil, errors.New("the activity's context carries no metrics")
		}
		switch in.Fail {
		case "app":
			return nil, temporal.NewNonRetryableApplicationError("bad", pipelines.ErrTypeBadInput, nil)
		case "canceled":
			return nil, context.Canceled
		}
		return &stepOutput{Score: 0.75, Initialized: true, Path: "/x", Attempt: 1}, nil
	}, activity.RegisterOptions{Name: stepType})
	_, err := env.ExecuteActivity(stepType, in)
	return err
}

func TestInterceptorRecordsSteps(t *testing.T) {
	sc := pipelines.StepContext{Pipeline: "demo", RunID: "run-1", Iteration: 2, StepID: "eval"}
	tests := []struct {
		name, stepType, fail, outcome, errorType string
	}{
		{name: "succeeded", stepType: pipelines.StepEvaluate, outcome: OutcomeSucceeded},
		{name: "failed", stepType: pipelines.StepExec, fail: "app", outcome: OutcomeFailed, errorType: pipelines.ErrTypeBadInput},
		{name: "canceled", stepType: pipelines.StepGenerate, fail: "canceled", outcome: OutcomeCanceled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := New()
			err := runStep(t, m, tt.stepType, stepInput{Context: sc, Fail: tt.fail})
			assert.Equal(t, tt.fail == "", err == nil, "error: %v", err)
			n, ok := value(t, m, StepSeconds, map[string]string{"step_type": tt.stepType, "outcome": tt.outcome})
			assert.True(t, ok, "no %s series", StepSeconds)
			assert.Equal(t, 1.0, n)
			running, _ := value(t, m, StepsRunning, map[string]string{"step_type": tt.stepType})
			assert.Equal(t, 0.0, running, "a finished step is not running")
			failures, _ := value(t, m, StepFailures, map[string]string{"step_type": tt.stepType, "error_type": tt.errorType})
			assert.Equal(t, map[bool]float64{true: 1}[tt.errorType != ""], failures)
			score, ok := value(t, m, StepOutput, map[string]string{"pipeline": "demo", "run_id": "run-1", "step": "eval", "output": "score"})
			assert.Equal(t, tt.fail == "", ok, "outputs only of a step that succeeded")
			if ok {
				assert.Equal(t, 0.75, score)
				init, _ := value(t, m, StepOutput, map[string]string{"run_id": "run-1", "output": "initialized"})
				assert.Equal(t, 1.0, init, "a boolean output is 0 or 1")
				_, ok = value(t, m, StepOutput, map[string]string{"output": "_attempt"})
				assert.False(t, ok, "metadata keys are not outputs")
				_, ok = value(t, m, StepOutput, map[string]string{"output": "path"})
				assert.False(t, ok, "a string output is no gauge")
				it, _ := value(t, m, Iteration, map[string]string{"pipeline": "demo", "run_id": "run-1"})
				assert.Equal(t, 2.0, it)
			}
		})
	}
}

func TestInterceptorWithoutStepContext(t *testing.T) {
	m := New()
	require.NoError(t, runStep(t, m, "load_pipeline", stepInput{}))
	n, _ := value(t, m, StepSeconds, map[string]string{"step_type": "load_pipeline"})
	assert.Equal(t, 1.0, n)
	_, ok := value(t, m, StepOutput, nil)
	assert.False(t, ok, "no run, no output series")
}

func TestRunsAreBounded(t *testing.T) {
	m := New()
	for i := range MaxRuns + 1 {
		m.recordOutputs("demo", fmt.Sprintf("run-%d", i), "eval", 1, map[string]float64{"score": float64(i)})
	}
	_, ok := value(t, m, StepOutput, map[string]string{"run_id": "run-0"})
	assert.False(t, ok, "the oldest run's series go")
	_, ok = value(t, m, Iteration, map[string]string{"run_id": "run-0"})
	assert.False(t, ok)
	v, ok := value(t, m, StepOutput, map[string]string{"run_id": fmt.Sprintf("run-%d", MaxRuns)})
	assert.True(t, ok)
	assert.Equal(t, float64(MaxRuns), v)
	// A run seen again is the newest, not evicted next.
	m.recordOutputs("demo", "run-1", "eval", 2, map[string]float64{"score": 1})
	m.recordOutputs("demo", "run-new", "eval", 1, map[string]float64{"score": 1})
	_, ok = value(t, m, StepOutput, map[string]string{"run_id": "run-1"})
	assert.True(t, ok)
	_, ok = value(t, m, StepOutput, map[string]string{"run_id": "run-2"})
	assert.False(t, ok)
}

func TestRecorders(t *testing.T) {
	m := New()
	m.ObserveSync("disk", PhaseUpdate, 2, 4e9)
	m.ObserveSync("disk", PhaseInit, 0.5, 0)
	m.ObserveServerSync("update", 1.5)
	m.ObserveGenerate("demo", 1000, 250)
	m.SetPaused([]string{"http://user:secret@vllm:8000", "http://b:8000"}, true)
	m.SetPaused([]string{"http://b:8000"}, false)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{SyncSeconds, map[string]string{"backend": "disk", "phase": PhaseUpdate}, 1},
		{SyncSeconds, map[string]string{"backend": "disk", "phase": PhaseInit}, 1},
		{SyncBytesPerSecond, map[string]string{"backend": "disk", "phase": PhaseUpdate}, 2e9},
		{SyncBytes, map[string]string{"backend": "disk"}, 4e9},
		{SyncServerSeconds, map[string]string{"operation": "update"}, 1},
		{GenerateTokensPerS, map[string]string{"pipeline": "demo"}, 250},
		{GenerateTokens, map[string]string{"pipeline": "demo"}, 1000},
		{ServerPaused, map[string]string{"server": "http://vllm:8000"}, 1},
		{ServerPaused, map[string]string{"server": "http://b:8000"}, 0},
	} {
		got, ok := value(t, m, c.name, c.labels)
		assert.True(t, ok, "%s %v missing", c.name, c.labels)
		assert.Equal(t, c.want, got, "%s %v", c.name, c.labels)
	}
	_, ok := value(t, m, SyncBytesPerSecond, map[string]string{"phase": PhaseInit})
	assert.False(t, ok, "no rate without bytes")

	var none *Metrics // recording into no registry does nothing
	none.ObserveSync("disk", PhaseUpdate, 1, 1)
	none.ObserveServerSync("update", 1)
	none.ObserveGenerate("demo", 1, 1)
	none.SetPaused([]string{"http://a"}, true)
	assert.Nil(t, From(context.Background()))
}

func TestNamesAreRlflows(t *testing.T) {
	names := New().Names()
	assert.Len(t, names, 13)
	for _, n := range names {
		assert.True(t, strings.HasPrefix(n, "rlflow_"), n)
	}
}

func TestSDKHandler(t *testing.T) {
	m := New()
	h := m.SDKHandler().WithTags(map[string]string{"namespace": "default"})
	h.Counter("temporal_request").Inc(2)
	h.WithTags(map[string]string{"operation": "Poll"}).Counter("temporal_request").Inc(3)
	h.Counter("temporal_request").Inc(-1) // ignored: counters never go down
	h.Gauge("temporal_num_pollers").Update(4)
	h.Timer("temporal_request_latency").Record(20 * time.Millisecond)

	v, _ := value(t, m, "temporal_request", map[string]string{"namespace": "default", "operation": ""})
	assert.Equal(t, 2.0, v)
	v, _ = value(t, m, "temporal_request", map[string]string{"namespace": "default", "operation": "Poll"})
	assert.Equal(t, 3.0, v)
	v, _ = value(t, m, "temporal_num_pollers", nil)
	assert.Equal(t, 4.0, v)
	v, _ = value(t, m, "temporal_request_latency", nil)
	assert.Equal(t, 1.0, v)

	var none *Metrics
	none.SDKHandler().Counter("x").Inc(1)
}

func TestServe(t *testing.T) {
	m := New()
	m.ObserveSync("disk", PhaseUpdate, 1, 100)
	s, err := m.Serve("127.0.0.1:0", nil)
	require.NoError(t, err)
	defer s.Close()
	resp, err := http.Get(s.URL())
	require.NoError(t, err)
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(body), `rlflow_sync_duration_seconds_count{backend="disk",phase="update"} 1`)

	_, err = New().Serve(s.Addr, nil)
	assert.ErrorContains(t, err, "metrics: listening on "+s.Addr)
}
