package vllm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"time"
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
	body, err := c.getText(ctx, cl)
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

// getText runs the GET cl and returns its 2xx body as it came, retrying
// as do does. (do decodes JSON; /metrics is text.)
func (c *Client) getText(ctx context.Context, cl call) ([]byte, error) {
	backoff := c.retry.Initial
	for i := 1; ; i++ {
		status, body, err := c.getTextOnce(ctx, cl)
		if err == nil || i >= c.retry.Attempts || !retryable(ctx, status, err) {
			return body, err
		}
		t := time.NewTimer(time.Duration(rand.Int64N(int64(backoff)) + 1))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
		backoff = min(2*backoff, c.retry.Max)
	}
}

func (c *Client) getTextOnce(ctx context.Context, cl call) (int, []byte, error) {
	actx, cancel := context.WithTimeout(ctx, cl.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(actx, cl.method, c.base+cl.path, nil)
	if err != nil {
		return 0, nil, c.errorf(cl, 0, errors.Join(errEncode, err), "build request: %v", err)
	}
	req.Header.Set("Accept", "text/plain")
	if c.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.opts.APIKey)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, nil, c.textTransportError(ctx, actx, cl, err)
	}
	defer resp.Body.Close()
	data, err := readLimited(resp.Body, maxControlResponse)
	if err != nil {
		if actx.Err() != nil {
			return resp.StatusCode, nil, c.textTransportError(ctx, actx, cl, err)
		}
		return resp.StatusCode, nil, c.errorf(cl, resp.StatusCode, err, "read response: %v", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return resp.StatusCode, nil, c.errorf(cl, resp.StatusCode, nil, "%s", errorMessage(resp.StatusCode, data))
	}
	return resp.StatusCode, data, nil
}

// textTransportError names what failed when no (complete) answer came.
func (c *Client) textTransportError(ctx, actx context.Context, cl call, err error) *Error {
	switch {
	case ctx.Err() != nil:
		return c.errorf(cl, 0, ctx.Err(), "%v", context.Cause(ctx))
	case errors.Is(actx.Err(), context.DeadlineExceeded):
		return c.errorf(cl, 0, context.DeadlineExceeded, "no answer within %v (Timeouts.%s)", cl.timeout, cl.timeoutOf)
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err // the URL is already in the message as server + call
	}
	return c.errorf(cl, 0, err, "%v", err)
}
