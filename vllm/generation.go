package vllm

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// Generation is a vLLM RLHF API generation (spec section 0); generations
// break each other, so every payload is built for exactly one.
type Generation string

const (
	// GenA: /init_weight_transfer, /update_weights, /finalize_weight_update;
	// update_info.packed only.
	GenA Generation = "A"
	// GenB: /init_weight_transfer_engine and one /update_weights per update;
	// packed settings in update_info.
	GenB Generation = "B"
	// GenC: B plus start/finish sessions, weight versions and the checker.
	GenC Generation = "C"
	// GenD: as C, but packed settings move to init_info, which also accepts
	// nccl_unique_id_b64 in its newest builds (vLLM 0.28+).
	GenD Generation = "D"
	// GenE, the newest: payloads as D, but the router validates bodies
	// first (400 for a non-object body, a missing or non-object init_info,
	// an update_info neither an object nor a list of objects; worker errors
	// stay 500), update_info may be a list with one payload per inference
	// worker, init_info takes nccl_unique_id_b64, a failed update_weights
	// closes the worker's session itself, and the source tree uses the
	// vllm.backends layout (spec section 8).
	GenE Generation = "E"
)

// Generations lists every generation, oldest first.
var Generations = []Generation{GenA, GenB, GenC, GenD, GenE}

// ParseGeneration accepts "A".."E" in either case.
func ParseGeneration(s string) (Generation, error) {
	g := Generation(strings.ToUpper(strings.TrimSpace(s)))
	if slices.Contains(Generations, g) {
		return g, nil
	}
	return "", fmt.Errorf("unknown vLLM API generation %q (want A, B, C, D or E)", s)
}

// HasSessions reports whether the generation has update sessions
// (start/finish_weight_update) and weight versions: C, D and E.
func (g Generation) HasSessions() bool { return g == GenC || g == GenD || g == GenE }

// TakesUniqueIDB64 reports whether every server of the generation accepts
// init_info.nccl_unique_id_b64, so the trainer can hand it the NCCL unique
// id without a TCPStore or a pickle: E. (Only the newest D builds take it,
// and a D server cannot tell which build it is.)
func (g Generation) TakesUniqueIDB64() bool { return g == GenE }

// ClosesFailedSession reports whether the server closes its update session
// itself when update_weights fails (E): finishing it afterwards is answered
// with a 500 that is no leak.
func (g Generation) ClosesFailedSession() bool { return g == GenE }

// BackendsLayout reports whether the server's source tree is the
// vllm.backends layout (E), where vllm.distributed moved to
// vllm.backends.distributed and the old module names resolve only through
// compatibility shims: a pickled NCCL unique id should name the new module.
func (g Generation) BackendsLayout() bool { return g == GenE }

// TakesUpdateInfoList reports whether update_info may be a list with one
// payload per inference worker (E).
func (g Generation) TakesUpdateInfoList() bool { return g == GenE }

// Generation returns the pinned or detected generation, "" if neither yet.
func (c *Client) Generation() Generation {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

func (c *Client) generation(ctx context.Context) (Generation, error) {
	if g := c.Generation(); g != "" {
		return g, nil
	}
	return c.DetectGeneration(ctx)
}

// firstGenD is the first vLLM release of generation D (spec section 0).
const firstGenDMajor, firstGenDMinor = 0, 28

// firstGenE is the first vLLM release rlflow treats as generation E. The
// spec (section 8, December 2026) describes the newest builds without a
// release number; 0.30 is the first minor after the 0.28/0.29 line the D
// rules were checked against. A build that differs is pinned with the
// server's api: E (or D) in the pipeline. The vLLM double reports 0.30.0
// for E.
const firstGenEMajor, firstGenEMinor = 0, 30

// DetectGeneration probes the server and remembers the answer; a pinned
// Options.Generation is returned without probing.
//
// The probe is side-effect free: it sends GET to the POST-only routes.
// FastAPI (Starlette) answers 405 Method Not Allowed when the path exists
// with another method and 404 when it does not, so a GET tells which routes
// exist without running them. The spec's literal rule, POST
// /start_weight_update, would open an update session on a C/D server (and
// fail with 500 if one were already open, where "finishing" it to clean up
// would close somebody else's session), so it is never used.
//
//   - /init_weight_transfer_engine 404 and /init_weight_transfer 405: A.
//   - both 404: dev mode is off (VLLM_SERVER_DEV_MODE=1 missing): error.
//   - /start_weight_update 404: B.
//   - otherwise C, D or E, told apart by GET /version (D is vLLM >= 0.28,
//     E >= 0.30); without a readable version the generation cannot be
//     known: error, pin it with Options.Generation.
func (c *Client) DetectGeneration(ctx context.Context) (Generation, error) {
	if c.opts.Generation != "" {
		return c.opts.Generation, nil
	}
	g, err := c.detect(ctx)
	if err != nil {
		return "", err
	}
	c.mu.Lock()
	c.gen = g
	c.mu.Unlock()
	return g, nil
}

func (c *Client) detect(ctx context.Context) (Generation, error) {
	engine, err := c.routeExists(ctx, "/init_weight_transfer_engine")
	if err != nil {
		return "", err
	}
	if !engine {
		a, err := c.routeExists(ctx, "/init_weight_transfer")
		if err != nil {
			return "", err
		}
		if a {
			return GenA, nil
		}
		return "", &Error{Server: c.base, Call: "detect generation", Status: http.StatusNotFound,
			Message: "no weight-transfer routes: start vllm serve with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config"}
	}
	session, err := c.routeExists(ctx, "/start_weight_update")
	if err != nil {
		return "", err
	}
	if !session {
		return GenB, nil
	}
	cl := call{method: http.MethodGet, path: "/version", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	var v struct {
		Version string `json:"version"`
	}
	if _, err := c.do(ctx, cl, &v); err != nil {
		var e *Error
		if errors.As(err, &e) {
			e.Message = "server has sessions, so it is C, D or E, but its version is unreadable, so it cannot tell which (pin the generation): " + e.Message
		}
		return "", err
	}
	major, minor, ok := parseVersion(v.Version)
	if !ok {
		return "", c.errorf(cl, 0, nil, "server has sessions, so it is C, D or E, but version %q does not parse, so it cannot tell which (pin the generation)", v.Version)
	}
	c.mu.Lock()
	c.version = v.Version
	c.mu.Unlock()
	return generationOf(major, minor), nil
}

// generationOf is the generation of a vLLM release that has sessions.
func generationOf(major, minor int) Generation {
	atLeast := func(m, n int) bool { return major > m || (major == m && minor >= n) }
	switch {
	case atLeast(firstGenEMajor, firstGenEMinor):
		return GenE
	case atLeast(firstGenDMajor, firstGenDMinor):
		return GenD
	}
	return GenC
}

// routeExists probes path with GET: 405 = the (POST) route exists, 404 = it
// does not; anything else is an error, because guessing would later send a
// payload the server rejects.
func (c *Client) routeExists(ctx context.Context, path string) (bool, error) {
	cl := call{method: http.MethodGet, path: path, timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	status, err := c.do(ctx, cl, nil)
	switch status {
	case http.StatusMethodNotAllowed:
		return true, nil
	case http.StatusNotFound:
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return false, c.errorf(cl, status, nil, "generation probe: answered %d, want 405 (route exists) or 404", status)
}

// parseVersion reads major.minor from a vLLM version such as "0.28.1",
// "0.28.0rc1" or "0.27.1.dev45+g1234".
func parseVersion(v string) (major, minor int, ok bool) {
	parts := strings.SplitN(strings.TrimPrefix(strings.TrimSpace(v), "v"), ".", 3)
	if len(parts) < 2 {
		return 0, 0, false
	}
	major, err1 := strconv.Atoi(parts[0])
	digits := strings.IndexFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' })
	if digits == -1 {
		digits = len(parts[1])
	}
	minor, err2 := strconv.Atoi(parts[1][:digits])
	return major, minor, err1 == nil && err2 == nil && major >= 0 && minor >= 0
}
