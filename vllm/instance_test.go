package vllm_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
)

// metricsServer answers GET /metrics with status and body.
func metricsServer(t *testing.T, status int, body string) *vllm.Client {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" || r.Method != http.MethodGet {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(hs.Close)
	c, err := vllm.New(hs.URL, vllm.Options{Retry: vllm.RetryPolicy{Attempts: 1}})
	require.NoError(t, err)
	return c
}

func TestProcessStartTime(t *testing.T) {
	const help = "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\n"
	cases := []struct {
		name   string
		status int
		body   string
		want   float64
		ok     bool
		err    string
	}{
		{name: "prometheus_client", status: 200, body: "# HELP python_info x\npython_info{version=\"3.12\"} 1.0\n" + help +
			"process_start_time_seconds 1.73340012345e+09\nvllm:num_requests_running{model_name=\"m\"} 0.0\n", want: 1.73340012345e9, ok: true},
		{name: "labels and timestamp", status: 200, body: `process_start_time_seconds{pid="7"} 1733400000.5 1733400001000` + "\n", want: 1733400000.5, ok: true},
		{name: "longer name first", status: 200, body: "process_start_time_seconds_total 3\nprocess_start_time_seconds 12\n", want: 12, ok: true},
		{name: "absent (multiprocess mode)", status: 200, body: "# HELP vllm:num_requests_running x\nvllm:num_requests_running 0\n"},
		{name: "empty", status: 200, body: ""},
		{name: "not a number", status: 200, body: "process_start_time_seconds soon\n", err: `GET /metrics: HTTP 200: process_start_time_seconds: "soon" is not a start time in Unix seconds`},
		{name: "NaN", status: 200, body: "process_start_time_seconds NaN\n", err: `"NaN" is not a start time`},
		{name: "no value", status: 200, body: "process_start_time_seconds{a=\"b\"}\n", err: "want a value and an optional timestamp"},
		{name: "torn labels", status: 200, body: "process_start_time_seconds{a=\"b\" 3\n", err: "labels without a closing brace"},
		{name: "404", status: 404, body: `{"detail":"Not Found"}`, err: "GET /metrics: HTTP 404: Not Found"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cl := metricsServer(t, c.status, c.body)
			got, ok, err := cl.ProcessStartTime(context.Background())
			if c.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), cl.URL())
				assert.Contains(t, err.Error(), c.err)
				var e *vllm.Error
				require.True(t, errors.As(err, &e))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.ok, ok)
			assert.Equal(t, c.want, got)
		})
	}
}

// A restarted double (Kill, Close, New and Start on the same address) is
// a new process: another start time on the same URL.
func TestProcessStartTimeOfARestartedDouble(t *testing.T) {
	ctx := context.Background()
	for _, gen := range []double.Generation{double.GenB, double.GenD} {
		cfg := double.Config{Generation: gen, DevMode: true}
		d, err := double.New(cfg)
		require.NoError(t, err)
		run, err := d.Start("127.0.0.1:0")
		require.NoError(t, err)
		c, err := vllm.New(run.URL(), vllm.Options{Retry: vllm.RetryPolicy{Attempts: 1}})
		require.NoError(t, err)
		first, ok, err := c.ProcessStartTime(ctx)
		require.NoError(t, err)
		require.True(t, ok)
		assert.InDelta(t, float64(d.StartTime().UnixNano())/1e9, first, 1e-6)
		again, _, err := c.ProcessStartTime(ctx)
		require.NoError(t, err)
		assert.Equal(t, first, again, "the same process: the same start time")

		run.Kill()
		require.NoError(t, d.Close())
		_, _, err = c.ProcessStartTime(ctx)
		require.Error(t, err, "killed: nothing answers")
		time.Sleep(2 * time.Millisecond)
		d2, err := double.New(cfg)
		require.NoError(t, err)
		run2, err := d2.Start(run.Addr())
		require.NoError(t, err)
		second, ok, err := c.ProcessStartTime(ctx)
		require.NoError(t, err)
		require.True(t, ok)
		assert.Greater(t, second, first, "generation %s: a restart is a new start time", gen)
		run2.Kill()
		require.NoError(t, d2.Close())
	}
}

func TestUpdateOperationSeconds(t *testing.T) {
	const name = "vllm:rl_weight_update_operation_duration_seconds"
	cases := []struct {
		name string
		body string
		want map[string]float64
		err  string
	}{
		{name: "newest vLLM", body: "# TYPE " + name + " histogram\n" +
			name + `_bucket{model_name="m",operation="update",le="+Inf"} 2` + "\n" +
			name + `_sum{model_name="m",operation="update"} 1.5` + "\n" +
			name + `_count{model_name="m",operation="update"} 2` + "\n" +
			name + `_sum{model_name="m",operation="start"} 0.01` + "\n",
			want: map[string]float64{"update": 1.5, "start": 0.01}},
		{name: "summed over engines", body: name + `_sum{engine="0",operation="update"} 1` + "\n" + name + `_sum{engine="1",operation="update"} 2` + "\n",
			want: map[string]float64{"update": 3}},
		{name: "absent (older vLLM)", body: "process_start_time_seconds 12\n"},
		{name: "no operation label", body: name + `_sum{model_name="m"} 1` + "\n", err: "want an operation label and a value"},
		{name: "negative", body: name + `_sum{operation="update"} -1` + "\n", err: `"-1" is not a number of seconds`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cl := metricsServer(t, 200, c.body)
			got, ok, err := cl.UpdateOperationSeconds(context.Background())
			if c.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "GET /metrics")
				assert.Contains(t, err.Error(), c.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, c.want != nil, ok)
			assert.Equal(t, c.want, got)
		})
	}
}

// The vLLM double exports the histogram for the operations it served.
func TestDoubleExportsUpdateOperationSeconds(t *testing.T) {
	d, err := double.New(double.Config{DevMode: true, Generation: double.GenC, Backend: double.BackendNCCL})
	require.NoError(t, err)
	hs := httptest.NewServer(d.Handler())
	t.Cleanup(hs.Close)
	c, err := vllm.New(hs.URL, vllm.Options{Generation: vllm.GenC})
	require.NoError(t, err)
	ctx := context.Background()
	_, ok, err := c.UpdateOperationSeconds(ctx)
	require.NoError(t, err)
	assert.False(t, ok, "nothing served yet")
	require.NoError(t, c.StartUpdateSession(ctx, false))
	require.NoError(t, c.FinishWeightUpdate(ctx, "v1"))
	got, ok, err := c.UpdateOperationSeconds(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Contains(t, got, "start")
	assert.Contains(t, got, "finish")
}
