package double

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// Worker methods the double implements for POST /collective_rpc.
const (
	rpcUpdateConfig  = "update_config"
	rpcReloadWeights = "reload_weights"
)

// rpcCall is a validated /collective_rpc body.
type rpcCall struct {
	method     string
	args       []json.RawMessage
	kwargs     map[string]json.RawMessage
	kwargOrder []string // as sent: Python names the first unexpected keyword
}

// collectiveRPC serves POST /collective_rpc (dev mode, every generation and
// backend), stock vLLM's way to run a method on every worker:
//
//	{"method": str, "args": list, "kwargs": object, "timeout": number|null}
//	-> 200 {"results": [one per worker]}  (WorldSize x DataParallel entries, null each)
//
// A malformed body is a 400; an error raised in a worker (an unknown
// method, bad arguments, a failed load) is a 500. The double's workers
// implement two methods:
//   - update_config with args [{"load_config": {"load_format": "auto"|"dummy"}}]
//     sets the workers' load format (GET /server_info still reports the
//     one the server started with);
//   - reload_weights with kwargs {"weights_path": "/abs/dir",
//     "is_checkpoint_format": true} loads a checkpoint directory (the disk
//     backend's checks), bypassing the weight-transfer session: no
//     start/finish, the version unchanged, no cache cleared, not counted on
//     /metrics. Without weights_path it reloads the model the server
//     started from, as vLLM reloads its model path. While the workers'
//     load format is dummy it redraws the dummy weights instead, as vLLM's
//     DummyModelLoader does, and still answers 200: the trap a client
//     avoids with update_config first.
//
// The RPC runs after any running init or update (Server.xferMu), as
// vLLM's engine runs worker RPCs one after another; its timeout is
// validated but the double's methods finish at once.
func (s *Server) collectiveRPC(w http.ResponseWriter, r *http.Request) {
	c, err := s.rpcRequest(w, r)
	if err != nil {
		fail(w, err)
		return
	}
	s.xferMu.Lock()
	switch c.method {
	case rpcUpdateConfig:
		err = s.updateConfig(c)
	case rpcReloadWeights:
		err = s.reloadWeights(c)
	default:
		err = workerError("AttributeError: 'Worker' object has no attribute '%s' (the vLLM double's workers implement %s and %s)",
			clip(c.method), rpcUpdateConfig, rpcReloadWeights)
	}
	s.xferMu.Unlock()
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"results": make([]any, s.cfg.WorldSize*s.cfg.DataParallel)})
}

// rpcRequest validates a /collective_rpc body (every failure a 400). vLLM
// reads the body with body.get(...): it ignores unknown keys and a
// non-object body fails as a 500. The double refuses both with a 400, so
// that a misspelt key (say "kwarg") is not silently dropped: a
// reload_weights without its weights_path would reload the server's
// original model and answer 200.
func (s *Server) rpcRequest(w http.ResponseWriter, r *http.Request) (rpcCall, error) {
	var c rpcCall
	body, err := s.readBody(w, r)
	if err != nil {
		return c, err
	}
	var probe any
	if err := json.Unmarshal(body, &probe); err != nil {
		return c, badRequest("JSON decode error: %v", err)
	}
	_, obj, err := orderedObject(body)
	if err != nil {
		return c, badRequest("Request body must be a JSON object, got %s", pyType(body))
	}
	if err := onlyKeys(obj, "method", "args", "kwargs", "timeout"); err != nil {
		return c, badRequest("%v", err)
	}
	raw, ok := obj["method"]
	switch {
	case !ok || isNull(raw):
		return c, badRequest("Missing 'method' in request body")
	case json.Unmarshal(raw, &c.method) != nil:
		return c, badRequest("'method' must be a string, got %s", clip(string(raw)))
	}
	if raw := obj["args"]; !isNull(raw) {
		if json.Unmarshal(raw, &c.args) != nil || c.args == nil {
			return c, badRequest("'args' must be a list, got %s", clip(string(raw)))
		}
	}
	c.kwargs = map[string]json.RawMessage{}
	if raw := obj["kwargs"]; !isNull(raw) {
		if c.kwargOrder, c.kwargs, err = orderedObject(raw); err != nil {
			return c, badRequest("'kwargs' must be an object, got %s", clip(string(raw)))
		}
	}
	if raw := obj["timeout"]; !isNull(raw) {
		var t float64
		if json.Unmarshal(raw, &t) != nil || !(t > 0) {
			return c, badRequest("'timeout' must be a positive number of seconds or null, got %s", clip(string(raw)))
		}
	}
	return c, nil
}

// updateConfigShape is the one update_config call the double knows.
const updateConfigShape = `args [{"load_config": {"load_format": "auto"}}] (or "dummy") and no kwargs`

// updateConfig is Worker.update_config for the one override the double
// has: load_config.load_format.
func (s *Server) updateConfig(c rpcCall) error {
	if len(c.args) != 1 || len(c.kwargs) != 0 {
		return workerError("double: update_config takes %s; got %d args and %d kwargs", updateConfigShape, len(c.args), len(c.kwargs))
	}
	keys, overrides, err := orderedObject(c.args[0])
	if err != nil {
		return workerError("double: update_config takes %s; args[0] is %s", updateConfigShape, pyType(c.args[0]))
	}
	lcRaw, ok := overrides["load_config"]
	if !ok || len(overrides) != 1 {
		return workerError("double: update_config: the vLLM double can change only load_config.load_format; got overrides %s", quoteList(keys))
	}
	lcKeys, lc, err := orderedObject(lcRaw)
	if err != nil || len(lc) != 1 || lc["load_format"] == nil {
		return workerError("double: update_config: the vLLM double can change only load_config.load_format; got load_config %s", clipKeys(lcKeys, lcRaw))
	}
	var format string
	if json.Unmarshal(lc["load_format"], &format) != nil || (format != LoadFormatAuto && format != LoadFormatDummy) {
		return workerError("double: update_config: load_format %s: the vLLM double knows only %q and %q", clip(string(lc["load_format"])), LoadFormatAuto, LoadFormatDummy)
	}
	s.mu.Lock()
	s.wstate.loadFormat = format
	s.mu.Unlock()
	return nil
}

func clipKeys(keys []string, raw json.RawMessage) string {
	if keys == nil {
		return clip(string(raw))
	}
	return quoteList(keys)
}

// reloadWeights is Worker.reload_weights with keyword arguments
// weights_path and is_checkpoint_format (false means the weights are in
// the model's own layout, which for the bigram table is the checkpoint's).
func (s *Server) reloadWeights(c rpcCall) error {
	if len(c.args) > 0 {
		return workerError("TypeError: double: reload_weights takes keyword arguments (weights_path, is_checkpoint_format), got %d positional", len(c.args))
	}
	for _, k := range c.kwargOrder {
		if k != "weights_path" && k != "is_checkpoint_format" {
			return workerError("TypeError: Worker.reload_weights() got an unexpected keyword argument '%s'", clip(k))
		}
	}
	var path string
	hasPath := !isNull(c.kwargs["weights_path"])
	if hasPath && json.Unmarshal(c.kwargs["weights_path"], &path) != nil {
		return workerError("ValueError: reload_weights: weights_path must be a string, got %s", clip(string(c.kwargs["weights_path"])))
	}
	if v := c.kwargs["is_checkpoint_format"]; !isNull(v) && !hasKind(v, kBool) {
		return workerError("ValueError: reload_weights: is_checkpoint_format must be a boolean, got %s", clip(string(v)))
	}
	s.mu.Lock()
	format := s.wstate.loadFormat
	s.mu.Unlock()
	var m *bigram.Model
	var err error
	switch {
	case format == LoadFormatDummy: // the checkpoint is never read
		m = s.dummyWeights()
	case hasPath:
		m, err = loadCheckpointDir("weights_path", path)
	default:
		if m, err = bigram.Load(s.cfg.ModelPath); err != nil {
			err = workerError("RuntimeError: reload the model path %s: %v", s.cfg.ModelPath, err)
		}
	}
	if err != nil {
		return err
	}
	s.model.Store(m)
	return nil
}

// serverInfo serves GET /server_info (dev mode): query config_format text
// (default: vllm_config is a str(VllmConfig)-like line) or json (a
// VllmConfig-like object with the fields rlflow reads); vllm_env is empty.
// It reports the configuration the server STARTED with: update_config
// changes the workers, not this, as in vLLM, where the API server holds
// its own copy of the config. Another config_format is a 400: vLLM answers
// FastAPI's validation errors with 400, not FastAPI's default 422.
func (s *Server) serverInfo(w http.ResponseWriter, r *http.Request) {
	format := "text"
	if q := r.URL.Query(); q.Has("config_format") {
		format = q.Get("config_format")
	}
	var cfg any
	switch format {
	case "text":
		cfg = fmt.Sprintf("model=%s, served_model_name=%s, tensor_parallel_size=%d, pipeline_parallel_size=1, data_parallel_size=%d, load_format=%s, weight_transfer_config=WeightTransferConfig(backend=%s)",
			pyRepr(s.cfg.ModelPath), s.cfg.ModelName, s.cfg.WorldSize, s.cfg.DataParallel, s.cfg.LoadFormat, pyRepr(s.cfg.Backend))
	case "json":
		cfg = map[string]any{
			"model_config":           map[string]any{"model": s.cfg.ModelPath, "served_model_name": s.cfg.ModelName},
			"load_config":            map[string]any{"load_format": s.cfg.LoadFormat},
			"parallel_config":        map[string]any{"tensor_parallel_size": s.cfg.WorldSize, "pipeline_parallel_size": 1, "data_parallel_size": s.cfg.DataParallel},
			"weight_transfer_config": map[string]any{"backend": s.cfg.Backend},
		}
	default:
		errorResponse(w, http.StatusBadRequest, fmt.Sprintf("query.config_format: Input should be 'text' or 'json', got %q", clip(format)))
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"vllm_config": cfg, "vllm_env": map[string]any{}})
}

// pyRepr is Python's repr of a str (single-quoted).
func pyRepr(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}
