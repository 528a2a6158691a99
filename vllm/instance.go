package vllm

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// StartTimeMetric is the Prometheus gauge ProcessStartTime reads.
const StartTimeMetric = "process_start_time_seconds"

// ProcessStartTime reads the server process's start time, in Unix seconds
// as the server exports it, from the process_start_time_seconds gauge on
// GET /metrics (Prometheus text format). prometheus_client's process
// collector exports it, and vLLM keeps that collector unless it runs
// several API server processes (Prometheus multiprocess mode); ok is false
// where the metric is absent. Every generation serves /metrics, so this is
// the one sign of a restart on servers without weight versions (A, B): a
// restarted vLLM is a new process serving the weights it started with.
// Compare two readings for equality only: the value is the server's text.
//
// The call is idempotent (retried like the other GETs) and bounded by
// Timeouts.Control; a server without the route answers 404.
func (c *Client) ProcessStartTime(ctx context.Context) (seconds float64, ok bool, err error) {
	cl := call{method: http.MethodGet, path: "/metrics", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	body, err := c.metricsText(ctx, cl)
	if err != nil {
		return 0, false, err
	}
	seconds, ok, err = parseStartTime(body)
	if err != nil {
		return 0, false, c.errorf(cl, http.StatusOK, nil, "%v", err)
	}
	return seconds, ok, nil
}

// parseStartTime finds StartTimeMetric in a Prometheus text exposition:
// `name[{labels}] value [timestamp]` lines, # comments skipped.
func parseStartTime(body []byte) (float64, bool, error) {
	for line := range bytes.Lines(body) {
		line = bytes.TrimSpace(line)
		rest, found := bytes.CutPrefix(line, []byte(StartTimeMetric))
		if !found || len(rest) == 0 {
			continue // another metric, a comment, a blank line
		}
		if rest[0] == '{' {
			end := bytes.IndexByte(rest, '}')
			if end < 0 {
				return 0, false, fmt.Errorf("%s: labels without a closing brace in %q", StartTimeMetric, clip(string(line)))
			}
			rest = rest[end+1:]
		} else if rest[0] != ' ' && rest[0] != '\t' {
			continue // a longer name with this prefix
		}
		fields := bytes.Fields(rest)
		if len(fields) < 1 || len(fields) > 2 {
			return 0, false, fmt.Errorf("%s: want a value and an optional timestamp, got %q", StartTimeMetric, clip(string(line)))
		}
		v, err := strconv.ParseFloat(string(fields[0]), 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v <= 0 {
			return 0, false, fmt.Errorf("%s: %q is not a start time in Unix seconds", StartTimeMetric, clip(string(fields[0])))
		}
		return v, true, nil
	}
	return 0, false, nil
}

// metricsText is the server's GET /metrics body (Prometheus text).
func (c *Client) metricsText(ctx context.Context, cl call) ([]byte, error) {
	var body rawBody
	if _, err := c.do(ctx, cl, &body); err != nil {
		return nil, err
	}
	return body, nil
}

// UpdateOperationMetric is the histogram of weight-update operation times
// that vLLM's newest builds export, labelled by operation (init, start,
// start_draft, update, finish).
const UpdateOperationMetric = "vllm:rl_weight_update_operation_duration_seconds"

// UpdateOperationSeconds reads the server's cumulative seconds per
// weight-update operation (UpdateOperationMetric's _sum series, added up
// over their other labels) from GET /metrics; ok is false where the server
// does not export the histogram. Two readings around an update give the
// server's own time in each operation.
func (c *Client) UpdateOperationSeconds(ctx context.Context) (seconds map[string]float64, ok bool, err error) {
	cl := call{method: http.MethodGet, path: "/metrics", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	body, err := c.metricsText(ctx, cl)
	if err != nil {
		return nil, false, err
	}
	seconds, err = parseOperationSums(body)
	if err != nil {
		return nil, false, c.errorf(cl, http.StatusOK, nil, "%v", err)
	}
	return seconds, seconds != nil, nil
}

// parseOperationSums adds up UpdateOperationMetric's _sum samples by their
// operation label; nil when there are none.
func parseOperationSums(body []byte) (map[string]float64, error) {
	prefix := []byte(UpdateOperationMetric + "_sum{")
	var out map[string]float64
	for line := range bytes.Lines(body) {
		line = bytes.TrimSpace(line)
		rest, found := bytes.CutPrefix(line, prefix)
		if !found {
			continue
		}
		end := bytes.LastIndexByte(rest, '}')
		if end < 0 {
			return nil, fmt.Errorf("%s_sum: labels without a closing brace in %q", UpdateOperationMetric, clip(string(line)))
		}
		op := labelValue(rest[:end], "operation")
		fields := bytes.Fields(rest[end+1:])
		if op == "" || len(fields) < 1 || len(fields) > 2 {
			return nil, fmt.Errorf("%s_sum: want an operation label and a value, got %q", UpdateOperationMetric, clip(string(line)))
		}
		v, err := strconv.ParseFloat(string(fields[0]), 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return nil, fmt.Errorf("%s_sum: %q is not a number of seconds", UpdateOperationMetric, clip(string(fields[0])))
		}
		if out == nil {
			out = map[string]float64{}
		}
		out[op] += v
	}
	return out, nil
}

// labelValue is the value of label name in a Prometheus label set
// (`a="x",b="y"`); "" when absent. Values holding `",` are not expected.
func labelValue(labels []byte, name string) string {
	for _, kv := range bytes.Split(labels, []byte(",")) {
		k, v, ok := bytes.Cut(bytes.TrimSpace(kv), []byte("="))
		if ok && string(k) == name {
			return strings.Trim(string(v), `"`)
		}
	}
	return ""
}
