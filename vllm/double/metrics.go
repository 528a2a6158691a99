package double

import (
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"time"
)

// Metric names on /metrics, as vLLM's newest builds export them.
const (
	metricOpDuration = "vllm:rl_weight_update_operation_duration_seconds"
	metricOpInFlight = "vllm:rl_weight_update_operations_in_flight"
)

// opStat is one weight-update operation's histogram sum and count.
type opStat struct {
	sum   float64
	count int
}

// metrics serves the Prometheus text format: process_start_time_seconds,
// written as prometheus_client's process collector writes it (each Server
// is a new process: StartTime), and vLLM's weight-update metrics: the
// duration histogram (sum and count per operation; the double keeps no
// bucket but +Inf) and the in-flight gauge. As with prometheus_client's
// labelled metrics, an operation appears once it was first called.
func (s *Server) metrics(w http.ResponseWriter, _ *http.Request) {
	start := float64(s.started.UnixNano()) / 1e9
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	fmt.Fprintf(w, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"+
		"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %s\n", strconv.FormatFloat(start, 'e', -1, 64))
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if len(s.ops) > 0 {
		fmt.Fprintf(w, "# HELP %s Duration of weight update operations (TEST DOUBLE).\n# TYPE %s histogram\n", metricOpDuration, metricOpDuration)
		for _, op := range sortedKeys(s.ops) {
			o := s.ops[op]
			fmt.Fprintf(w, "%s_bucket{model_name=%q,operation=%q,le=\"+Inf\"} %d\n", metricOpDuration, s.cfg.ModelName, op, o.count)
			fmt.Fprintf(w, "%s_sum{model_name=%q,operation=%q} %s\n", metricOpDuration, s.cfg.ModelName, op, strconv.FormatFloat(o.sum, 'g', -1, 64))
			fmt.Fprintf(w, "%s_count{model_name=%q,operation=%q} %d\n", metricOpDuration, s.cfg.ModelName, op, o.count)
		}
	}
	if len(s.inFlight) > 0 {
		fmt.Fprintf(w, "# HELP %s Weight update operations in progress (TEST DOUBLE).\n# TYPE %s gauge\n", metricOpInFlight, metricOpInFlight)
		for _, op := range sortedKeys(s.inFlight) {
			fmt.Fprintf(w, "%s{model_name=%q,operation=%q} %d\n", metricOpInFlight, s.cfg.ModelName, op, s.inFlight[op])
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// timed counts h as a running operation op while it runs and records how
// long it took, for /metrics.
func (s *Server) timed(op string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.opsMu.Lock()
		s.inFlight[op]++
		s.opsMu.Unlock()
		start := time.Now()
		defer func() {
			s.opsMu.Lock()
			s.inFlight[op]--
			o := s.ops[op]
			o.sum += time.Since(start).Seconds()
			o.count++
			s.ops[op] = o
			s.opsMu.Unlock()
		}()
		h(w, r)
	}
}
