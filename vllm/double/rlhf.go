package double

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// weightState is the weight-transfer state of the server (guarded by Server.mu).
type weightState struct {
	version  string // "" until the first finished update or update_weight_version
	finished int    // finished updates: the version when none is given
	session  bool   // a C/D update session is open
	loaded   bool   // disk: this session already took its checkpoint
	init     *NCCLInit
	baseline map[string]string // weight_checker reset
}

const (
	defaultPackedBufferSize = 1 << 30 // vLLM's packed_buffer_size_bytes default
	defaultPackedNumBuffers = 2
)

func (s *Server) health(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }

// metrics serves the Prometheus text format with the one metric rlflow
// reads, process_start_time_seconds, written as prometheus_client's
// process collector writes it; each Server is a new process (StartTime).
func (s *Server) metrics(w http.ResponseWriter, _ *http.Request) {
	start := float64(s.started.UnixNano()) / 1e9
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	fmt.Fprintf(w, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"+
		"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %s\n", strconv.FormatFloat(start, 'e', -1, 64))
	// vLLM's weight-update histogram, as its newest builds export it: sum
	// and count per operation (the double keeps no buckets but +Inf).
	s.opsMu.Lock()
	defer s.opsMu.Unlock()
	if len(s.ops) == 0 {
		return
	}
	const name = "vllm:rl_weight_update_operation_duration_seconds"
	fmt.Fprintf(w, "# HELP %s Duration of weight update operations (TEST DOUBLE).\n# TYPE %s histogram\n", name, name)
	ops := make([]string, 0, len(s.ops))
	for op := range s.ops {
		ops = append(ops, op)
	}
	sort.Strings(ops)
	for _, op := range ops {
		o := s.ops[op]
		fmt.Fprintf(w, "%s_bucket{model_name=%q,operation=%q,le=\"+Inf\"} %d\n", name, s.cfg.ModelName, op, o.count)
		fmt.Fprintf(w, "%s_sum{model_name=%q,operation=%q} %s\n", name, s.cfg.ModelName, op, strconv.FormatFloat(o.sum, 'g', -1, 64))
		fmt.Fprintf(w, "%s_count{model_name=%q,operation=%q} %d\n", name, s.cfg.ModelName, op, o.count)
	}
}

// opStat is one weight-update operation's histogram sum and count.
type opStat struct {
	sum   float64
	count int
}

// timed records how long h takes under operation op, for /metrics.
func (s *Server) timed(op string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		h(w, r)
		s.opsMu.Lock()
		o := s.ops[op]
		o.sum += time.Since(start).Seconds()
		o.count++
		s.ops[op] = o
		s.opsMu.Unlock()
	}
}

func (s *Server) version(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": s.cfg.Version})
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	mode := q.Get("mode")
	if !q.Has("mode") {
		mode = pauseAbort
	}
	if mode != pauseAbort && mode != pauseWait && mode != pauseKeep {
		errorResponse(w, http.StatusBadRequest, fmt.Sprintf("query.mode: Input should be 'abort', 'wait' or 'keep', got %q", mode))
		return
	}
	for _, name := range []string{"wait_for_inflight_requests", "clear_cache"} {
		if q.Has(name) {
			b, ok := parseBool(q.Get(name))
			if !ok {
				errorResponse(w, http.StatusBadRequest, fmt.Sprintf("query.%s: Input should be a valid boolean, got %q", name, q.Get(name)))
				return
			}
			if name == "wait_for_inflight_requests" && b { // deprecated spelling of mode=wait
				mode = pauseWait
			}
		}
	}
	if err := s.sched.pause(r.Context(), mode); err != nil {
		// vLLM's pause route answers errors as {"error": "<text>"}.
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "Failed to pause generation: " + err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "paused"})
}

// parseBool accepts what FastAPI (pydantic) accepts for a bool query.
func parseBool(s string) (bool, bool) {
	switch strings.ToLower(s) {
	case "1", "true", "t", "yes", "y", "on":
		return true, true
	case "0", "false", "f", "no", "n", "off":
		return false, true
	}
	return false, false
}

func (s *Server) resume(w http.ResponseWriter, _ *http.Request) {
	s.sched.resume()
	writeJSON(w, http.StatusOK, map[string]string{"status": "resumed"})
}

func (s *Server) isPaused(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]bool{"is_paused": s.sched.isPaused()})
}

func (s *Server) worldSize(w http.ResponseWriter, r *http.Request) {
	include := true
	if q := r.URL.Query(); q.Has("include_dp") {
		b, ok := parseBool(q.Get("include_dp"))
		if !ok {
			errorResponse(w, http.StatusBadRequest, fmt.Sprintf("query.include_dp: Input should be a valid boolean, got %q", q.Get("include_dp")))
			return
		}
		include = b
	}
	n := s.cfg.WorldSize
	if include {
		n *= s.cfg.DataParallel
	}
	writeJSON(w, http.StatusOK, map[string]int{"world_size": n})
}

// infoBody reads a body holding exactly the one key name ("init_info",
// "update_info"): 400 for bad JSON or a missing/null key, as vLLM.
func (s *Server) infoBody(w http.ResponseWriter, r *http.Request, name string) (json.RawMessage, error) {
	body, err := s.readBody(w, r)
	if err != nil {
		return nil, err
	}
	obj, err := jsonObject(body)
	if err != nil {
		return nil, err
	}
	info, ok := obj[name]
	if !ok || isNull(info) {
		return nil, badRequest("Missing '%s' in request body", name)
	}
	if err := onlyKeys(obj, name); err != nil {
		return nil, err
	}
	return info, nil
}

// optionalBody parses a body that may be empty; a present body must be a
// JSON object with only the allowed keys.
func (s *Server) optionalBody(w http.ResponseWriter, r *http.Request, allowed ...string) (map[string]json.RawMessage, error) {
	body, err := s.readBody(w, r)
	if err != nil {
		return nil, err
	}
	if len(strings.TrimSpace(string(body))) == 0 {
		return map[string]json.RawMessage{}, nil
	}
	obj, err := jsonObject(body)
	if err != nil {
		return nil, err
	}
	return obj, onlyKeys(obj, allowed...)
}

func (s *Server) initTransfer(w http.ResponseWriter, r *http.Request) {
	raw, err := s.infoBody(w, r, "init_info")
	if err != nil {
		fail(w, err)
		return
	}
	if s.cfg.Backend == BackendDisk {
		if _, err := diskInitInfo.decode(raw); err != nil {
			fail(w, err)
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"message": "Weight transfer initialized"})
		return
	}
	info, err := ncclInitInfo(s.cfg.Generation).decode(raw)
	if err != nil {
		fail(w, err)
		return
	}
	s.xferMu.Lock()
	defer s.xferMu.Unlock()
	if err := s.initNCCL(r.Context(), info); err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight transfer initialized"})
}

func (s *Server) startUpdate(w http.ResponseWriter, r *http.Request) {
	obj, err := s.optionalBody(w, r, "is_checkpoint_format")
	if err == nil {
		if v, ok := obj["is_checkpoint_format"]; ok && !isNull(v) && !hasKind(v, kBool) {
			err = workerError("ValueError: is_checkpoint_format must be a boolean, got %s", clip(string(v)))
		}
	}
	if err != nil {
		fail(w, err)
		return
	}
	// Session changes wait for a running init or update, as vLLM's engine
	// runs these worker RPCs one after another.
	s.xferMu.Lock()
	defer s.xferMu.Unlock()
	s.mu.Lock()
	open := s.wstate.session
	if !open {
		s.wstate.session, s.wstate.loaded = true, false
	}
	s.mu.Unlock()
	if open {
		fail(w, workerError("RuntimeError: a weight update session is already open; call finish_weight_update first"))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight update started"})
}

func (s *Server) updateWeights(w http.ResponseWriter, r *http.Request) {
	raw, err := s.infoBody(w, r, "update_info")
	if err != nil {
		fail(w, err)
		return
	}
	s.xferMu.Lock()
	defer s.xferMu.Unlock()
	sessions := s.cfg.Generation != GenB
	s.mu.Lock()
	open, loaded := s.wstate.session, s.wstate.loaded
	s.mu.Unlock()
	if sessions && !open {
		fail(w, workerError("RuntimeError: update_weights called without an open weight update session; call start_weight_update first"))
		return
	}
	var m *bigram.Model
	if s.cfg.Backend == BackendDisk {
		info, err := diskUpdateInfo.decode(raw)
		if err == nil && loaded {
			err = workerError("RuntimeError: this weight update session already loaded a checkpoint; the disk backend takes exactly one per session")
		}
		if err == nil {
			path, _ := get[string](info, "path")
			m, err = loadCheckpointDir(path)
		}
		if err != nil {
			fail(w, err)
			return
		}
	} else {
		info, err := ncclUpdateInfo(s.cfg.Generation).decode(raw)
		if err == nil {
			m, err = s.receiveNCCL(r.Context(), info)
		}
		if err != nil {
			fail(w, err)
			return
		}
	}
	s.model.Store(m)
	s.mu.Lock()
	s.wstate.loaded = true
	if !sessions { // B: one call is the whole update
		s.wstate.finished++
		s.wstate.version = strconv.Itoa(s.wstate.finished)
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weights updated"})
}

// loadCheckpointDir loads the bigram tensor from an absolute directory of
// *.safetensors, as vLLM's disk backend requires.
func loadCheckpointDir(path string) (*bigram.Model, error) {
	if !filepath.IsAbs(path) {
		return nil, workerError("ValueError: update_info.path %q must be an absolute directory", path)
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, workerError("FileNotFoundError: update_info.path %q: %v", path, errors.Unwrap(err))
	}
	if !st.IsDir() {
		return nil, workerError("NotADirectoryError: update_info.path %q is not a directory", path)
	}
	m, err := bigram.Load(path)
	if err != nil {
		return nil, workerError("RuntimeError: load checkpoint %s: %v", path, err)
	}
	return m, nil
}

func (s *Server) finishUpdate(w http.ResponseWriter, r *http.Request) {
	obj, err := s.optionalBody(w, r, "weight_version")
	var label string
	if err == nil {
		if v, ok := obj["weight_version"]; ok && !isNull(v) {
			if json.Unmarshal(v, &label) != nil {
				err = workerError("ValueError: weight_version must be a string, got %s", clip(string(v)))
			}
		}
	}
	if err != nil {
		fail(w, err)
		return
	}
	s.xferMu.Lock()
	defer s.xferMu.Unlock()
	s.mu.Lock()
	open := s.wstate.session
	if open {
		s.wstate.session = false
		s.wstate.finished++
		s.wstate.version = label
		if label == "" {
			s.wstate.version = strconv.Itoa(s.wstate.finished)
		}
	}
	s.mu.Unlock()
	if !open {
		fail(w, workerError("RuntimeError: finish_weight_update called without an open weight update session"))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight update finished"})
}

func (s *Server) updateVersion(w http.ResponseWriter, r *http.Request) {
	body, err := s.readBody(w, r)
	var obj map[string]json.RawMessage
	if err == nil {
		obj, err = jsonObject(body)
	}
	var v string
	if err == nil {
		raw, ok := obj["new_version"]
		switch {
		case !ok || isNull(raw):
			err = badRequest("Missing 'new_version' in request body")
		case json.Unmarshal(raw, &v) != nil || v == "":
			err = badRequest("'new_version' must be a non-empty string, got %s", clip(string(raw)))
		default:
			err = onlyKeys(obj, "new_version")
		}
	}
	if err != nil {
		fail(w, err)
		return
	}
	s.mu.Lock()
	s.wstate.version = v
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight version updated", "weight_version": v})
}

func (s *Server) weightInfo(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	v := s.wstate.version
	s.mu.Unlock()
	var out any // null until a version exists, as vLLM's None
	if v != "" {
		out = v
	}
	writeJSON(w, http.StatusOK, map[string]any{"weight_version": out})
}

func (s *Server) abortRequests(w http.ResponseWriter, r *http.Request) {
	if _, err := s.optionalBody(w, r); err != nil {
		fail(w, err)
		return
	}
	n := s.sched.abortAll()
	writeJSON(w, http.StatusOK, map[string]any{"message": "Requests aborted", "aborted": n})
}

func (s *Server) checksums() map[string]string {
	return map[string]string{bigram.TensorName: s.model.Load().Checksum()}
}

func (s *Server) weightChecker(w http.ResponseWriter, r *http.Request) {
	body, err := s.readBody(w, r)
	var obj map[string]json.RawMessage
	if err == nil {
		obj, err = jsonObject(body)
	}
	var action string
	if err == nil {
		if raw, ok := obj["action"]; !ok || json.Unmarshal(raw, &action) != nil {
			err = badRequest("Missing 'action' in request body (checksum, reset or compare)")
		} else {
			err = onlyKeys(obj, "action", "baseline")
		}
	}
	if err != nil {
		fail(w, err)
		return
	}
	if s.sched.isPaused() {
		errorResponse(w, http.StatusConflict, "weight checker is unavailable while generation is paused; resume first")
		return
	}
	sums := s.checksums()
	switch action {
	case "checksum":
		writeJSON(w, http.StatusOK, map[string]any{"action": action, "checksums": sums})
	case "reset":
		s.mu.Lock()
		s.wstate.baseline = sums
		s.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"action": action, "checksums": sums})
	case "compare":
		base, err := s.baseline(obj["baseline"])
		if err != nil {
			fail(w, err)
			return
		}
		var mismatched []string
		for name, sum := range sums {
			if base[name] != sum {
				mismatched = append(mismatched, name)
			}
		}
		for name := range base {
			if _, ok := sums[name]; !ok {
				mismatched = append(mismatched, name)
			}
		}
		writeJSON(w, http.StatusOK, map[string]any{"action": action, "match": len(mismatched) == 0, "mismatched": nonNil(mismatched)})
	default:
		errorResponse(w, http.StatusBadRequest, fmt.Sprintf("unknown action %q: want checksum, reset or compare", action))
	}
}

// baseline reads a compare baseline: an earlier checksum answer
// ({"checksums": {...}}), a bare {name: checksum} map, or, when absent, the
// one recorded by the last reset.
func (s *Server) baseline(raw json.RawMessage) (map[string]string, error) {
	if isNull(raw) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.wstate.baseline == nil {
			return nil, badRequest("compare needs a baseline: pass one or call reset first")
		}
		return s.wstate.baseline, nil
	}
	var wrapped struct {
		Checksums map[string]string `json:"checksums"`
	}
	if json.Unmarshal(raw, &wrapped) == nil && wrapped.Checksums != nil {
		return wrapped.Checksums, nil
	}
	var bare map[string]string
	if json.Unmarshal(raw, &bare) == nil && bare != nil {
		return bare, nil
	}
	return nil, badRequest("baseline must be a checksum answer or a map of tensor name to checksum")
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
