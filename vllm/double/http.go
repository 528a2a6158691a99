package double

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// unknownRoute is the Stats.Requests key of every request to a path the
// server does not serve.
const unknownRoute = "unknown route"

// route is one path with its single method, as FastAPI registers them.
type route struct {
	method string
	serve  func(w http.ResponseWriter, r *http.Request)
}

func (s *Server) buildRoutes() map[string]*route {
	rt := map[string]*route{
		"/health":              {http.MethodGet, s.health},
		"/version":             {http.MethodGet, s.version},
		"/v1/models":           {http.MethodGet, s.models},
		"/v1/completions":      {http.MethodPost, s.completions},
		"/v1/chat/completions": {http.MethodPost, s.chat},
		"/metrics":             {http.MethodGet, s.metrics},
	}
	if !s.cfg.DevMode {
		return rt
	}
	gen := s.cfg.Generation
	dev := map[string]*route{
		"/pause":          {http.MethodPost, s.pause},
		"/resume":         {http.MethodPost, s.resume},
		"/is_paused":      {http.MethodGet, s.isPaused},
		"/get_world_size": {http.MethodGet, s.worldSize},
		gen.initPath():    {http.MethodPost, s.timed("init", s.initTransfer)},
		"/update_weights": {http.MethodPost, s.timed("update", s.updateWeights)},
		// Stock vLLM's dev-mode routes, on every generation and backend.
		"/collective_rpc": {http.MethodPost, s.collectiveRPC},
		"/server_info":    {http.MethodGet, s.serverInfo},
	}
	if gen == GenA {
		dev["/finalize_weight_update"] = &route{http.MethodPost, s.finalizeUpdate}
	}
	if gen.hasSessions() {
		dev["/start_weight_update"] = &route{http.MethodPost, s.timed("start", s.startUpdate)}
		dev["/finish_weight_update"] = &route{http.MethodPost, s.timed("finish", s.finishUpdate)}
		dev["/update_weight_version"] = &route{http.MethodPost, s.updateVersion}
		dev["/weight_info"] = &route{http.MethodGet, s.weightInfo}
		dev["/abort_requests"] = &route{http.MethodPost, s.abortRequests}
		if !s.cfg.NoWeightChecker {
			dev["/weight_checker"] = &route{http.MethodPost, s.weightChecker}
		}
	}
	for p, r := range dev {
		rt[p] = r
	}
	return rt
}

// Routes lists the served "METHOD /path" routes, sorted.
func (s *Server) Routes() []string {
	out := make([]string, 0, len(s.routes))
	for p, r := range s.routes {
		out = append(out, r.method+" "+p)
	}
	sort.Strings(out)
	return out
}

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	rt, ok := s.routes[r.URL.Path]
	key := r.Method + " " + r.URL.Path
	if !ok {
		key = unknownRoute // arbitrary paths must not grow the map without bound
	}
	s.count(func(st *Stats) { st.Requests[key]++ })
	if !ok {
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
		return
	}
	if r.Method != rt.method {
		w.Header().Set("Allow", rt.method)
		writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"detail": "Method Not Allowed"})
		return
	}
	if s.injectFaults(w, r) {
		return
	}
	rt.serve(w, r)
}

// injectFaults applies the configured faults; it reports whether the
// request was consumed.
func (s *Server) injectFaults(w http.ResponseWriter, r *http.Request) bool {
	f := s.cfg.Faults
	if s.chance(rate(f.DropRate, r.URL.Path)) {
		s.count(func(st *Stats) { st.Faults["drop"]++ })
		hj, ok := w.(http.Hijacker)
		if !ok {
			errorResponse(w, http.StatusInternalServerError, "double: drop fault: the connection cannot be hijacked")
			return true
		}
		if conn, _, err := hj.Hijack(); err == nil {
			conn.Close()
		}
		return true
	}
	if s.chance(rate(f.ErrorRate, r.URL.Path)) {
		s.count(func(st *Stats) { st.Faults["error"]++ })
		errorResponse(w, http.StatusInternalServerError, "double: injected fault (Faults.ErrorRate)")
		return true
	}
	if f.SlowBy > 0 && s.chance(rate(f.SlowRate, r.URL.Path)) {
		s.count(func(st *Stats) { st.Faults["slow"]++ })
		if sleep(r.Context(), f.SlowBy) != nil {
			return true // the client is gone
		}
	}
	return false
}

func rate(m map[string]float64, path string) float64 {
	if p, ok := m[path]; ok {
		return p
	}
	return m["*"]
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// writeJSON answers with v; the error is the write's (the client's
// connection failed). The length is set, so a flush after it puts the
// whole response on the wire.
func writeJSON(w http.ResponseWriter, status int, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b = []byte(`{"error":{"message":"double: encode response","type":"InternalServerError","param":null,"code":500}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, err = w.Write(b)
	return err
}

// errorResponse writes vLLM's OpenAI-style ErrorResponse, the shape its
// exception handlers give HTTPException and validation errors. For worker
// exceptions real vLLM may answer with less detail; the double names the
// Python exception it emulates so tests can see why.
func errorResponse(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{
		"message": msg,
		"type":    errorType(status),
		"param":   nil,
		"code":    status,
	}})
}

func errorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusUnauthorized:
		return "AuthenticationError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusConflict:
		return "ConflictError"
	case http.StatusRequestEntityTooLarge:
		return "RequestEntityTooLarge"
	}
	return "InternalServerError"
}

// httpError is a failure with its status, raised inside handlers.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func badRequest(format string, args ...any) *httpError {
	return &httpError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

// workerError is what a Python exception raised in a vLLM worker becomes: 500.
func workerError(format string, args ...any) *httpError {
	return &httpError{http.StatusInternalServerError, fmt.Sprintf(format, args...)}
}

func fail(w http.ResponseWriter, err error) {
	var he *httpError
	if errors.As(err, &he) {
		errorResponse(w, he.status, he.msg)
		return
	}
	errorResponse(w, http.StatusInternalServerError, err.Error())
}

// readBody reads the whole bounded body; "" when there is none.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return nil, &httpError{http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", mbe.Limit)}
	}
	if err != nil {
		return nil, badRequest("read request body: %v", err)
	}
	return b, nil
}

// jsonObject parses body as FastAPI's `await request.json()` would, then
// requires a JSON object (Python would fail on `.get` of anything else).
// An empty body is invalid JSON, as in Python.
func jsonObject(body []byte) (map[string]json.RawMessage, error) {
	if !json.Valid(body) {
		return nil, badRequest("Invalid JSON format")
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil || obj == nil {
		return nil, workerError("AttributeError: '%s' object has no attribute 'get'", pyType(body))
	}
	return obj, nil
}

// pyType names the Python type json.loads gives a JSON text.
func pyType(raw []byte) string {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 {
		return "NoneType"
	}
	switch t[0] {
	case '{':
		return "dict"
	case '[':
		return "list"
	case '"':
		return "str"
	case 't', 'f':
		return "bool"
	case 'n':
		return "NoneType"
	}
	if bytes.ContainsAny(t, ".eE") {
		return "float"
	}
	return "int"
}

// onlyKeys enforces the double's strictness on a request body's top level.
// Real vLLM ignores unknown top-level keys (it reads body.get(...)); the
// double refuses them to catch client bugs before they meet a real server.
func onlyKeys(obj map[string]json.RawMessage, allowed ...string) error {
	var extra []string
	for k := range obj {
		if !contains(allowed, k) {
			extra = append(extra, k)
		}
	}
	if len(extra) == 0 {
		return nil
	}
	sort.Strings(extra)
	return workerError("double: unexpected key(s) %s in request body (allowed: %s); real vLLM ignores them, the double rejects them to catch client bugs",
		quoteList(extra), quoteList(allowed))
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func quoteList(list []string) string {
	if len(list) == 0 {
		return "none"
	}
	q := make([]string, len(list))
	for i, s := range list {
		q[i] = "'" + s + "'"
	}
	return strings.Join(q, ", ")
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(bytes.TrimSpace(raw)) == "null"
}
