package double_test

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

type testServer struct {
	*double.Server
	url string
	t   *testing.T
}

func start(t *testing.T, cfg double.Config) *testServer {
	t.Helper()
	s, err := double.New(cfg)
	require.NoError(t, err)
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	return &testServer{Server: s, url: hs.URL, t: t}
}

// call sends body ("" for none) and returns the status and raw answer.
func (s *testServer) call(method, path, body string) (int, string) {
	s.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, s.url+path, rd)
	require.NoError(s.t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(s.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(s.t, err)
	return resp.StatusCode, string(b)
}

func (s *testServer) ok(method, path, body string) string {
	s.t.Helper()
	status, out := s.call(method, path, body)
	require.Equal(s.t, http.StatusOK, status, "%s %s %s: %s", method, path, body, out)
	return out
}

func TestConfigValidation(t *testing.T) {
	for name, cfg := range map[string]double.Config{
		"generation F": {Generation: "F"},
		"disk on A":    {Generation: double.GenA, Backend: double.BackendDisk},
		"disk on B":    {Generation: double.GenB, Backend: double.BackendDisk},
		"GPU memory":   {GPUMemoryBytes: -1},
		"load format":  {LoadFormat: "safetensors"},
		"backend":      {Backend: "rdma"},
		"fault rate":   {Faults: double.Faults{ErrorRate: map[string]float64{"*": 2}}},
		"latency":      {Latency: -1},
		"model path":   {ModelPath: "/nonexistent/model.safetensors"},
	} {
		_, err := double.New(cfg)
		assert.Error(t, err, name)
	}
	s, err := double.New(double.Config{})
	require.NoError(t, err)
	defer s.Close()
	c := s.Config()
	assert.Equal(t, double.GenD, c.Generation)
	assert.Equal(t, double.BackendDisk, c.Backend)
	assert.Equal(t, double.LoadFormatAuto, c.LoadFormat)
	assert.Equal(t, 1, c.WorldSize)
	assert.FileExists(t, c.ModelPath, "the random model is written to a temp file")
	require.NoError(t, s.Close())
	assert.NoFileExists(t, c.ModelPath)
}

func TestRoutesPerGeneration(t *testing.T) {
	common := []string{"GET /health", "GET /metrics", "GET /v1/models", "GET /version", "POST /v1/chat/completions", "POST /v1/completions"}
	dev := []string{"GET /get_world_size", "GET /is_paused", "POST /init_weight_transfer_engine", "POST /pause", "POST /resume", "POST /update_weights",
		"POST /collective_rpc", "GET /server_info"}
	sessions := []string{"GET /weight_info", "POST /abort_requests", "POST /finish_weight_update", "POST /start_weight_update", "POST /update_weight_version"}
	checker := []string{"POST /weight_checker"}
	devA := []string{"GET /get_world_size", "GET /is_paused", "POST /init_weight_transfer", "POST /pause", "POST /resume", "POST /update_weights",
		"POST /finalize_weight_update", "POST /collective_rpc", "GET /server_info"}
	cases := []struct {
		cfg  double.Config
		want [][]string
	}{
		{double.Config{Generation: double.GenA}, [][]string{common}},
		{double.Config{Generation: double.GenA, DevMode: true}, [][]string{common, devA}},
		{double.Config{Generation: double.GenC}, [][]string{common}},
		{double.Config{Generation: double.GenE}, [][]string{common}},
		{double.Config{Generation: double.GenB, DevMode: true}, [][]string{common, dev}},
		{double.Config{Generation: double.GenC, DevMode: true}, [][]string{common, dev, sessions, checker}},
		{double.Config{Generation: double.GenD, DevMode: true, Backend: double.BackendNCCL}, [][]string{common, dev, sessions, checker}},
		{double.Config{Generation: double.GenE, DevMode: true}, [][]string{common, dev, sessions, checker}},
		{double.Config{Generation: double.GenD, DevMode: true, NoWeightChecker: true}, [][]string{common, dev, sessions}},
		{double.Config{Generation: double.GenE, DevMode: true, NoWeightChecker: true}, [][]string{common, dev, sessions}},
	}
	for _, c := range cases {
		s := start(t, c.cfg)
		var want []string
		for _, w := range c.want {
			want = append(want, w...)
		}
		assert.ElementsMatch(t, want, s.Routes(), "%+v", c.cfg)
	}

	b := start(t, double.Config{Generation: double.GenB, DevMode: true})
	status, body := b.call("POST", "/start_weight_update", "{}")
	assert.Equal(t, http.StatusNotFound, status)
	assert.JSONEq(t, `{"detail":"Not Found"}`, body)
	// A wrong method on an existing route is 405, as FastAPI answers: the
	// client's generation probe relies on it.
	status, body = b.call("GET", "/init_weight_transfer_engine", "")
	assert.Equal(t, http.StatusMethodNotAllowed, status)
	assert.JSONEq(t, `{"detail":"Method Not Allowed"}`, body)

	off := start(t, double.Config{})
	status, _ = off.call("POST", "/pause", "")
	assert.Equal(t, http.StatusNotFound, status, "dev mode off: RLHF routes are 404")
	assert.Equal(t, `{"version":"0.28.0"}`, off.ok("GET", "/version", ""))
	assert.Equal(t, `{"version":"0.30.0"}`, start(t, double.Config{Generation: double.GenE}).ok("GET", "/version", ""), "rlflow's client reads >= 0.30 as E")
	assert.Equal(t, 1, off.Stats().Requests["unknown route"])
}

func TestWorldSize(t *testing.T) {
	s := start(t, double.Config{DevMode: true, WorldSize: 4, DataParallel: 2})
	assert.JSONEq(t, `{"world_size":8}`, s.ok("GET", "/get_world_size", ""))
	assert.JSONEq(t, `{"world_size":8}`, s.ok("GET", "/get_world_size?include_dp=true", ""))
	assert.JSONEq(t, `{"world_size":4}`, s.ok("GET", "/get_world_size?include_dp=false", ""))
	status, _ := s.call("GET", "/get_world_size?include_dp=maybe", "")
	assert.Equal(t, http.StatusBadRequest, status)
}

// TestStrictness is the payload table: status and vLLM-like message per body.
func TestStrictness(t *testing.T) {
	type row struct {
		path, body string
		status     int
		msg        string
	}
	const fullInit = `"master_address":"127.0.0.1","master_port":1,"rank_offset":1,"world_size":2`
	tables := []struct {
		cfg  double.Config
		rows []row
	}{
		{double.Config{Generation: double.GenC, Backend: double.BackendNCCL, DevMode: true}, []row{
			{"/init_weight_transfer_engine", "", 400, "Invalid JSON format"},
			{"/init_weight_transfer_engine", "{not json", 400, "Invalid JSON format"},
			{"/init_weight_transfer_engine", `{}`, 400, "Missing 'init_info' in request body"},
			{"/init_weight_transfer_engine", `{"init_info":null}`, 400, "Missing 'init_info' in request body"},
			{"/init_weight_transfer_engine", `[]`, 500, "AttributeError: 'list' object has no attribute 'get'"},
			{"/init_weight_transfer_engine", `{"init_info":[1]}`, 500, "TypeError: NCCLWeightTransferInitInfo() argument after ** must be a mapping, not list"},
			{"/init_weight_transfer_engine", `{"init_info":{` + fullInit + `,"packed":true}}`, 500,
				"TypeError: NCCLWeightTransferInitInfo.__init__() got an unexpected keyword argument 'packed'"},
			{"/init_weight_transfer_engine", `{"init_info":{"rank_offset":1}}`, 500,
				"TypeError: NCCLWeightTransferInitInfo.__init__() missing 3 required positional arguments: 'master_address', 'master_port', and 'world_size'"},
			{"/init_weight_transfer_engine", `{"init_info":{"master_address":"h","master_port":"x","rank_offset":1,"world_size":2}}`, 500,
				"ValueError: NCCLWeightTransferInitInfo.master_port must be an integer"},
			{"/init_weight_transfer_engine", `{"init_info":{` + fullInit + `},"extra":1}`, 500, "unexpected key(s) 'extra' in request body"},
			{"/init_weight_transfer_engine", `{"init_info":{"master_address":"h","master_port":1,"rank_offset":0,"world_size":2}}`, 500, "rank_offset 0"},
			{"/init_weight_transfer_engine", `{"init_info":{"master_address":"h","master_port":1,"rank_offset":1,"world_size":1}}`, 500, "world_size 1 is too small"},
			{"/update_weights", `{}`, 400, "Missing 'update_info' in request body"},
			{"/update_weights", `{"update_info":{}}`, 500, "without an open weight update session"},
		}},
		{double.Config{Generation: double.GenD, Backend: double.BackendDisk, DevMode: true}, []row{
			{"/init_weight_transfer_engine", `{"init_info":{"master_address":"h"}}`, 500,
				"TypeError: DiskWeightTransferInitInfo.__init__() got an unexpected keyword argument 'master_address'"},
			{"/init_weight_transfer_engine", `{"init_info":{}}`, 200, "Weight transfer initialized"},
			{"/update_weight_version", `{}`, 400, "Missing 'new_version' in request body"},
			{"/update_weight_version", `{"new_version":3}`, 400, "must be a non-empty string"},
			{"/update_weight_version", `{"new_version":"v1","x":1}`, 500, "unexpected key(s) 'x'"},
			{"/weight_checker", `{}`, 400, "Missing 'action'"},
			{"/weight_checker", `{"action":"bogus"}`, 400, "unknown action"},
			{"/weight_checker", `{"action":"compare"}`, 400, "action='compare' requires a 'baseline' object"},
			{"/pause?mode=sideways", ``, 400, "Input should be 'abort', 'wait' or 'keep'"},
			{"/finish_weight_update", `{"weight_version":1}`, 500, "weight_version must be a string"},
			{"/start_weight_update", `{"is_checkpoint_format":"yes"}`, 500, "is_checkpoint_format must be a boolean"},
			{"/start_weight_update", `{"bogus":true}`, 500, "unexpected key(s) 'bogus'"},
		}},
	}
	for _, tb := range tables {
		s := start(t, tb.cfg)
		for _, r := range tb.rows {
			status, body := s.call("POST", r.path, r.body)
			assert.Equal(t, r.status, status, "%s %s: %s", r.path, r.body, body)
			assert.Contains(t, body, r.msg, "%s %s", r.path, r.body)
		}
	}
}

func TestBodyLimit(t *testing.T) {
	s := start(t, double.Config{DevMode: true, MaxBodyBytes: 100})
	status, body := s.call("POST", "/update_weights", `{"update_info":{"path":"`+strings.Repeat("x", 200)+`"}}`)
	assert.Equal(t, http.StatusRequestEntityTooLarge, status)
	assert.Contains(t, body, "exceeds 100 bytes")
}

func TestNCCLMetadataValidation(t *testing.T) {
	s := start(t, double.Config{Generation: double.GenC, Backend: double.BackendNCCL, DevMode: true})
	s.ok("POST", "/start_weight_update", "{}")
	status, body := s.call("POST", "/update_weights", `{"update_info":{"names":["a"],"dtype_names":["float32"],"shapes":[[2]]}}`)
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "weight transfer engine is not initialized")

	d := start(t, double.Config{Generation: double.GenD, Backend: double.BackendNCCL, DevMode: true})
	d.ok("POST", "/start_weight_update", "")
	status, body = d.call("POST", "/update_weights", `{"update_info":{"names":["a"],"dtype_names":["float32"],"shapes":[[2]],"packed":true}}`)
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "TypeError: NCCLWeightTransferUpdateInfo.__init__() got an unexpected keyword argument 'packed'", "D takes packed in init_info only")
}

func TestSessionRules(t *testing.T) {
	for _, gen := range []double.Generation{double.GenC, double.GenD} {
		s := start(t, double.Config{Generation: gen, DevMode: true})
		ckpt := writeCheckpoint(t, "the cat sat on the mat\n")

		status, body := s.call("POST", "/update_weights", `{"update_info":{"path":"`+ckpt+`"}}`)
		assert.Equal(t, 500, status, "update without start")
		assert.Contains(t, body, "without an open weight update session")
		status, body = s.call("POST", "/finish_weight_update", "")
		assert.Equal(t, 500, status, "finish without start")
		assert.Contains(t, body, "without an open weight update session")

		s.ok("POST", "/start_weight_update", "")
		status, body = s.call("POST", "/start_weight_update", "{}")
		assert.Equal(t, 500, status, "second start while open")
		assert.Contains(t, body, "already open")

		s.ok("POST", "/update_weights", `{"update_info":{"path":"`+ckpt+`"}}`)
		status, body = s.call("POST", "/update_weights", `{"update_info":{"path":"`+ckpt+`"}}`)
		assert.Equal(t, 500, status, "disk: one checkpoint per session")
		assert.Contains(t, body, "exactly one per session")
		s.ok("POST", "/finish_weight_update", `{"weight_version":"step-1"}`)
		assert.JSONEq(t, `{"weight_version":"step-1"}`, s.ok("GET", "/weight_info", ""))

		// A new session is possible after finish; a finish without a
		// version numbers it.
		s.ok("POST", "/start_weight_update", `{"is_checkpoint_format":true}`)
		s.ok("POST", "/finish_weight_update", "{}")
		assert.JSONEq(t, `{"weight_version":"2"}`, s.ok("GET", "/weight_info", ""))
		s.ok("POST", "/update_weight_version", `{"new_version":"v9"}`)
		assert.Equal(t, "v9", s.WeightVersion())
	}
}

func TestDiskUpdateErrors(t *testing.T) {
	s := start(t, double.Config{DevMode: true})
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	require.NoError(t, os.MkdirAll(bad, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(bad, "model.safetensors"), []byte("garbage!garbage!"), 0o644))
	for path, want := range map[string]string{
		"relative/dir":                          "must be an absolute directory",
		filepath.Join(dir, "missing"):           "FileNotFoundError",
		filepath.Join(bad, "model.safetensors"): "is not a directory",
		bad:                                     "RuntimeError: load checkpoint",
		dir:                                     "no *.safetensors files",
	} {
		s.ok("POST", "/start_weight_update", "")
		status, body := s.call("POST", "/update_weights", `{"update_info":{"path":`+jsonString(path)+`}}`)
		assert.Equal(t, 500, status, path)
		assert.Contains(t, body, want, path)
		s.ok("POST", "/finish_weight_update", "")
	}
	s.ok("POST", "/start_weight_update", "")
	status, body := s.call("POST", "/update_weights", `{"update_info":{"path":"/x","names":[]}}`)
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "unexpected keyword argument 'names'")
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// writeCheckpoint trains a bigram model on corpus into a fresh checkpoint dir.
func writeCheckpoint(t *testing.T, corpus string) string {
	t.Helper()
	m, err := bigram.Train(corpus, bigram.TrainOptions{})
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, m.Save(filepath.Join(dir, "model.safetensors")))
	return dir
}

type completion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index        int    `json:"index"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
		Message      struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Logprobs json.RawMessage `json:"logprobs"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

func (s *testServer) complete(body string) completion {
	s.t.Helper()
	var c completion
	require.NoError(s.t, json.Unmarshal([]byte(s.ok("POST", "/v1/completions", body)), &c))
	return c
}

func TestModelChangesAfterDiskUpdate(t *testing.T) {
	const corpus = "the cat sat on the mat\nthe dog ran to the park\n"
	s := start(t, double.Config{DevMode: true, Seed: 1})
	req := `{"model":"bigram-double","prompt":["","the "],"max_tokens":30,"temperature":0.5,"seed":42,"n":2}`
	before := s.complete(req)
	sumBefore := s.ok("POST", "/weight_checker", `{"action":"checksum"}`)

	ckpt := writeCheckpoint(t, corpus)
	s.ok("POST", "/start_weight_update", "")
	s.ok("POST", "/update_weights", `{"update_info":{"path":`+jsonString(ckpt)+`}}`)
	s.ok("POST", "/finish_weight_update", `{"weight_version":"trained"}`)

	after := s.complete(req)
	require.Len(t, after.Choices, 4)
	words := map[string]bool{}
	for _, w := range strings.Fields(corpus) {
		words[w] = true
	}
	hits := 0
	for i, c := range after.Choices {
		assert.NotEqual(t, before.Choices[i].Text, c.Text, "choice %d: new weights, new text", i)
		for _, w := range strings.Fields(c.Text) {
			if words[w] {
				hits++
			}
		}
	}
	assert.Greater(t, hits, 3, "the trained model writes corpus words: %+v", after.Choices)
	assert.Equal(t, after.Choices, s.complete(req).Choices, "seeded requests are reproducible")

	sumAfter := s.ok("POST", "/weight_checker", `{"action":"checksum"}`)
	assert.NotEqual(t, sumBefore, sumAfter)
}

func TestOpenAIShapes(t *testing.T) {
	s := start(t, double.Config{ModelName: "m", MaxModelLen: 64})
	c := s.complete(`{"model":"m","prompt":["ab","c"],"max_tokens":5,"n":3,"logprobs":2,"seed":1}`)
	assert.Equal(t, "text_completion", c.Object)
	assert.True(t, strings.HasPrefix(c.ID, "cmpl-"))
	require.Len(t, c.Choices, 6)
	completionTokens := 0
	for i, ch := range c.Choices {
		assert.Equal(t, i, ch.Index)
		assert.Contains(t, []string{"stop", "length"}, ch.FinishReason)
		var lp struct {
			Tokens        []string             `json:"tokens"`
			TokenLogprobs []float64            `json:"token_logprobs"`
			TopLogprobs   []map[string]float64 `json:"top_logprobs"`
			TextOffset    []int                `json:"text_offset"`
		}
		require.NoError(t, json.Unmarshal(ch.Logprobs, &lp))
		assert.NotEmpty(t, lp.Tokens)
		assert.Len(t, lp.TokenLogprobs, len(lp.Tokens))
		assert.Len(t, lp.TopLogprobs[0], 2)
		completionTokens += len(lp.Tokens)
	}
	assert.Equal(t, 3, c.Usage.PromptTokens, "each prompt counted once, not per sample")
	assert.Equal(t, completionTokens, c.Usage.CompletionTokens)
	assert.Equal(t, c.Usage.PromptTokens+c.Usage.CompletionTokens, c.Usage.TotalTokens)

	// Token-id prompts, a single string, stop strings, greedy.
	g := s.complete(`{"model":"m","prompt":[104,105],"max_tokens":10,"temperature":0}`)
	assert.Equal(t, g.Choices, s.complete(`{"model":"m","prompt":"hi","max_tokens":10,"temperature":0}`).Choices, "ids are bytes; greedy is deterministic")

	var chat completion
	require.NoError(t, json.Unmarshal([]byte(s.ok("POST", "/v1/chat/completions",
		`{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":8,"n":2,"logprobs":true,"top_logprobs":1,"stream":false}`)), &chat))
	require.Len(t, chat.Choices, 2)
	assert.Equal(t, "assistant", chat.Choices[0].Message.Role)
	assert.Equal(t, 6, chat.Usage.PromptTokens, "content + newline")
	assert.Contains(t, string(chat.Choices[0].Logprobs), `"top_logprobs":[{`)

	models := s.ok("GET", "/v1/models", "")
	assert.Contains(t, models, `"id":"m"`)

	for body, want := range map[string]string{
		`{"model":"x","prompt":"a"}`:                    "The model `x` does not exist.",
		`{"model":"m","prompt":"a","max_tokens":100}`:   "maximum context length is 64 tokens",
		`{"model":"m","prompt":"a","max_tokens":"9"}`:   "invalid request body: max_tokens: got a JSON string, want integer",
		`{"model":"m","prompt":"a","temperature":true}`: "invalid request body: temperature: got a JSON bool, want number",
		`["m"]`: "invalid request body: want a JSON object, got a JSON array",
		`{"model":"m","prompt":"a","stream":true}`:         "stream=true is not supported",
		`{"model":"m","prompt":"a","n":0}`:                 "n must be in 1..128",
		`{"model":"m","prompt":[300]}`:                     "token id 300 out of vocabulary",
		`{"model":"m","prompt":"a","temperature":-1}`:      "temperature must be",
		`{"model":"m","prompt":"a","logprobs":21}`:         "logprobs must be in 0..20",
		`{"model":"m","prompt":"a","echo":true}`:           "echo is not supported",
		`{"model":"m","prompt":{}}`:                        "prompt must be",
		`{"model":"m"}`:                                    "prompt is required",
		`{"model":"m","prompt":"a","max_tokens":0}`:        "max_tokens must be at least 1",
		`{"model":"m","prompt":"a","stop":[1]}`:            "stop must be",
		`{"model":"m","prompt":"a","frequency_penalty":1}`: "not supported",
		`not json`: "invalid request body",
	} {
		status, out := s.call("POST", "/v1/completions", body)
		wantStatus := http.StatusBadRequest
		if strings.Contains(want, "does not exist") {
			wantStatus = http.StatusNotFound
		}
		assert.Equal(t, wantStatus, status, body)
		assert.Contains(t, out, want, body)
	}
	status, out := s.call("POST", "/v1/chat/completions", `{"model":"m","messages":[{"role":"tool","content":"x"}]}`)
	assert.Equal(t, 400, status)
	assert.Contains(t, out, `is not supported`)
}

func TestAPIKey(t *testing.T) {
	s := start(t, double.Config{APIKey: "sekrit"})
	status, body := s.call("POST", "/v1/completions", `{"model":"bigram-double","prompt":"a"}`)
	assert.Equal(t, http.StatusUnauthorized, status)
	assert.JSONEq(t, `{"error":"Unauthorized"}`, body)
	req, _ := http.NewRequest("GET", s.url+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer sekrit")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
}

// asyncComplete starts a completion in the background.
func (s *testServer) asyncComplete(body string) <-chan completion {
	ch := make(chan completion, 1)
	go func() {
		resp, err := http.Post(s.url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			close(ch)
			return
		}
		defer resp.Body.Close()
		var c completion
		if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&c) != nil {
			close(ch)
			return
		}
		ch <- c
	}()
	return ch
}

func received(s *testServer, n int) func() bool {
	return func() bool { return s.Stats().Requests["POST /v1/completions"] >= n }
}

const slowReq = `{"model":"bigram-double","prompt":"a","max_tokens":50,"temperature":1,"seed":3}`

func TestPauseAbort(t *testing.T) {
	s := start(t, double.Config{DevMode: true, Latency: 400 * time.Millisecond})
	full := s.complete(slowReq).Choices[0]
	inflight := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "request received", received(s, 2))
	time.Sleep(100 * time.Millisecond) // about a quarter served
	s.ok("POST", "/pause?mode=abort", "")
	got, ok := <-inflight
	require.True(t, ok)
	assert.Equal(t, "abort", got.Choices[0].FinishReason)
	assert.True(t, strings.HasPrefix(full.Text, got.Choices[0].Text), "an aborted choice is a prefix of the full text")
	assert.Less(t, len(got.Choices[0].Text), len(full.Text))

	// New requests wait for resume (vLLM blocks new requests while paused).
	queued := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "queued request received", received(s, 3))
	select {
	case <-queued:
		t.Fatal("a request completed while paused")
	case <-time.After(500 * time.Millisecond):
	}
	assert.JSONEq(t, `{"is_paused":true}`, s.ok("GET", "/is_paused", ""))
	s.ok("POST", "/resume", "")
	c, ok := <-queued
	require.True(t, ok)
	assert.Equal(t, full, c.Choices[0], "after resume the queued request runs to the end")
	// The client may read the answer before the double counts it sent.
	testutil.Eventually(t, 5*time.Second, "every answer counted", func() bool { return s.Stats().Unsent == 0 })
	st := s.Stats()
	assert.Equal(t, 1, st.Aborted)
	assert.Equal(t, 2, st.Completions)
	assert.Equal(t, 3, st.Prompts["a"])
	assert.Equal(t, 2, st.Delivered, "an aborted answer is no delivered sample")
	assert.Equal(t, 2, st.Rerequested, "the one seeded sample, asked for twice after its delivery")
}

func TestPauseWait(t *testing.T) {
	s := start(t, double.Config{DevMode: true, Latency: 300 * time.Millisecond})
	inflight := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "request received", received(s, 1))
	time.Sleep(20 * time.Millisecond)
	t0 := time.Now()
	s.ok("POST", "/pause?mode=wait", "")
	waited := time.Since(t0)
	// The sequence has finished when pause returns; its HTTP answer follows
	// at once.
	select {
	case c := <-inflight:
		assert.NotEqual(t, "abort", c.Choices[0].FinishReason)
	case <-time.After(time.Second):
		t.Fatal("the in-flight request did not finish")
	}
	assert.Greater(t, waited, 150*time.Millisecond, "pause?mode=wait waited for the in-flight request")
	// Deprecated spelling, on a paused server with nothing in flight: immediate.
	s.ok("POST", "/pause?wait_for_inflight_requests=true", "")
	s.ok("POST", "/resume", "")
}

func TestPauseKeep(t *testing.T) {
	s := start(t, double.Config{DevMode: true, Latency: 300 * time.Millisecond})
	inflight := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "request received", received(s, 1))
	time.Sleep(50 * time.Millisecond)
	s.ok("POST", "/pause?mode=keep", "")
	select {
	case <-inflight:
		t.Fatal("a frozen request completed while paused")
	case <-time.After(600 * time.Millisecond):
	}
	t0 := time.Now()
	s.ok("POST", "/resume", "")
	c, ok := <-inflight
	require.True(t, ok)
	assert.NotEqual(t, "abort", c.Choices[0].FinishReason)
	rest := time.Since(t0)
	assert.Greater(t, rest, 150*time.Millisecond, "the frozen request serves its remaining latency after resume")
	assert.Less(t, rest, 290*time.Millisecond, "but not the latency it had already served")
}

func TestAbortRequests(t *testing.T) {
	s := start(t, double.Config{DevMode: true, Latency: time.Second})
	inflight := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "request received", received(s, 1))
	time.Sleep(50 * time.Millisecond)
	assert.JSONEq(t, `{"message":"Requests aborted","aborted":1}`, s.ok("POST", "/abort_requests", ""))
	c := <-inflight
	assert.Equal(t, "abort", c.Choices[0].FinishReason)
	assert.JSONEq(t, `{"is_paused":false}`, s.ok("GET", "/is_paused", ""))
}

func TestLatencyAndSlots(t *testing.T) {
	s := start(t, double.Config{Latency: 50 * time.Millisecond, MaxConcurrent: 4})
	t0 := time.Now()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { s.complete(`{"model":"bigram-double","prompt":"x","max_tokens":2}`) })
	}
	wg.Wait()
	took := time.Since(t0)
	assert.GreaterOrEqual(t, took, 100*time.Millisecond, "8 sequences on 4 slots take two rounds")
	assert.Less(t, took, 400*time.Millisecond)
	// One request with 8 sequences also takes two rounds: slots are per sequence.
	t0 = time.Now()
	s.complete(`{"model":"bigram-double","prompt":"x","max_tokens":2,"n":8}`)
	assert.GreaterOrEqual(t, time.Since(t0), 100*time.Millisecond)
}

func TestFaults(t *testing.T) {
	s := start(t, double.Config{DevMode: true, Faults: double.Faults{
		ErrorRate: map[string]float64{"/v1/completions": 1},
		DropRate:  map[string]float64{"/is_paused": 1},
		SlowRate:  map[string]float64{"/resume": 1},
		SlowBy:    200 * time.Millisecond,
	}})
	status, body := s.call("POST", "/v1/completions", `{}`)
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "injected fault")
	_, err := http.Get(s.url + "/is_paused")
	assert.Error(t, err, "dropped connection")
	t0 := time.Now()
	s.ok("POST", "/resume", "")
	assert.GreaterOrEqual(t, time.Since(t0), 200*time.Millisecond)
	s.ok("POST", "/pause", "") // other routes are untouched
	f := s.Stats().Faults
	assert.Equal(t, 1, f["error"])
	assert.Equal(t, 1, f["slow"])
	assert.GreaterOrEqual(t, f["drop"], 1, "Go's transport may retry a dropped idempotent GET once")

	// Rates are probabilities drawn from the seed: about half fail.
	h := start(t, double.Config{Seed: 9, Faults: double.Faults{ErrorRate: map[string]float64{"*": 0.5}}})
	fails := 0
	for range 200 {
		if status, _ := h.call("GET", "/health", ""); status == 500 {
			fails++
		}
	}
	assert.InDelta(t, 100, fails, 30)
}

func TestListenAndServe(t *testing.T) {
	s, err := double.New(double.Config{})
	require.NoError(t, err)
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	ln, err := netListen()
	require.NoError(t, err)
	addr := ln.Addr().String()
	ln.Close()
	done := make(chan error, 1)
	go func() { done <- s.ListenAndServe(ctx, addr) }()
	testutil.Eventually(t, 5*time.Second, "server up", func() bool {
		resp, err := http.Get("http://" + addr + "/health")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	})
	cancel()
	assert.NoError(t, <-done)
	assert.Error(t, s.ListenAndServe(context.Background(), "256.0.0.1:1"), "binds exactly the address given")
}

func netListen() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

// fireOnePromptRequests sends n one-prompt completions to h at once, in
// process (no TCP: the figure is the double's own, not the cost of n
// connections), and returns how long they took together.
func fireOnePromptRequests(tb testing.TB, h http.Handler, n int) time.Duration {
	t0 := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			r := httptest.NewRequest("POST", "/v1/completions",
				strings.NewReader(`{"model":"bigram-double","prompt":"p`+strconv.Itoa(i)+`","max_tokens":4}`))
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			assert.Equal(tb, http.StatusOK, w.Code, w.Body.String())
		})
	}
	wg.Wait()
	return time.Since(t0)
}

// The benchmark setting serves 256 sequences at once, never more, each for
// 50 ms: 1,024 requests cannot finish before 4 rounds. How close to that
// they finish is a performance figure: BenchmarkBenchSetting.
func TestBenchSettingSlots(t *testing.T) {
	cfg := double.BenchConfig()
	s, err := double.New(cfg)
	require.NoError(t, err)
	defer s.Close()
	const n = 1024
	ideal := double.IdealDuration(s.Config(), n)
	assert.Equal(t, 200*time.Millisecond, ideal)
	took := fireOnePromptRequests(t, s.Handler(), n)
	t.Logf("%d one-prompt requests on %d slots of %v: %v (ideal %v)", n, double.BenchSlots, double.BenchLatency, took, ideal)
	assert.GreaterOrEqual(t, took, ideal, "never faster than the slots allow")
	assert.Equal(t, double.BenchSlots, s.Stats().PeakRunning, "every slot in use at once, and no more")
	assert.Equal(t, n, s.Stats().Completions)
	assert.Len(t, s.Stats().Prompts, n)
	assert.Equal(t, time.Duration(0), double.IdealDuration(cfg, 0))
	assert.Equal(t, 50*time.Millisecond, double.IdealDuration(cfg, 256))
	assert.Equal(t, 100*time.Millisecond, double.IdealDuration(cfg, 257))
}

// BenchmarkBenchSetting reports how close the benchmark setting comes to
// its ideal duration (x_ideal = took / ideal, 1 is exact), in process.
func BenchmarkBenchSetting(b *testing.B) {
	s, err := double.New(double.BenchConfig())
	require.NoError(b, err)
	defer s.Close()
	const n = 1024
	ideal := double.IdealDuration(s.Config(), n)
	var took time.Duration
	for b.Loop() {
		took += fireOnePromptRequests(b, s.Handler(), n)
	}
	b.ReportMetric(float64(took)/float64(b.N)/float64(ideal), "x_ideal")
}

// TestNoInputPanics throws odd bodies and queries at every route of every
// configuration, in process, so a panic would fail the test.
func TestNoInputPanics(t *testing.T) {
	bodies := []string{"", "null", "[]", "{", "1", `"s"`, "{}", `{"init_info":1}`, `{"update_info":[]}`,
		`{"init_info":{"master_port":1e400,"world_size":-1}}`, `{"update_info":{"names":null,"dtype_names":[],"shapes":[null]}}`,
		`{"update_info":{"names":["a"],"dtype_names":["float32"],"shapes":[[9223372036854775807,9223372036854775807]]}}`,
		`{"model":"bigram-double","prompt":[[]],"max_tokens":1}`, `{"model":"bigram-double","prompt":"","n":128,"max_tokens":1,"logprobs":20}`,
		`{"model":"bigram-double","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"max_tokens":1}`,
		`{"action":"compare","baseline":[1]}`, `{"new_version":null}`, `{"weight_version":{}}`,
		`{"update_info":[{}]}`, `{"update_info":[{"path":"/x"},{"path":"/y"}]}`, `{"update_info":[[]]}`, `{"action":"reset"}`,
		`{"method":"update_config","args":[{"load_config":null}]}`, `{"method":"update_config","args":[{"load_config":{"load_format":null}}]}`,
		`{"method":"reload_weights","kwargs":{"weights_path":null,"is_checkpoint_format":null}}`, `{"method":"","args":null,"kwargs":null,"timeout":null}`,
		`{"method":"update_config","args":[{"load_config":{"load_format":"dummy"}}]}`, `{"method":"reload_weights","timeout":1e999}`}
	for _, cfg := range []double.Config{
		{Generation: double.GenA, DevMode: true, RendezvousTimeout: 10 * time.Millisecond},
		{Generation: double.GenB, DevMode: true},
		{Generation: double.GenC, DevMode: true, Backend: double.BackendNCCL, RendezvousTimeout: 10 * time.Millisecond},
		{Generation: double.GenD, DevMode: true},
		{Generation: double.GenE, DevMode: true, RendezvousTimeout: 10 * time.Millisecond, WorldSize: 2},
		{Generation: double.GenE, DevMode: true, Backend: double.BackendDisk, LoadFormat: double.LoadFormatDummy, NoWeightChecker: true},
	} {
		s, err := double.New(cfg)
		require.NoError(t, err)
		h := s.Handler()
		for _, rt := range s.Routes() {
			method, path, _ := strings.Cut(rt, " ")
			for _, b := range bodies {
				for _, q := range []string{"", "?mode=wait&include_dp=0&clear_cache=x", "?config_format=x&wait_for_inflight_requests=x"} {
					if strings.Contains(q, "wait") && path == "/pause" {
						q = "?mode=keep"
					}
					r := httptest.NewRequest(method, path+q, strings.NewReader(b))
					w := httptest.NewRecorder()
					h.ServeHTTP(w, r)
					assert.Contains(t, []int{200, 400, 404, 409, 413, 500}, w.Code, "%s%s %s: %s", rt, q, b, w.Body.String())
				}
			}
		}
		s.Close()
	}
}

// Delivered and Rerequested key a sample by route, prompt, seed, sequence
// index and sampling parameters: what fixes its text on given weights.
func TestRerequestedSamples(t *testing.T) {
	s := start(t, double.Config{})
	body := func(prompt string, seed int, n int, temp float64) string {
		return `{"model":"bigram-double","prompt":` + jsonString(prompt) + `,"max_tokens":3,"n":` + strconv.Itoa(n) +
			`,"temperature":` + strconv.FormatFloat(temp, 'g', -1, 64) + `,"seed":` + strconv.Itoa(seed) + `}`
	}
	chat := `{"model":"bigram-double","messages":[{"role":"user","content":"a"}],"max_tokens":3,"seed":1}`
	steps := []struct {
		name                   string
		path, body             string
		delivered, rerequested int
	}{
		{"first", "/v1/completions", body("a", 1, 1, 1), 1, 0},
		{"another seed", "/v1/completions", body("a", 2, 1, 1), 2, 0},
		{"another prompt", "/v1/completions", body("b", 1, 1, 1), 3, 0},
		{"another temperature", "/v1/completions", body("a", 1, 1, 0.5), 4, 0},
		{"chat: another route", "/v1/chat/completions", chat, 5, 0},
		{"the first again", "/v1/completions", body("a", 1, 1, 1), 6, 1},
		{"n=2: its sequence 0 is the first", "/v1/completions", body("a", 1, 2, 1), 8, 2},
		{"unseeded: not keyed", "/v1/completions", `{"model":"bigram-double","prompt":"a","max_tokens":3}`, 8, 2},
		{"chat again", "/v1/chat/completions", chat, 9, 3},
	}
	for _, st := range steps {
		s.ok("POST", st.path, st.body)
		testutil.Eventually(t, 5*time.Second, "the answer counted", func() bool { return s.Stats().Unsent == 0 })
		got := s.Stats()
		assert.Equal(t, st.delivered, got.Delivered, st.name)
		assert.Equal(t, st.rerequested, got.Rerequested, st.name)
	}
}

// After a pause with mode keep, Unsent falls to 0 and no sequence
// finishes until resume: a test can wait for every answer to be out.
func TestUnsentAfterKeepPause(t *testing.T) {
	s := start(t, double.Config{DevMode: true, Latency: 30 * time.Millisecond, MaxConcurrent: 2})
	var chans []<-chan completion
	for range 10 {
		chans = append(chans, s.asyncComplete(slowReq))
	}
	testutil.Eventually(t, 5*time.Second, "two answers", func() bool { return s.Stats().Completions >= 2 })
	s.ok("POST", "/pause?mode=keep", "")
	testutil.Eventually(t, 5*time.Second, "every finished sequence answered", func() bool { return s.Stats().Unsent == 0 })
	held := s.Stats().Completions
	require.Less(t, held, 10)
	time.Sleep(100 * time.Millisecond) // three latencies: a sequence that could finish would
	assert.Equal(t, held, s.Stats().Completions, "a sequence finished while paused")
	assert.Zero(t, s.Stats().Unsent)
	s.ok("POST", "/resume", "")
	for _, ch := range chans {
		_, ok := <-ch
		assert.True(t, ok)
	}
	assert.Equal(t, 10, s.Stats().Completions)
	testutil.Eventually(t, 5*time.Second, "every answer counted", func() bool { return s.Stats().Unsent == 0 })
}

// /metrics carries the process start time; Kill, Close, New and Start on
// the same address play a restart: a new start time, the weights and
// version the server starts with.
func TestMetricsAndRestart(t *testing.T) {
	cfg := double.Config{DevMode: true, Seed: 5}
	d, err := double.New(cfg)
	require.NoError(t, err)
	run, err := d.Start("127.0.0.1:0")
	require.NoError(t, err)
	get := func(path string) (int, string) {
		resp, err := http.Get(run.URL() + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	status, body := get("/metrics")
	require.Equal(t, http.StatusOK, status)
	want := "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n" +
		"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds " +
		strconv.FormatFloat(float64(d.StartTime().UnixNano())/1e9, 'e', -1, 64) + "\n"
	assert.Equal(t, want, body)
	req, err := http.NewRequest(http.MethodPost, run.URL()+"/update_weight_version", strings.NewReader(`{"new_version":"v9"}`))
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	_, info := get("/weight_info")
	assert.JSONEq(t, `{"weight_version":"v9"}`, info)

	run.Kill()
	require.NoError(t, d.Close())
	_, err = http.Get(run.URL() + "/health")
	require.Error(t, err, "killed: nothing listens")
	d2, err := double.New(cfg)
	require.NoError(t, err)
	defer d2.Close()
	run2, err := d2.Start(run.Addr())
	require.NoError(t, err)
	defer run2.Kill()
	assert.Equal(t, run.URL(), run2.URL())
	_, info = get("/weight_info")
	assert.JSONEq(t, `{"weight_version":null}`, info, "a restart serves the weights it starts with")
	_, body = get("/metrics")
	assert.NotEqual(t, want, body)
	assert.True(t, d2.StartTime().After(d.StartTime()))
	assert.Equal(t, d.Model().Checksum(), d2.Model().Checksum(), "the same base weights")
}
