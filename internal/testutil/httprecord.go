package testutil

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"sync"
)

// Recorder keeps every request a handler got, as "METHOD /path?query body"
// (the body trimmed), in arrival order: the exact request sequence a test
// compares with what a client must send.
type Recorder struct {
	mu   sync.Mutex
	reqs []string
}

// Wrap returns h recording into r.
func (r *Recorder) Wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		req.Body = io.NopCloser(bytes.NewReader(body))
		line := req.Method + " " + req.URL.Path
		if req.URL.RawQuery != "" {
			line += "?" + req.URL.RawQuery
		}
		if b := strings.TrimSpace(string(body)); b != "" {
			line += " " + b
		}
		r.mu.Lock()
		r.reqs = append(r.reqs, line)
		r.mu.Unlock()
		h.ServeHTTP(w, req)
	})
}

// Lines returns the requests recorded so far.
func (r *Recorder) Lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.reqs...)
}

// Take returns the requests recorded so far and forgets them.
func (r *Recorder) Take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.reqs
	r.reqs = nil
	return out
}
