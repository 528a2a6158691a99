package double

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// weightState is the weight-transfer state of the server (guarded by Server.mu).
type weightState struct {
	version  string // "" until the first finished update or update_weight_version
	finished int    // finished updates: the version when none is given
	session  bool   // a C/D/E update session is open
	loaded   bool   // disk: this session already took its checkpoint
	// checkpointFormat: this session's start carried is_checkpoint_format
	// (D/E nccl: the streaming that follows would hang in vLLM).
	checkpointFormat bool
	init             *NCCLInit
	pickleModule     string // module the last init's pickled id named
	loadFormat       string // the workers' load format (update_config)
	ipcRefs          IPCRefs
}

const (
	defaultPackedBufferSize = 1 << 30 // vLLM's packed_buffer_size_bytes default
	defaultPackedNumBuffers = 2
)

func (s *Server) health(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }

func (s *Server) version(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": s.cfg.Version})
}

// pause serves POST /pause with the query parameters the generation's
// router declares: mode (abort, wait or keep; default abort) from B on, and
// the boolean wait_for_inflight_requests (true means wait) and clear_cache.
// E removed wait_for_inflight_requests, A had no mode; FastAPI ignores the
// parameters a route does not declare, so those do not count there.
func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	mode := pauseAbort
	if s.cfg.Generation.pauseHasMode() && q.Has("mode") {
		mode = q.Get("mode")
		if mode != pauseAbort && mode != pauseWait && mode != pauseKeep {
			errorResponse(w, http.StatusBadRequest, fmt.Sprintf("query.mode: Input should be 'abort', 'wait' or 'keep', got %q", mode))
			return
		}
	}
	bools := []string{"wait_for_inflight_requests", "clear_cache"}
	if s.cfg.Generation.routerValidates() {
		bools = bools[1:]
	}
	for _, name := range bools {
		if q.Has(name) {
			b, ok := parseBool(q.Get(name))
			if !ok {
				errorResponse(w, http.StatusBadRequest, fmt.Sprintf("query.%s: Input should be a valid boolean, got %q", name, q.Get(name)))
				return
			}
			if name == "wait_for_inflight_requests" && b { // A's spelling, B-D's deprecated one, of mode=wait
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
// "update_info"): 400 for bad JSON or a missing/null key, as vLLM; a
// non-object body is a 500 on B-D and a 400 on E (bodyObject).
func (s *Server) infoBody(w http.ResponseWriter, r *http.Request, name string) (json.RawMessage, error) {
	body, err := s.readBody(w, r)
	if err != nil {
		return nil, err
	}
	obj, err := s.bodyObject(body)
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
	obj, err := s.bodyObject(body)
	if err != nil {
		return nil, err
	}
	return obj, onlyKeys(obj, allowed...)
}

// bodyObject parses body as FastAPI's `await request.json()` would, then
// requires a JSON object: B-D fail on `.get` of anything else inside the
// handler (500); E's router refuses it first (400). An empty body is
// invalid JSON, as in Python.
func (s *Server) bodyObject(body []byte) (map[string]json.RawMessage, error) {
	obj, err := jsonObject(body)
	var he *httpError
	if err != nil && s.cfg.Generation.routerValidates() && errors.As(err, &he) && he.status == http.StatusInternalServerError {
		return nil, badRequest("Request body must be a JSON object, got %s", pyType(body))
	}
	return obj, err
}

// isObject and isObjectList tell E's router's body shapes apart.
func isObject(raw json.RawMessage) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal(raw, &m) == nil && m != nil
}

func isObjectList(raw json.RawMessage) bool {
	var l []json.RawMessage
	if json.Unmarshal(raw, &l) != nil || l == nil {
		return false
	}
	for _, e := range l {
		if !isObject(e) {
			return false
		}
	}
	return true
}

func (s *Server) initTransfer(w http.ResponseWriter, r *http.Request) {
	raw, err := s.infoBody(w, r, "init_info")
	if err == nil && s.cfg.Generation.routerValidates() && !isObject(raw) {
		err = badRequest("'init_info' must be a JSON object, got %s", pyType(raw))
	}
	if err != nil {
		fail(w, err)
		return
	}
	if s.cfg.Backend == BackendDisk || s.cfg.Backend == BackendIPC { // nothing to set up
		payload := diskInitInfo
		if s.cfg.Backend == BackendIPC {
			payload = ipcInitInfo
		}
		if _, err := payload.decode(raw); err != nil {
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
	ckptFormat := false
	if err == nil {
		if v, ok := obj["is_checkpoint_format"]; ok && !isNull(v) {
			if !hasKind(v, kBool) {
				err = workerError("ValueError: is_checkpoint_format must be a boolean, got %s", clip(string(v)))
			}
			ckptFormat = true
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
		s.wstate.checkpointFormat = ckptFormat && s.cfg.Generation.packedInInit() && s.cfg.Backend == BackendNCCL
	}
	s.mu.Unlock()
	if open {
		fail(w, workerError("RuntimeError: a weight update session is already open; call finish_weight_update first"))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight update started"})
}

// updateWeights serves update_weights. On E a failure answered 500 (one
// that reached the engine) closes the open session, as E's worker does.
func (s *Server) updateWeights(w http.ResponseWriter, r *http.Request) {
	raw, err := s.infoBody(w, r, "update_info")
	if err == nil && s.cfg.Generation.routerValidates() && !isObject(raw) && !isObjectList(raw) {
		err = badRequest("'update_info' must be a JSON object or a list of JSON objects, got %s", pyType(raw))
	}
	if err == nil {
		s.xferMu.Lock()
		err = s.applyUpdate(r, raw)
		s.xferMu.Unlock()
	}
	var he *httpError
	if err != nil && s.cfg.Generation.closesFailedSession() && (!errors.As(err, &he) || he.status == http.StatusInternalServerError) {
		s.mu.Lock()
		s.wstate.session = false
		s.mu.Unlock()
	}
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weights updated"})
}

// applyUpdate runs one update_weights on the workers (Server.xferMu held).
func (s *Server) applyUpdate(r *http.Request, raw json.RawMessage) error {
	payload := s.backendPayload()
	if s.cfg.Generation.routerValidates() && isObjectList(raw) { // E: one entry per worker
		var err error
		if raw, err = s.onePayload(raw, payload); err != nil {
			return err
		}
	}
	sessions := s.cfg.Generation.hasSessions()
	s.mu.Lock()
	open, loaded, ckptFormat := s.wstate.session, s.wstate.loaded, s.wstate.checkpointFormat
	s.mu.Unlock()
	if sessions && !open {
		return workerError("RuntimeError: update_weights called without an open weight update session; call start_weight_update first")
	}
	if ckptFormat {
		// The double answers at once where current vLLM builds hang.
		return workerError("RuntimeError: double: start_weight_update was sent is_checkpoint_format, which makes current vLLM builds hang the NCCL streaming of update_weights (the double fails instead); a trainer must never send it to an nccl backend")
	}
	info, err := payload.decode(raw)
	if err != nil {
		return err
	}
	var m *bigram.Model
	switch s.cfg.Backend {
	case BackendDisk:
		if loaded {
			return workerError("RuntimeError: this weight update session already loaded a checkpoint; the disk backend takes exactly one per session")
		}
		path, _ := get[string](info, "path")
		if m, err = loadCheckpointDir("update_info.path", path); err != nil {
			return err
		}
	case BackendIPC:
		if m, err = s.receiveIPC(info); err != nil {
			return err
		}
	default:
		if m, err = s.receiveNCCL(r.Context(), info); err != nil {
			return err
		}
	}
	s.model.Store(m)
	s.mu.Lock()
	s.wstate.loaded = true
	if !sessions { // A, B: one call is the whole update
		s.wstate.finished++
		s.wstate.version = strconv.Itoa(s.wstate.finished)
	}
	s.mu.Unlock()
	return nil
}

// backendPayload is the update_info class of the server's backend.
func (s *Server) backendPayload() dataclass {
	switch s.cfg.Backend {
	case BackendDisk:
		return diskUpdateInfo
	case BackendIPC:
		return ipcUpdateInfo
	}
	return ncclUpdateInfo(s.cfg.Generation)
}

// onePayload reduces E's per-worker update_info list to the one payload
// the double's single model can take: one entry per inference worker
// (index data_parallel_index*(TP*PP) + rank), each valid as the object
// form, all equal.
func (s *Server) onePayload(raw json.RawMessage, payload dataclass) (json.RawMessage, error) {
	var entries []json.RawMessage
	if err := json.Unmarshal(raw, &entries); err != nil {
		return nil, badRequest("'update_info' must be a JSON object or a list of JSON objects")
	}
	workers := s.cfg.WorldSize * s.cfg.DataParallel
	if len(entries) != workers {
		return nil, workerError("ValueError: update_info has %d entries but the server has %d inference workers (data_parallel_size %d x tensor_parallel_size*pipeline_parallel_size %d); send one entry per worker, or one object for all",
			len(entries), workers, s.cfg.DataParallel, s.cfg.WorldSize)
	}
	var first any
	for i, e := range entries {
		if _, err := payload.decode(e); err != nil {
			var he *httpError
			if errors.As(err, &he) {
				return nil, &httpError{he.status, fmt.Sprintf("%s (update_info[%d])", he.msg, i)}
			}
			return nil, err
		}
		var v any
		if err := json.Unmarshal(e, &v); err != nil {
			return nil, badRequest("update_info[%d]: %v", i, err)
		}
		if i == 0 {
			first = v
		} else if !reflect.DeepEqual(first, v) {
			return nil, workerError("double: update_info[0] and update_info[%d] differ: the vLLM double serves one model for all its workers and does not support differing per-worker payloads (a double limitation; real vLLM gives each worker its own entry)", i)
		}
	}
	return entries[0], nil
}

// loadCheckpointDir loads the bigram tensor from an absolute directory of
// *.safetensors, as vLLM's disk backend and reload_weights require; field
// names the request field in errors.
func loadCheckpointDir(field, path string) (*bigram.Model, error) {
	if !filepath.IsAbs(path) {
		return nil, workerError("ValueError: %s %q must be an absolute directory", field, path)
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, workerError("FileNotFoundError: %s %q: %v", field, path, errors.Unwrap(err))
	}
	if !st.IsDir() {
		return nil, workerError("NotADirectoryError: %s %q is not a directory", field, path)
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
		s.wstate.session, s.wstate.checkpointFormat = false, false
		s.wstate.finished++
		s.wstate.version = label
		if label == "" {
			s.wstate.version = strconv.Itoa(s.wstate.finished)
		}
	}
	s.mu.Unlock()
	if !open {
		fail(w, workerError("%s", noSessionToFinish(s.cfg.Generation)))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight update finished"})
}

// finalizeUpdate serves A's POST /finalize_weight_update. vLLM's workers
// run process_weights_after_loading there (quantization and kernel
// layouts), which the bigram table needs none of, and keep no state for
// it: it may come at any time, also before any update. A's route reads no
// body, so vLLM ignores whatever is sent; the double takes none or {} and
// refuses anything else with a 400, to catch a client that means to send
// something (say a weight_version A has no place for).
func (s *Server) finalizeUpdate(w http.ResponseWriter, r *http.Request) {
	body, err := s.readBody(w, r)
	if err != nil {
		fail(w, err)
		return
	}
	if len(bytes.TrimSpace(body)) > 0 {
		keys, _, err := orderedObject(body)
		var got string
		switch {
		case !json.Valid(body):
			got = "invalid JSON"
		case err != nil:
			got = "a " + pyType(body)
		case len(keys) > 0:
			got = "an object with key(s) " + quoteList(keys)
		}
		if got != "" {
			errorResponse(w, http.StatusBadRequest, fmt.Sprintf("double: /finalize_weight_update takes no body or {}, got %s; real vLLM of generation A reads none and ignores it, the double refuses it to catch client bugs", got))
			return
		}
	}
	// It runs after any running init or update, as vLLM's engine runs
	// worker calls one after another.
	s.xferMu.Lock()
	defer s.xferMu.Unlock()
	writeJSON(w, http.StatusOK, map[string]string{"message": "Weight update finalized"})
}

// noSessionToFinish is finish_weight_update's error without an open
// session. E's text is the one a client sees after E closed a failed
// update's session itself.
func noSessionToFinish(g Generation) string {
	if g.closesFailedSession() {
		return "RuntimeError: finish_weight_update called without a matching start_weight_update"
	}
	return "RuntimeError: finish_weight_update called without an open weight update session"
}

func (s *Server) updateVersion(w http.ResponseWriter, r *http.Request) {
	body, err := s.readBody(w, r)
	var obj map[string]json.RawMessage
	if err == nil {
		obj, err = s.bodyObject(body)
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
