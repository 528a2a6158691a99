package metrics

import (
	"maps"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.temporal.io/sdk/client"
)

// SDKHandler is the Temporal SDK's metrics handler over m's registry
// (client.Options.MetricsHandler): the SDK's counters, gauges and timers
// (temporal_request, temporal_activity_execution_latency, ...) appear
// beside rlflow's, timers as histograms in seconds.
//
// It is a small handler over client_golang rather than the SDK's
// contrib/tally with tally's Prometheus reporter: that pair brings tally
// and an older Prometheus client of its own into the module, for the four
// methods this file implements. The SDK emits one metric name with
// several tag sets (a worker's and a client's), which a Prometheus Vec
// refuses; each series is therefore a metric of its own with its tags as
// constant labels, gathered by an unchecked collector.
func (m *Metrics) SDKHandler() client.MetricsHandler {
	if m == nil {
		return client.MetricsNopHandler
	}
	return sdkHandler{c: m.sdk}
}

type sdkHandler struct {
	c    *sdkCollector
	tags map[string]string
}

func (h sdkHandler) WithTags(tags map[string]string) client.MetricsHandler {
	merged := make(map[string]string, len(h.tags)+len(tags))
	maps.Copy(merged, h.tags)
	maps.Copy(merged, tags)
	return sdkHandler{c: h.c, tags: merged}
}

func (h sdkHandler) Counter(name string) client.MetricsCounter {
	c := h.c.series(name, h.tags, func(o prometheus.Opts) prometheus.Metric {
		return prometheus.NewCounter(prometheus.CounterOpts(o))
	}).(prometheus.Counter)
	return counterFunc(func(n int64) {
		if n > 0 { // a Prometheus counter never goes down
			c.Add(float64(n))
		}
	})
}

func (h sdkHandler) Gauge(name string) client.MetricsGauge {
	g := h.c.series(name, h.tags, func(o prometheus.Opts) prometheus.Metric {
		return prometheus.NewGauge(prometheus.GaugeOpts(o))
	}).(prometheus.Gauge)
	return gaugeFunc(g.Set)
}

func (h sdkHandler) Timer(name string) client.MetricsTimer {
	hist := h.c.series(name, h.tags, func(o prometheus.Opts) prometheus.Metric {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: o.Name, Help: o.Help, ConstLabels: o.ConstLabels, Buckets: sdkTimerBuckets})
	}).(prometheus.Histogram)
	return timerFunc(func(d time.Duration) { hist.Observe(d.Seconds()) })
}

// sdkTimerBuckets cover a gRPC call (milliseconds) to a long poll and a
// long activity.
var sdkTimerBuckets = []float64{0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800}

// sdkCollector holds the SDK's series, one metric per name and tag set.
type sdkCollector struct {
	mu    sync.Mutex
	byKey map[string]prometheus.Metric // name and sorted tags -> series
}

func newSDKCollector() *sdkCollector {
	return &sdkCollector{byKey: map[string]prometheus.Metric{}}
}

// series is the metric for name and tags, made by mk on first use.
func (c *sdkCollector) series(name string, tags map[string]string, mk func(prometheus.Opts) prometheus.Metric) prometheus.Metric {
	keys := make([]string, 0, len(tags))
	for k := range tags {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var key strings.Builder
	key.WriteString(name)
	for _, k := range keys {
		key.WriteString("\xff" + k + "=" + tags[k])
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.byKey[key.String()]; ok {
		return s
	}
	s := mk(prometheus.Opts{Name: name, Help: "Temporal SDK metric " + name + ".", ConstLabels: prometheus.Labels(maps.Clone(tags))})
	c.byKey[key.String()] = s
	return s
}

// Describe sends nothing: the collector is unchecked, as its series
// appear while the SDK runs.
func (c *sdkCollector) Describe(chan<- *prometheus.Desc) {}

func (c *sdkCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	all := make([]prometheus.Metric, 0, len(c.byKey))
	for _, s := range c.byKey {
		all = append(all, s)
	}
	c.mu.Unlock()
	for _, s := range all {
		ch <- s
	}
}

type (
	counterFunc func(int64)
	gaugeFunc   func(float64)
	timerFunc   func(time.Duration)
)

func (f counterFunc) Inc(n int64)          { f(n) }
func (f gaugeFunc) Update(v float64)       { f(v) }
func (f timerFunc) Record(d time.Duration) { f(d) }
