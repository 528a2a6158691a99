package vllm

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
)

// Pause modes (POST /pause?mode=...).
const (
	// PauseAbort aborts in-flight requests (they finish with reason "abort").
	PauseAbort = "abort"
	// PauseWait lets in-flight requests finish; the call returns after them.
	PauseWait = "wait"
	// PauseKeep freezes in-flight requests; they continue on resume.
	PauseKeep = "keep"
)

// WorldSize returns the server's world size: TP×PP×DP with includeDP,
// TP×PP without.
func (c *Client) WorldSize(ctx context.Context, includeDP bool) (int, error) {
	cl := call{method: http.MethodGet, path: "/get_world_size", query: url.Values{"include_dp": {strconv.FormatBool(includeDP)}},
		timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	var v struct {
		WorldSize *int `json:"world_size"`
	}
	if _, err := c.do(ctx, cl, &v); err != nil {
		return 0, err
	}
	if v.WorldSize == nil || *v.WorldSize < 1 {
		return 0, c.errorf(cl, http.StatusOK, nil, "response has no positive world_size")
	}
	return *v.WorldSize, nil
}

// Pause stops generation in the given mode (PauseAbort, PauseWait or
// PauseKeep; nothing else is accepted, so no mode is defaulted silently).
// Pausing a paused server succeeds. Retried: a repeated pause is harmless.
//
// Generation A's /pause knows no mode (FastAPI drops the parameter): it
// aborts unless wait_for_inflight_requests is true. So wait also sends
// that (B-D read it as the deprecated spelling of mode=wait, E ignores
// it), and keep, which A cannot do, is refused there rather than turned
// into an abort.
func (c *Client) Pause(ctx context.Context, mode string) error {
	q := url.Values{"mode": {mode}}
	cl := call{method: http.MethodPost, path: "/pause", query: q,
		timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	switch mode {
	case PauseAbort:
	case PauseKeep:
		gen, err := c.generation(ctx)
		if err != nil {
			return err
		}
		if gen == GenA {
			return c.errorf(cl, 0, nil, "pause mode keep: generation A's /pause cannot keep requests frozen (it only aborts them, or waits for them with wait_for_inflight_requests); use mode abort or wait")
		}
	case PauseWait:
		q.Set("wait_for_inflight_requests", "true")
		cl.timeout, cl.timeoutOf = c.opts.Timeouts.generate(), "Generate"
	default:
		return c.errorf(cl, 0, nil, "pause mode %q, want abort, wait or keep", mode)
	}
	_, err := c.do(ctx, cl, nil)
	return err
}

// Resume restarts generation. Resuming a running server succeeds. Retried.
func (c *Client) Resume(ctx context.Context) error {
	cl := call{method: http.MethodPost, path: "/resume", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	_, err := c.do(ctx, cl, nil)
	return err
}

// IsPaused reports whether generation is paused.
func (c *Client) IsPaused(ctx context.Context) (bool, error) {
	cl := call{method: http.MethodGet, path: "/is_paused", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	var v struct {
		IsPaused *bool `json:"is_paused"`
	}
	if _, err := c.do(ctx, cl, &v); err != nil {
		return false, err
	}
	if v.IsPaused == nil {
		return false, c.errorf(cl, http.StatusOK, nil, "response has no is_paused")
	}
	return *v.IsPaused, nil
}

// Models lists the served model names (GET /v1/models), in the server's
// order; the first is the one a request without a model should name.
func (c *Client) Models(ctx context.Context) ([]string, error) {
	cl := call{method: http.MethodGet, path: "/v1/models", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	var v struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if _, err := c.do(ctx, cl, &v); err != nil {
		return nil, err
	}
	out := make([]string, 0, len(v.Data))
	for _, m := range v.Data {
		if m.ID != "" {
			out = append(out, m.ID)
		}
	}
	if len(out) == 0 {
		return nil, c.errorf(cl, http.StatusOK, nil, "the server lists no models")
	}
	return out, nil
}
