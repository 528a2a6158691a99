package double_test

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

const toAuto = `{"method":"update_config","args":[{"load_config":{"load_format":"auto"}}],"timeout":30}`

func reloadBody(dir string) string {
	return `{"method":"reload_weights","kwargs":{"weights_path":` + jsonString(dir) + `,"is_checkpoint_format":true},"timeout":30}`
}

// Every generation and backend has the route in dev mode; bad bodies are
// 400, worker errors 500, and a success has one result per worker.
func TestCollectiveRPCRequests(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	require.NoError(t, os.MkdirAll(bad, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(bad, "model.safetensors"), []byte("garbage!garbage!"), 0o644))
	rows := []struct {
		body   string
		status int
		msg    string
	}{
		{`{"method":`, 400, "JSON decode error: "},
		{``, 400, "JSON decode error: "},
		{`["reload_weights"]`, 400, "Request body must be a JSON object, got list"},
		{`{}`, 400, "Missing 'method' in request body"},
		{`{"method":null}`, 400, "Missing 'method' in request body"},
		{`{"method":3}`, 400, "'method' must be a string, got 3"},
		{`{"method":"reload_weights","args":{}}`, 400, "'args' must be a list, got {}"},
		{`{"method":"reload_weights","kwargs":[]}`, 400, "'kwargs' must be an object, got []"},
		{`{"method":"reload_weights","timeout":"soon"}`, 400, `'timeout' must be a positive number of seconds or null, got "soon"`},
		{`{"method":"reload_weights","timeout":0}`, 400, "'timeout' must be a positive number of seconds or null, got 0"},
		{`{"method":"reload_weights","kwarg":{"weights_path":"/x"}}`, 400, "unexpected key(s) 'kwarg' in request body"},
		{`{"method":"sleep"}`, 500, "AttributeError: 'Worker' object has no attribute 'sleep'"},
		{`{"method":"update_config"}`, 500, `double: update_config takes args [{"load_config": {"load_format": "auto"}}] (or "dummy") and no kwargs; got 0 args and 0 kwargs`},
		{`{"method":"update_config","args":[{"load_config":{"load_format":"auto"}}],"kwargs":{"x":1}}`, 500, "got 1 args and 1 kwargs"},
		{`{"method":"update_config","args":["load_format=auto"]}`, 500, "args[0] is str"},
		{`{"method":"update_config","args":[{"model_config":{}}]}`, 500, "the vLLM double can change only load_config.load_format; got overrides 'model_config'"},
		{`{"method":"update_config","args":[{"load_config":{"load_format":"auto","device":"cpu"}}]}`, 500, "got load_config 'load_format', 'device'"},
		{`{"method":"update_config","args":[{"load_config":{"load_format":"safetensors"}}]}`, 500, `load_format "safetensors": the vLLM double knows only "auto" and "dummy"`},
		{`{"method":"reload_weights","args":["/x"]}`, 500, "TypeError: double: reload_weights takes keyword arguments (weights_path, is_checkpoint_format), got 1 positional"},
		{`{"method":"reload_weights","kwargs":{"path":"/x"}}`, 500, "TypeError: Worker.reload_weights() got an unexpected keyword argument 'path'"},
		{`{"method":"reload_weights","kwargs":{"weights_path":5}}`, 500, "ValueError: reload_weights: weights_path must be a string, got 5"},
		{`{"method":"reload_weights","kwargs":{"weights_path":"/x","is_checkpoint_format":"yes"}}`, 500, `is_checkpoint_format must be a boolean, got "yes"`},
		{reloadBody("relative/dir"), 500, `ValueError: weights_path "relative/dir" must be an absolute directory`},
		{reloadBody(filepath.Join(dir, "missing")), 500, "FileNotFoundError: weights_path"},
		{reloadBody(filepath.Join(bad, "model.safetensors")), 500, "NotADirectoryError: weights_path"},
		{reloadBody(bad), 500, "RuntimeError: load checkpoint"},
		{reloadBody(dir), 500, "no *.safetensors files"},
		{toAuto, 200, ""},
	}
	for _, cfg := range []double.Config{
		{Generation: double.GenB, DevMode: true},
		{Generation: double.GenC, DevMode: true, Backend: double.BackendNCCL},
		{Generation: double.GenD, DevMode: true},
		{Generation: double.GenE, DevMode: true, WorldSize: 2, DataParallel: 3},
	} {
		s := start(t, cfg)
		for _, r := range rows {
			status, body := s.call("POST", "/collective_rpc", r.body)
			assert.Equal(t, r.status, status, "gen %s %s: %s", cfg.Generation, r.body, body)
			if r.status != http.StatusOK {
				assert.Contains(t, errorMessage(t, body), r.msg, "gen %s %s", cfg.Generation, r.body)
				continue
			}
			want := `{"results":[null]}`
			if cfg.WorldSize == 2 {
				want = `{"results":[null,null,null,null,null,null]}`
			}
			assert.JSONEq(t, want, body, "one result per worker (WorldSize x DataParallel)")
		}
		status, _ := s.call("GET", "/collective_rpc", "")
		assert.Equal(t, http.StatusMethodNotAllowed, status, "a client probes the route with GET")
	}
	off := start(t, double.Config{Generation: double.GenE})
	status, _ := off.call("POST", "/collective_rpc", toAuto)
	assert.Equal(t, http.StatusNotFound, status, "dev mode off")
}

// reload_weights loads a checkpoint directory outside any weight-transfer
// session: no start/finish, the version unchanged.
func TestReloadWeights(t *testing.T) {
	for _, cfg := range []double.Config{
		{Generation: double.GenE, DevMode: true},                        // stock: nccl backend
		{Generation: double.GenD, DevMode: true, Backend: "disk"},       // beside the draft backend
		{Generation: double.GenB, DevMode: true, Backend: "nccl"},       // no sessions at all
		{Generation: double.GenC, DevMode: true, WorldSize: 2, Seed: 9}, // several workers
	} {
		s := start(t, cfg)
		started := s.Model().Checksum()
		trained, err := bigram.Train("the cat sat on the mat\n", bigram.TrainOptions{})
		require.NoError(t, err)
		ckpt := t.TempDir()
		require.NoError(t, trained.Save(filepath.Join(ckpt, "model.safetensors")))

		s.ok("POST", "/collective_rpc", reloadBody(ckpt))
		assert.Equal(t, trained.Checksum(), s.Model().Checksum(), "gen %s: the checkpoint serves now", cfg.Generation)
		_, metrics := s.call("GET", "/metrics", "")
		assert.NotContains(t, metrics, "vllm:rl_weight_update", "a reload is no weight-transfer operation")
		if cfg.Generation != double.GenB {
			assert.JSONEq(t, `{"weight_version":null}`, s.ok("GET", "/weight_info", ""), "a reload sets no version")
			status, _ := s.call("POST", "/finish_weight_update", "")
			assert.Equal(t, 500, status, "a reload opens no session")
		}
		// Without weights_path the workers reload the model path they started from.
		s.ok("POST", "/collective_rpc", `{"method":"reload_weights","kwargs":{"is_checkpoint_format":true}}`)
		assert.Equal(t, started, s.Model().Checksum())
	}
}

// The dummy trap: a server started with --load-format dummy serves random
// weights, and reload_weights redraws them (answering 200) until
// update_config sets the workers' load format to auto.
func TestDummyLoadFormatTrap(t *testing.T) {
	trained, err := bigram.Train("the cat sat on the mat\n", bigram.TrainOptions{})
	require.NoError(t, err)
	modelFile := filepath.Join(t.TempDir(), "model.safetensors")
	require.NoError(t, trained.Save(modelFile))
	ckpt := writeCheckpoint(t, "a dog ran to the park\n")
	want, err := bigram.Load(ckpt)
	require.NoError(t, err)
	dummy := bigram.Random(3).Checksum()

	s := start(t, double.Config{Generation: double.GenE, DevMode: true, ModelPath: modelFile, LoadFormat: double.LoadFormatDummy, Seed: 3})
	assert.Equal(t, dummy, s.Model().Checksum(), "dummy: the model path is not read")
	assert.Equal(t, double.LoadFormatDummy, s.WorkerLoadFormat())

	s.ok("POST", "/collective_rpc", reloadBody(ckpt))
	assert.Equal(t, dummy, s.Model().Checksum(), "the trap: 200, but the dummy weights were redrawn")
	s.ok("POST", "/collective_rpc", reloadBody("/does/not/exist"))
	assert.Equal(t, dummy, s.Model().Checksum(), "the dummy loader never reads the path")

	s.ok("POST", "/collective_rpc", toAuto)
	assert.Equal(t, double.LoadFormatAuto, s.WorkerLoadFormat())
	assert.Contains(t, s.ok("GET", "/server_info", ""), "load_format=dummy", "server_info reports the configuration the server started with")
	s.ok("POST", "/collective_rpc", reloadBody(ckpt))
	assert.Equal(t, want.Checksum(), s.Model().Checksum(), "auto: the checkpoint is loaded")

	// Back to dummy: a reload draws the same dummy weights over the
	// checkpoint's, as vLLM's fixed-seed DummyModelLoader does.
	s.ok("POST", "/collective_rpc", `{"method":"update_config","args":[{"load_config":{"load_format":"dummy"}}]}`)
	s.ok("POST", "/collective_rpc", reloadBody(ckpt))
	assert.Equal(t, dummy, s.Model().Checksum())

	// Load format auto (the default) reads the model path.
	a := start(t, double.Config{DevMode: true, ModelPath: modelFile})
	assert.Equal(t, trained.Checksum(), a.Model().Checksum())
}

func TestServerInfo(t *testing.T) {
	s := start(t, double.Config{Generation: double.GenE, DevMode: true, ModelName: "m", WorldSize: 2, DataParallel: 3, LoadFormat: double.LoadFormatDummy})
	model := s.Config().ModelPath
	jsonWant := `{"vllm_config":{
		"model_config":{"model":` + jsonString(model) + `,"served_model_name":"m"},
		"load_config":{"load_format":"dummy"},
		"parallel_config":{"tensor_parallel_size":2,"pipeline_parallel_size":1,"data_parallel_size":3},
		"weight_transfer_config":{"backend":"nccl"}},
		"vllm_env":{}}`
	assert.JSONEq(t, jsonWant, s.ok("GET", "/server_info?config_format=json", ""))
	text := `{"vllm_config":` + jsonString("model="+pyQuote(model)+", served_model_name=m, tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=3, load_format=dummy, weight_transfer_config=WeightTransferConfig(backend='nccl')") + `,"vllm_env":{}}`
	assert.JSONEq(t, text, s.ok("GET", "/server_info", ""), "text is the default")
	assert.JSONEq(t, text, s.ok("GET", "/server_info?config_format=text", ""))

	status, body := s.call("GET", "/server_info?config_format=yaml", "")
	assert.Equal(t, http.StatusBadRequest, status, "vLLM answers validation errors 400, not FastAPI's 422")
	assert.Equal(t, `query.config_format: Input should be 'text' or 'json', got "yaml"`, errorMessage(t, body))

	d := start(t, double.Config{DevMode: true})
	assert.Contains(t, d.ok("GET", "/server_info", ""), "load_format=auto, weight_transfer_config=WeightTransferConfig(backend='disk')")
	status, _ = start(t, double.Config{}).call("GET", "/server_info", "")
	assert.Equal(t, http.StatusNotFound, status, "dev mode off")
}

func pyQuote(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}
