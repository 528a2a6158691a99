// Package vllm is the client rlflow's activities use to drive vLLM servers:
// the dev-mode RLHF control plane (pause/resume, weight-transfer init,
// update sessions, weight versions) and the OpenAI-compatible generation API.
//
// Invariants:
//   - A Client talks to exactly one server; Fleet fans out to several.
//   - Every error a Client returns is an *Error naming the server, the call
//     and the reason, so a Temporal failure message alone says what broke.
//   - Every request runs under a finite deadline (the phase's timeout from
//     Timeouts, or the caller's context if that is sooner) and every
//     response body is read through a size limit.
//   - Only idempotent calls (GETs, pause, resume, is_paused) are retried;
//     init, start, update and finish never are: a retried update_weights
//     would leave the trainer's broadcast and the server out of step.
//   - A payload only carries keys its API generation knows: vLLM decodes
//     init_info and update_info into strict dataclasses, so an unknown key is
//     an HTTP 500 (and a trainer already inside a broadcast would hang).
//   - The API key is sent as a bearer token and never appears in an error.
//
// The HTTP contract is shared/docs/vllm-weight-transfer.md.
package vllm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	openai "github.com/sashabaranov/go-openai"
)

// Default phase timeouts; see Timeouts. They are also the defaults of the
// step arguments that set them (the pipelines registry names these).
const (
	DefaultControlTimeout  = 30 * time.Second
	DefaultGenerateTimeout = 10 * time.Minute
	// DefaultInitTimeout covers vLLM's 300 s TCPStore rendezvous timeout plus
	// NCCL communicator setup and the warm-up all-reduce.
	DefaultInitTimeout = 6 * time.Minute
	// DefaultUpdateTimeout is used when neither Timeouts.Update nor the
	// update's checkpoint size is known.
	DefaultUpdateTimeout = 30 * time.Minute
)

// Response size limits: control-plane answers are small; generation answers
// hold n samples per prompt and may be large, but never unbounded.
const (
	maxControlResponse  = 4 << 20
	maxGenerateResponse = 256 << 20
	maxErrorMessage     = 2 << 10
)

// The update_weights deadline scales with the checkpoint (UpdateTimeoutFor):
// UpdateTimeoutBase plus one second per started UpdateTimeoutBytesPerSecond
// bytes.
const (
	UpdateTimeoutBase           = 60 * time.Second
	UpdateTimeoutBytesPerSecond = 200 << 20
)

// UpdateTimeoutFor scales the update_weights deadline with the checkpoint:
// 60 s plus 1 s per started 200 MiB (a 16 GiB checkpoint gets 2m22s, a
// 1.5 TB one a little over 2 h), because a fixed deadline either wedges an
// orchestrator for hours or kills the load of a large model. A size <= 0
// (unknown) gets DefaultUpdateTimeout.
func UpdateTimeoutFor(checkpointBytes int64) time.Duration {
	if checkpointBytes <= 0 {
		return DefaultUpdateTimeout
	}
	const per = UpdateTimeoutBytesPerSecond
	return UpdateTimeoutBase + time.Duration((checkpointBytes+per-1)/per)*time.Second
}

// Timeouts bound each phase of work against a server; a zero field takes the
// default. The caller's context deadline still applies when it is sooner.
type Timeouts struct {
	// Control bounds short calls: pause (abort, keep), resume, is_paused,
	// get_world_size, weight_info, update_weight_version, start/finish.
	Control time.Duration
	// Generate bounds one completions or chat request, and pause?mode=wait,
	// which lasts as long as the longest in-flight request.
	Generate time.Duration
	// Init bounds init_weight_transfer_engine (rendezvous and NCCL setup).
	Init time.Duration
	// Update bounds update_weights and weight_checker; zero means
	// UpdateTimeoutFor(UpdateInfo.CheckpointBytes).
	Update time.Duration
}

func (t Timeouts) control() time.Duration  { return orDefault(t.Control, DefaultControlTimeout) }
func (t Timeouts) generate() time.Duration { return orDefault(t.Generate, DefaultGenerateTimeout) }
func (t Timeouts) init() time.Duration     { return orDefault(t.Init, DefaultInitTimeout) }
func (t Timeouts) update(checkpointBytes int64) time.Duration {
	return orDefault(t.Update, UpdateTimeoutFor(checkpointBytes))
}

func orDefault(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// RetryPolicy bounds the retries of idempotent calls; zero fields take the
// defaults (4 attempts, 200 ms doubling to at most 5 s). Retried are
// transport errors, timeouts of one attempt, HTTP 429 and 5xx.
type RetryPolicy struct {
	Attempts int // total attempts, >= 1; 1 disables retries
	Initial  time.Duration
	Max      time.Duration
}

func (p RetryPolicy) normalized() RetryPolicy {
	if p.Attempts <= 0 {
		p.Attempts = 4
	}
	p.Initial = orDefault(p.Initial, 200*time.Millisecond)
	p.Max = orDefault(p.Max, 5*time.Second)
	return p
}

// Options configure a Client.
type Options struct {
	// APIKey is sent as "Authorization: Bearer <key>" (vLLM's --api-key).
	// The caller reads it from the worker's environment; it is never logged
	// nor put in an error.
	APIKey string
	// HTTPClient carries the requests; nil means a client with its own
	// transport sized for many concurrent generation requests. Its Timeout
	// should be zero: deadlines come from Timeouts.
	HTTPClient *http.Client
	Timeouts   Timeouts
	Retry      RetryPolicy
	// Generation pins the API generation; "" means detect it on first need
	// (DetectGeneration). Pin it where the pipeline knows it.
	Generation Generation
}

// Client talks to one vLLM server. It is safe for concurrent use.
type Client struct {
	base  string // scheme://host[:port][/prefix], no trailing slash
	opts  Options
	retry RetryPolicy
	http  *http.Client
	oai   *openai.Client

	mu      sync.Mutex
	gen     Generation // pinned or detected; "" until known
	version string     // GET /version's answer once read; "" until then
}

// New returns a client for the server at baseURL, the server's root
// (http://host:8000), not its /v1 prefix.
func New(baseURL string, opts Options) (*Client, error) {
	base, err := normalizeBase(baseURL)
	if err != nil {
		return nil, &Error{Server: redacted(baseURL), Call: "new client", Message: err.Error()}
	}
	if opts.Generation != "" {
		if _, err := ParseGeneration(string(opts.Generation)); err != nil {
			return nil, &Error{Server: base, Call: "new client", Message: err.Error()}
		}
	}
	hc := opts.HTTPClient
	if hc == nil {
		hc = defaultHTTPClient()
	}
	c := &Client{base: base, opts: opts, retry: opts.Retry.normalized(), http: hc, gen: opts.Generation}
	cfg := openai.DefaultConfig(opts.APIKey)
	cfg.BaseURL = base + "/v1"
	cfg.HTTPClient = limitDoer{hc}
	c.oai = openai.NewClientWithConfig(cfg)
	return c, nil
}

func normalizeBase(raw string) (string, error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	if err != nil {
		return "", errors.New("invalid base URL: it does not parse")
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("base URL %q: scheme must be http or https", raw)
	case u.Host == "":
		return "", fmt.Errorf("base URL %q has no host", raw)
	case u.User != nil:
		// Credentials in a URL end up in logs and errors: use Options.APIKey.
		return "", errors.New("base URL must not carry credentials; use Options.APIKey")
	case u.RawQuery != "" || u.Fragment != "":
		return "", fmt.Errorf("base URL %q must not have a query or fragment", raw)
	}
	p := strings.TrimRight(u.Path, "/")
	if p == "/v1" || strings.HasSuffix(p, "/v1") {
		return "", fmt.Errorf("base URL %q ends in /v1: give the server root, the client adds /v1 for the OpenAI API", raw)
	}
	return u.Scheme + "://" + u.Host + p, nil
}

// redacted hides a password in a URL that is about to be reported.
func redacted(raw string) string {
	if u, err := url.Parse(strings.TrimSpace(raw)); err == nil {
		return u.Redacted()
	}
	return "(unparsable base URL)"
}

// DefaultConnsPerHost is the idle connections per host the default client
// keeps: generate's concurrency must not exceed it, or every request beyond
// it opens (and later closes) a fresh TCP connection.
const DefaultConnsPerHost = 512

func defaultHTTPClient() *http.Client { return NewHTTPClient(DefaultConnsPerHost) }

// NewHTTPClient returns a client for Options.HTTPClient whose transport keeps
// up to connsPerHost idle connections to each server (at least 2), so that
// connsPerHost concurrent requests to one server reuse their connections.
// Share one among the Clients of a process: each transport holds its own
// pool of connections.
func NewHTTPClient(connsPerHost int) *http.Client {
	connsPerHost = max(connsPerHost, 2)
	t := http.DefaultTransport.(*http.Transport).Clone()
	// Generation fans out hundreds of concurrent requests to one host; the
	// default of 2 idle connections per host would churn TCP connections.
	t.MaxIdleConnsPerHost = connsPerHost
	t.MaxIdleConns = 2 * connsPerHost
	t.IdleConnTimeout = 90 * time.Second
	t.ResponseHeaderTimeout = 0 // long blocking calls; deadlines come from contexts
	return &http.Client{Transport: t}
}

// URL is the server's base URL as the client uses it.
func (c *Client) URL() string { return c.base }

// String names the server, for logs and errors.
func (c *Client) String() string { return c.base }

// Error is every error a Client returns.
type Error struct {
	Server  string // the server's base URL
	Call    string // "POST /update_weights", or a client-side step
	Status  int    // HTTP status; 0 when no response came (or the client refused)
	Message string // vLLM's detail/message text, or the transport's reason
	Err     error  // the underlying error, if any (context.DeadlineExceeded, *url.Error, ...)
}

func (e *Error) Error() string {
	if e.Status != 0 {
		return fmt.Sprintf("vllm %s: %s: HTTP %d: %s", e.Server, e.Call, e.Status, e.Message)
	}
	return fmt.Sprintf("vllm %s: %s: %s", e.Server, e.Call, e.Message)
}

func (e *Error) Unwrap() error { return e.Err }

// call describes one control-plane request.
type call struct {
	method     string
	path       string
	query      url.Values
	body       any // nil: no body; marshalled as JSON otherwise
	timeout    time.Duration
	idempotent bool
	timeoutOf  string // the Timeouts field, named in a timeout error
}

func (c call) name() string { return c.method + " " + c.path }

func (c *Client) errorf(cl call, status int, err error, format string, args ...any) *Error {
	return &Error{Server: c.base, Call: cl.name(), Status: status, Message: fmt.Sprintf(format, args...), Err: err}
}

// do runs cl, retrying idempotent calls, and decodes a 2xx JSON body into out
// (if non-nil; a *rawBody takes the body as it is). It returns the status of
// the last response.
func (c *Client) do(ctx context.Context, cl call, out any) (int, error) {
	var body []byte
	if cl.body != nil {
		b, err := json.Marshal(cl.body)
		if err != nil {
			return 0, c.errorf(cl, 0, err, "encode request: %v", err)
		}
		body = b
	}
	attempts := 1
	if cl.idempotent {
		attempts = c.retry.Attempts
	}
	backoff := c.retry.Initial
	for i := 1; ; i++ {
		status, err := c.once(ctx, cl, body, out)
		if err == nil || i >= attempts || !retryable(ctx, status, err) {
			return status, err
		}
		// Full jitter keeps a fleet of workers from retrying in lockstep.
		wait := time.Duration(rand.Int64N(int64(backoff)) + 1)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return status, err
		case <-t.C:
		}
		backoff = min(2*backoff, c.retry.Max)
	}
}

func retryable(ctx context.Context, status int, err error) bool {
	if ctx.Err() != nil || errors.Is(err, ErrStepDeadline) {
		return false
	}
	if status == 0 {
		var e *Error
		// Client-side refusals (encode errors) carry no transport error.
		return errors.As(err, &e) && e.Err != nil && !errors.Is(e.Err, errEncode)
	}
	return status == http.StatusTooManyRequests || status >= 500
}

var errEncode = errors.New("encode")

// rawBody, as a call's out, takes the 2xx body as it came instead of
// decoding it as JSON (GET /metrics is Prometheus text).
type rawBody []byte

func (c *Client) once(ctx context.Context, cl call, body []byte, out any) (int, error) {
	budget := budgetFor(ctx, cl.timeout, cl.timeoutOf)
	actx, cancel := context.WithTimeout(ctx, budget.timeout)
	defer cancel()
	u := c.base + cl.path
	if len(cl.query) > 0 {
		u += "?" + cl.query.Encode()
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(actx, cl.method, u, rd)
	if err != nil {
		return 0, c.errorf(cl, 0, errors.Join(errEncode, err), "build request: %v", err)
	}
	raw, isRaw := out.(*rawBody)
	if isRaw {
		req.Header.Set("Accept", "text/plain")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.opts.APIKey)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, c.transportError(ctx, actx, cl, budget, err)
	}
	defer resp.Body.Close()
	data, err := readLimited(resp.Body, maxControlResponse)
	if err != nil {
		if ctxErr := actx.Err(); ctxErr != nil {
			return resp.StatusCode, c.transportError(ctx, actx, cl, budget, err)
		}
		return resp.StatusCode, c.errorf(cl, resp.StatusCode, err, "read response: %v", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return resp.StatusCode, c.errorf(cl, resp.StatusCode, nil, "%s", errorMessage(resp.StatusCode, data))
	}
	if isRaw {
		*raw = data
		return resp.StatusCode, nil
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return resp.StatusCode, c.errorf(cl, resp.StatusCode, err, "decode response %q: %v", clip(string(data)), err)
		}
	}
	return resp.StatusCode, nil
}

// transportError names what failed when no (complete) response came: the
// caller's context, this phase's deadline, or the connection.
func (c *Client) transportError(ctx, actx context.Context, cl call, budget callBudget, err error) *Error {
	switch {
	case ctx.Err() != nil:
		return c.errorf(cl, 0, ctx.Err(), "%v", context.Cause(ctx))
	case errors.Is(actx.Err(), context.DeadlineExceeded):
		return c.errorf(cl, 0, budget.cause(), "%s", budget.expired())
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err // the URL is already in the message as server + call
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return c.errorf(cl, 0, err, "network timeout: %v", err)
	}
	return c.errorf(cl, 0, err, "%v", err)
}

var errTooLarge = errors.New("response body exceeds the size limit")

func readLimited(r io.Reader, limit int64) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%w of %d bytes", errTooLarge, limit)
	}
	return data, nil
}

// errorMessage extracts the human text from an error body in any of the
// shapes vLLM and FastAPI produce: {"detail": "..."} (HTTPException),
// {"detail": [{"msg": ...}]} (validation), {"error": "..."} (pause/resume),
// {"error": {"message": ...}} and {"object": "error", "message": ...}
// (OpenAI-style), or plain text ("Internal Server Error").
func errorMessage(status int, body []byte) string {
	var v struct {
		Detail  json.RawMessage `json:"detail"`
		Error   json.RawMessage `json:"error"`
		Message json.RawMessage `json:"message"`
	}
	if json.Unmarshal(body, &v) == nil {
		for _, raw := range []json.RawMessage{v.Detail, v.Error, v.Message} {
			if m := textOf(raw); m != "" {
				return clip(m)
			}
		}
	}
	if s := strings.TrimSpace(string(body)); s != "" {
		return clip(s)
	}
	return http.StatusText(status)
}

func textOf(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var obj struct {
		Message json.RawMessage `json:"message"`
		Msg     string          `json:"msg"`
	}
	if json.Unmarshal(raw, &obj) == nil {
		if m := textOf(obj.Message); m != "" {
			return m
		}
		if obj.Msg != "" {
			return obj.Msg
		}
	}
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) == nil {
		var parts []string
		for _, item := range list {
			if m := textOf(item); m != "" {
				parts = append(parts, m)
			}
		}
		return strings.Join(parts, "; ")
	}
	return string(raw)
}

func clip(s string) string {
	s = strings.TrimSpace(s)
	if len(s) <= maxErrorMessage {
		return s
	}
	return s[:maxErrorMessage] + "...(truncated)"
}

// limitDoer bounds the bodies go-openai reads (it uses io.ReadAll).
type limitDoer struct{ c *http.Client }

func (d limitDoer) Do(req *http.Request) (*http.Response, error) {
	resp, err := d.c.Do(req)
	if err != nil {
		return nil, err
	}
	resp.Body = &limitedBody{rc: resp.Body, left: maxGenerateResponse}
	return resp, nil
}

type limitedBody struct {
	rc   io.ReadCloser
	left int64
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// Probe for one more byte: a body of exactly the limit is fine.
		var one [1]byte
		if n, _ := b.rc.Read(one[:]); n > 0 {
			return 0, fmt.Errorf("%w of %d bytes", errTooLarge, int64(maxGenerateResponse))
		}
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.rc.Read(p)
	b.left -= int64(n)
	return n, err
}

func (b *limitedBody) Close() error { return b.rc.Close() }
