// Package metrics is what an rlflow worker exports to Prometheus: rlflow's
// own figures (step durations and outcomes by step type, retries, weight
// sync seconds and bytes per second by phase, generate tokens per second,
// paused servers, the numeric outputs of recent runs' steps) and the
// Temporal SDK's, all in one registry served on one address.
//
// Invariants: every rlflow metric is named rlflow_* and defined once, in
// New's table (Names lists that table, so the Grafana dashboard's test
// checks its queries against the same source); label values are bounded
// (step types, error types, phases, server URLs, the most recent MaxRuns
// runs); recording through a nil *Metrics does nothing, so activities run
// without a worker's registry (tests, other hosts) unchanged.
package metrics

import (
	"context"
	"net/url"
	"sort"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Names of rlflow's metrics: the dashboard and the tests refer to these.
const (
	StepSeconds        = "rlflow_step_duration_seconds"
	StepFailures       = "rlflow_step_failures_total"
	StepRetries        = "rlflow_step_retries_total"
	StepsRunning       = "rlflow_steps_running"
	StepOutput         = "rlflow_step_output"
	Iteration          = "rlflow_iteration"
	SyncSeconds        = "rlflow_sync_duration_seconds"
	SyncBytesPerSecond = "rlflow_sync_bytes_per_second"
	SyncBytes          = "rlflow_sync_bytes_total"
	SyncServerSeconds  = "rlflow_sync_server_duration_seconds"
	GenerateTokensPerS = "rlflow_generate_tokens_per_second"
	GenerateTokens     = "rlflow_generate_tokens_total"
	ServerPaused       = "rlflow_server_paused"
)

// Outcomes of a step attempt (the outcome label).
const (
	OutcomeSucceeded = "succeeded"
	OutcomeFailed    = "failed"
	OutcomeCanceled  = "canceled"
)

// Phases of a weight sync (the phase label): init sets up the transfer
// group (init_transfer, or the init a broadcast needed first), update
// moves the weights.
const (
	PhaseInit   = "init"
	PhaseUpdate = "update"
)

// MaxRuns bounds the runs whose step outputs and iteration a worker
// exports: the oldest run's series go when a newer one arrives, so a
// long-lived worker's series do not grow without end.
const MaxRuns = 16

// durationBuckets span a noop step (milliseconds) to a long trainer run
// (hours).
var durationBuckets = []float64{0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200}

// Metrics are a worker's metrics; the zero of *Metrics (nil) records
// nothing.
type Metrics struct {
	// Registry holds rlflow's metrics, the Go and process collectors and
	// (through SDKHandler) the Temporal SDK's.
	Registry *prometheus.Registry

	names []string

	stepSeconds   *prometheus.HistogramVec
	stepFailures  *prometheus.CounterVec
	stepRetries   *prometheus.CounterVec
	stepsRunning  *prometheus.GaugeVec
	stepOutput    *prometheus.GaugeVec
	iteration     *prometheus.GaugeVec
	syncSeconds   *prometheus.HistogramVec
	syncBps       *prometheus.GaugeVec
	syncBytes     *prometheus.CounterVec
	syncServer    *prometheus.HistogramVec
	genTokensPerS *prometheus.GaugeVec
	genTokens     *prometheus.CounterVec
	serverPaused  *prometheus.GaugeVec
	sdk           *sdkCollector
	runsMu        sync.Mutex
	runs          []string // run ids with series, oldest first
}

// New returns a worker's metrics in a registry of their own.
func New() *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry(), sdk: newSDKCollector()}
	hist := func(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		v := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
		m.register(name, v)
		return v
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
		m.register(name, v)
		return v
	}
	gauge := func(name, help string, labels ...string) *prometheus.GaugeVec {
		v := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
		m.register(name, v)
		return v
	}
	m.stepSeconds = hist(StepSeconds, "Duration of step attempts (activities) on this worker, by step type and outcome (succeeded, failed, canceled).",
		durationBuckets, "step_type", "outcome")
	m.stepFailures = counter(StepFailures, "Failed step attempts by step type and error type (pipelines.ErrorTypes; the Go error's kind otherwise).",
		"step_type", "error_type")
	m.stepRetries = counter(StepRetries, "Step attempts after the first (Temporal retries) started on this worker, by step type.", "step_type")
	m.stepsRunning = gauge(StepsRunning, "Step attempts running on this worker now, by step type.", "step_type")
	m.stepOutput = gauge(StepOutput, "The last numeric outputs of steps that succeeded on this worker (eval score, train reward and loss, sync seconds), by pipeline, run, step id and output key; the most recent runs only.",
		"pipeline", "run_id", "step", "output")
	m.iteration = gauge(Iteration, "The loop iteration of the last step of a run that ran on this worker; the most recent runs only.", "pipeline", "run_id")
	m.syncSeconds = hist(SyncSeconds, "Weight sync time measured by the trainer side, by backend and phase (init, update).",
		durationBuckets, "backend", "phase")
	m.syncBps = gauge(SyncBytesPerSecond, "Bytes per second of the last weight update, by backend and phase.", "backend", "phase")
	m.syncBytes = counter(SyncBytes, "Bytes of weights moved by weight updates, by backend.", "backend")
	m.syncServer = hist(SyncServerSeconds, "Weight update time as the vLLM servers report it (vllm:rl_weight_update_operation_duration_seconds), per update and server, by operation (init, start, update, finish).",
		durationBuckets, "operation")
	m.genTokensPerS = gauge(GenerateTokensPerS, "Completion tokens per second of the last generate step, by pipeline.", "pipeline")
	m.genTokens = counter(GenerateTokens, "Completion tokens of generate steps, by pipeline.", "pipeline")
	m.serverPaused = gauge(ServerPaused, "1 while this worker's last pause or resume of a vLLM server left it paused, 0 after a resume; by server URL (credentials removed).", "server")

	m.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), m.sdk)
	return m
}

func (m *Metrics) register(name string, c prometheus.Collector) {
	m.Registry.MustRegister(c)
	m.names = append(m.names, name)
}

// Names are the names of rlflow's own metrics, as registered.
func (m *Metrics) Names() []string {
	out := append([]string(nil), m.names...)
	sort.Strings(out)
	return out
}

type ctxKey struct{}

// WithContext returns ctx carrying m, which From finds: the interceptor
// hands it to each activity this way, so activities record figures only
// they know without a global registry.
func WithContext(ctx context.Context, m *Metrics) context.Context {
	return context.WithValue(ctx, ctxKey{}, m)
}

// From is the Metrics in ctx, nil where none is (recording does nothing).
func From(ctx context.Context) *Metrics {
	m, _ := ctx.Value(ctxKey{}).(*Metrics)
	return m
}

// ObserveSync records one phase of a weight sync on the trainer side.
// Bytes per second is recorded where both figures are positive.
func (m *Metrics) ObserveSync(backend, phase string, seconds float64, bytes int64) {
	if m == nil || seconds < 0 {
		return
	}
	m.syncSeconds.WithLabelValues(backend, phase).Observe(seconds)
	if bytes > 0 {
		m.syncBytes.WithLabelValues(backend).Add(float64(bytes))
		if seconds > 0 {
			m.syncBps.WithLabelValues(backend, phase).Set(float64(bytes) / seconds)
		}
	}
}

// ObserveServerSync records one server's time in one weight-update
// operation during one sync, as the server reported it.
func (m *Metrics) ObserveServerSync(operation string, seconds float64) {
	if m == nil || seconds < 0 {
		return
	}
	m.syncServer.WithLabelValues(operation).Observe(seconds)
}

// ObserveGenerate records a generate step's completion tokens and rate.
func (m *Metrics) ObserveGenerate(pipeline string, tokens int64, tokensPerS float64) {
	if m == nil {
		return
	}
	if tokens > 0 {
		m.genTokens.WithLabelValues(pipeline).Add(float64(tokens))
	}
	m.genTokensPerS.WithLabelValues(pipeline).Set(tokensPerS)
}

// SetPaused records that servers are now paused (or resumed).
func (m *Metrics) SetPaused(servers []string, paused bool) {
	if m == nil {
		return
	}
	v := 0.0
	if paused {
		v = 1
	}
	for _, s := range servers {
		m.serverPaused.WithLabelValues(redactURL(s)).Set(v)
	}
}

// redactURL drops a URL's user information: a label is public.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return s
	}
	u.User = nil
	return u.String()
}

// touchRun records that run has series, dropping the series of the
// oldest run beyond MaxRuns.
func (m *Metrics) touchRun(run string) {
	m.runsMu.Lock()
	defer m.runsMu.Unlock()
	for i, r := range m.runs {
		if r == run {
			m.runs = append(append(m.runs[:i:i], m.runs[i+1:]...), run)
			return
		}
	}
	m.runs = append(m.runs, run)
	for len(m.runs) > MaxRuns {
		old := m.runs[0]
		m.runs = m.runs[1:]
		m.stepOutput.DeletePartialMatch(prometheus.Labels{"run_id": old})
		m.iteration.DeletePartialMatch(prometheus.Labels{"run_id": old})
	}
}

// recordOutputs sets the step output gauges of one successful step.
func (m *Metrics) recordOutputs(pipeline, run, step string, iteration int, outputs map[string]float64) {
	if run == "" {
		return
	}
	m.touchRun(run)
	m.iteration.WithLabelValues(pipeline, run).Set(float64(iteration))
	for k, v := range outputs {
		if strings.HasPrefix(k, "_") {
			continue // metadata, never an output
		}
		m.stepOutput.WithLabelValues(pipeline, run, step, k).Set(v)
	}
}
