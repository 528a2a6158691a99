package vllm

import (
	"context"
	"encoding/json"
	"math"
	"net/http"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// CollectiveRPC runs method on every worker of the server (POST
// /collective_rpc, a dev-mode route of stock vLLM) and returns each
// worker's result, in worker order. args and kwargs may be nil. timeout is
// both this call's deadline and the RPC timeout the server applies (its
// body's "timeout", in seconds), so the server gives up no later than the
// client. Never retried: the method may change the workers' state.
func (c *Client) CollectiveRPC(ctx context.Context, method string, args []any, kwargs map[string]any, timeout time.Duration) ([]json.RawMessage, error) {
	cl := call{method: http.MethodPost, path: "/collective_rpc", timeout: timeout, timeoutOf: "Update"}
	if method == "" {
		return nil, c.errorf(cl, 0, nil, "method is empty")
	}
	if timeout <= 0 {
		return nil, c.errorf(cl, 0, nil, "collective_rpc %s: timeout %v must be positive", method, timeout)
	}
	body := map[string]any{"method": method, "timeout": math.Ceil(timeout.Seconds())}
	if args != nil {
		body["args"] = args
	}
	if kwargs != nil {
		body["kwargs"] = kwargs
	}
	var out struct {
		Results *[]json.RawMessage `json:"results"`
	}
	if _, err := c.do(ctx, withBody(cl, body), &out); err != nil {
		return nil, err
	}
	if out.Results == nil || len(*out.Results) == 0 {
		return nil, c.errorf(cl, http.StatusOK, nil, "collective_rpc %s: the answer has no per-worker results", method)
	}
	return *out.Results, nil
}

// HasCollectiveRPC reports whether the server has POST /collective_rpc
// (stock vLLM with VLLM_SERVER_DEV_MODE=1), probed side-effect free like
// the generation (a GET answered 405 means the POST route exists).
func (c *Client) HasCollectiveRPC(ctx context.Context) (bool, error) {
	return c.routeExists(ctx, "/collective_rpc")
}

// LoadFormatAuto is the load format a checkpoint reload needs.
const LoadFormatAuto = "auto"

// UseCheckpointLoadFormat sets every worker's load format to auto
// (collective_rpc update_config): a server started with --load-format dummy
// would otherwise "reload" by drawing new random weights and answer
// success. Idempotent on the server's side, but not retried here.
func (c *Client) UseCheckpointLoadFormat(ctx context.Context) error {
	_, err := c.CollectiveRPC(ctx, "update_config",
		[]any{map[string]any{"load_config": map[string]any{"load_format": LoadFormatAuto}}}, nil, c.opts.Timeouts.control())
	return err
}

// ReloadWeights makes every worker load the checkpoint directory dir
// (collective_rpc reload_weights with is_checkpoint_format): stock vLLM's
// one way to load a checkpoint into a running server. It bypasses the
// weight-transfer session: no start/finish, no version, no cache clear, so
// the caller pauses first (which clears the cache), sets the version after
// (UpdateWeightVersion) and verifies. checkpointBytes sizes the deadline
// like UpdateWeights. Never retried.
func (c *Client) ReloadWeights(ctx context.Context, dir string, checkpointBytes int64) error {
	cl := call{method: http.MethodPost, path: "/collective_rpc"}
	if !filepath.IsAbs(dir) {
		return c.errorf(cl, 0, nil, "reload_weights: weights_path %q must be absolute (every worker resolves it)", dir)
	}
	_, err := c.CollectiveRPC(ctx, "reload_weights", nil,
		map[string]any{"weights_path": dir, "is_checkpoint_format": true}, c.opts.Timeouts.update(checkpointBytes))
	return err
}

// ServerInfo is what GET /server_info (dev mode) says about the server's
// configuration as it started: a worker-side change (update_config) does
// not show here.
type ServerInfo struct {
	// LoadFormat is load_config.load_format ("auto", "dummy", ...); "" when
	// the answer does not say.
	LoadFormat string
	// WeightTransferBackend is weight_transfer_config.backend ("nccl",
	// "ipc", the draft "disk", ...); "" when the answer does not say.
	WeightTransferBackend string
}

// ServerInfo reads GET /server_info?config_format=json. ok is false when the
// server has no such route (404: dev mode off, or a build without it).
// Builds that ignore config_format answer the text form (str(VllmConfig));
// the two fields are read from either.
func (c *Client) ServerInfo(ctx context.Context) (info ServerInfo, ok bool, err error) {
	cl := call{method: http.MethodGet, path: "/server_info", query: url.Values{"config_format": {"json"}},
		timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	var v struct {
		VLLMConfig json.RawMessage `json:"vllm_config"`
	}
	status, err := c.do(ctx, cl, &v)
	if status == http.StatusNotFound {
		return ServerInfo{}, false, nil
	}
	if err != nil {
		return ServerInfo{}, false, err
	}
	if len(v.VLLMConfig) == 0 || string(v.VLLMConfig) == "null" {
		return ServerInfo{}, false, c.errorf(cl, status, nil, "the answer has no vllm_config")
	}
	var text string
	if json.Unmarshal(v.VLLMConfig, &text) == nil {
		return serverInfoFromText(text), true, nil
	}
	var cfg struct {
		LoadConfig *struct {
			LoadFormat json.RawMessage `json:"load_format"`
		} `json:"load_config"`
		WeightTransferConfig *struct {
			Backend json.RawMessage `json:"backend"`
		} `json:"weight_transfer_config"`
	}
	if err := json.Unmarshal(v.VLLMConfig, &cfg); err != nil {
		return ServerInfo{}, false, c.errorf(cl, status, err, "vllm_config is neither text nor an object: %v", err)
	}
	if cfg.LoadConfig != nil {
		info.LoadFormat = enumText(cfg.LoadConfig.LoadFormat)
	}
	if cfg.WeightTransferConfig != nil {
		info.WeightTransferBackend = enumText(cfg.WeightTransferConfig.Backend)
	}
	return info, true, nil
}

// enumText reads a config value that is a string, or an enum serialised
// as its repr ("LoadFormat.DUMMY") or value; "" otherwise.
func enumText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return normalizeEnum(s)
}

// normalizeEnum turns "LoadFormat.DUMMY", "<LoadFormat.DUMMY: 'dummy'>" and
// "'dummy'" into "dummy".
func normalizeEnum(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndex(s, ": "); strings.HasPrefix(s, "<") && i > 0 {
		s = strings.TrimSuffix(s[i+2:], ">")
	}
	s = strings.Trim(s, `'"`)
	if i := strings.LastIndexByte(s, '.'); i >= 0 && !strings.ContainsAny(s, "/ ") {
		s = s[i+1:]
	}
	return strings.ToLower(s)
}

var (
	textLoadFormat = regexp.MustCompile(`\bload_format=(<[^>]*>|'[^']*'|"[^"]*"|[A-Za-z0-9_.]+)`)
	textBackend    = regexp.MustCompile(`\bweight_transfer_config=[A-Za-z]*\(backend=('[^']*'|"[^"]*"|[A-Za-z0-9_.]+)`)
)

// serverInfoFromText reads the fields from str(VllmConfig).
func serverInfoFromText(s string) ServerInfo {
	var info ServerInfo
	if m := textLoadFormat.FindStringSubmatch(s); m != nil {
		info.LoadFormat = normalizeEnum(m[1])
	}
	if m := textBackend.FindStringSubmatch(s); m != nil {
		info.WeightTransferBackend = normalizeEnum(m[1])
	}
	return info
}

// Version returns the server's vLLM version (GET /version), read once and
// remembered; the generation probe reads it too.
func (c *Client) Version(ctx context.Context) (string, error) {
	c.mu.Lock()
	v := c.version
	c.mu.Unlock()
	if v != "" {
		return v, nil
	}
	cl := call{method: http.MethodGet, path: "/version", timeout: c.opts.Timeouts.control(), idempotent: true, timeoutOf: "Control"}
	var out struct {
		Version string `json:"version"`
	}
	if _, err := c.do(ctx, cl, &out); err != nil {
		return "", err
	}
	if out.Version == "" {
		return "", c.errorf(cl, http.StatusOK, nil, "the answer has no version")
	}
	c.mu.Lock()
	c.version = out.Version
	c.mu.Unlock()
	return out.Version, nil
}
