package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// recordedDouble serves a vLLM double behind a recorder.
func recordedDouble(t *testing.T, cfg double.Config) (*double.Server, *vllm.Client, *testutil.Recorder) {
	t.Helper()
	cfg.DevMode = true
	d, err := double.New(cfg)
	require.NoError(t, err)
	rec := &testutil.Recorder{}
	hs := httptest.NewServer(rec.Wrap(d.Handler()))
	t.Cleanup(func() { hs.Close(); d.Close() })
	c, err := vllm.New(hs.URL, vllm.Options{Retry: vllm.RetryPolicy{Attempts: 1}})
	require.NoError(t, err)
	return d, c, rec
}

// checkpoint writes a bigram model trained on corpus as dir/model.safetensors.
func checkpoint(t *testing.T, corpus string) (string, *bigram.Model) {
	t.Helper()
	dir := t.TempDir()
	m, err := bigram.Train(corpus, bigram.TrainOptions{})
	require.NoError(t, err)
	require.NoError(t, m.Save(filepath.Join(dir, "model.safetensors")))
	return dir, m
}

// The probes every update starts with: server_info, then (a disk-backend
// server) the generation or (any other) the collective_rpc route.
const (
	probeInfo = "GET /server_info?config_format=json"
	probeRPC  = "GET /collective_rpc"
	probeGen  = "GET /init_weight_transfer_engine|GET /start_weight_update|GET /version"
	probeGenB = "GET /init_weight_transfer_engine|GET /start_weight_update"
	probeGenA = "GET /init_weight_transfer_engine|GET /init_weight_transfer"
)

func seq(parts ...string) []string {
	var out []string
	for _, p := range parts {
		out = append(out, strings.Split(p, "|")...)
	}
	return out
}

// TestDiskUpdateSequences pins the exact requests of a disk-backend update
// per server kind and API generation: stock vLLM reloads through
// /collective_rpc inside pause/resume (update_config first on dummy
// weights), the draft disk backend runs an update session.
func TestDiskUpdateSequences(t *testing.T) {
	ctx := context.Background()
	reload := func(dir, extra string) string {
		return `POST /collective_rpc {"kwargs":{"is_checkpoint_format":true,"weights_path":"` + dir + `"},"method":"reload_weights","timeout":61}` + extra
	}
	const updateConfig = `POST /collective_rpc {"args":[{"load_config":{"load_format":"auto"}}],"method":"update_config","timeout":30}`
	tests := []struct {
		name   string
		cfg    double.Config
		paused bool // the run holds the server paused
		method string
		want   func(dir string) []string
	}{
		{"stock E", double.Config{Generation: double.GenE, Backend: double.BackendNCCL}, false, MethodReload, func(dir string) []string {
			return seq(probeInfo, probeRPC, probeGen, "POST /pause?mode=keep", reload(dir, ""),
				`POST /update_weight_version {"new_version":"run/iter-1"}`, "GET /weight_info", "POST /resume")
		}},
		{"stock D run-paused", double.Config{Generation: double.GenD, Backend: double.BackendNCCL}, true, MethodReload, func(dir string) []string {
			return seq(probeInfo, probeRPC, probeGen, reload(dir, ""),
				`POST /update_weight_version {"new_version":"run/iter-1"}`, "GET /weight_info")
		}},
		{"stock C dummy weights", double.Config{Generation: double.GenC, Backend: double.BackendNCCL, LoadFormat: "dummy"}, false, MethodReloadDummy, func(dir string) []string {
			return seq(probeInfo, probeRPC, probeGen, "POST /pause?mode=keep", updateConfig, reload(dir, ""),
				`POST /update_weight_version {"new_version":"run/iter-1"}`, "GET /weight_info", "POST /resume")
		}},
		{"stock B (no versions)", double.Config{Generation: double.GenB, Backend: double.BackendNCCL}, false, MethodReload, func(dir string) []string {
			return seq(probeInfo, probeRPC, probeGenB, "POST /pause?mode=keep", reload(dir, ""), "POST /resume")
		}},
		// A cannot keep requests frozen: they finish before the reload.
		{"stock A (no versions, no keep)", double.Config{Generation: double.GenA, Backend: double.BackendNCCL}, false, MethodReload, func(dir string) []string {
			return seq(probeInfo, probeRPC, probeGenA, "POST /pause?mode=wait&wait_for_inflight_requests=true", reload(dir, ""), "POST /resume")
		}},
		{"draft disk D", double.Config{Generation: double.GenD, Backend: double.BackendDisk}, false, MethodDraftDisk, func(dir string) []string {
			return seq(probeInfo, probeGen, `POST /init_weight_transfer_engine {"init_info":{}}`, "POST /start_weight_update {}",
				`POST /update_weights {"update_info":{"path":"`+dir+`"}}`, `POST /finish_weight_update {"weight_version":"run/iter-1"}`)
		}},
		{"draft disk E", double.Config{Generation: double.GenE, Backend: double.BackendDisk}, false, MethodDraftDisk, func(dir string) []string {
			return seq(probeInfo, probeGen, `POST /init_weight_transfer_engine {"init_info":{}}`, "POST /start_weight_update {}",
				`POST /update_weights {"update_info":{"path":"`+dir+`"}}`, `POST /finish_weight_update {"weight_version":"run/iter-1"}`)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, c, rec := recordedDouble(t, tc.cfg)
			dir, m := checkpoint(t, "the cat sat on the mat. ")
			if tc.paused {
				require.NoError(t, c.Pause(ctx, vllm.PauseKeep))
				rec.Take()
			}
			res, err := NewDisk().Update(ctx, UpdateRequest{
				Target:     Target{RunID: "run", Fleet: vllm.Fleet{c}, Settings: pipelines.WeightTransfer{Backend: pipelines.BackendDisk}},
				Checkpoint: dir, Version: "run/iter-1", Paused: tc.paused,
			})
			require.NoError(t, err)
			assert.Equal(t, []string{tc.method}, res.Methods)
			assert.Equal(t, tc.want(dir), rec.Take())
			assert.Equal(t, m.Checksum(), d.Model().Checksum(), "the server serves the checkpoint")
			paused, err := c.IsPaused(ctx)
			require.NoError(t, err)
			assert.Equal(t, tc.paused, paused, "the server is left as the run holds it")
		})
	}
}

// TestDiskUpdateFailureCleanup: a checkpoint the server cannot load. The
// newest generation closes the failed session itself, so rlflow labels the
// weights instead of finishing a session that is not open; older ones get
// the session finished with the failed label. A failed stock reload labels
// the weights and resumes the server it paused.
func TestDiskUpdateFailureCleanup(t *testing.T) {
	ctx := context.Background()
	// A safetensors file rlflow can read but the double cannot load (not a
	// bigram tensor).
	bad := t.TempDir()
	writeBadCheckpoint(t, filepath.Join(bad, "model.safetensors"))
	tests := []struct {
		name     string
		cfg      double.Config
		wantTail []string
		wantNote string
	}{
		{"draft disk E closes its session", double.Config{Generation: double.GenE, Backend: double.BackendDisk},
			[]string{`POST /update_weight_version {"new_version":"run/iter-1-failed"}`},
			"the server closed its update session itself, weights labelled run/iter-1-failed"},
		{"draft disk D keeps it open", double.Config{Generation: double.GenD, Backend: double.BackendDisk},
			[]string{`POST /finish_weight_update {"weight_version":"run/iter-1-failed"}`},
			"update sessions closed, weights labelled run/iter-1-failed"},
		{"stock E reload", double.Config{Generation: double.GenE, Backend: double.BackendNCCL},
			[]string{`POST /update_weight_version {"new_version":"run/iter-1-failed"}`, "POST /resume"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, c, rec := recordedDouble(t, tc.cfg)
			_, err := NewDisk().Update(ctx, UpdateRequest{
				Target:     Target{RunID: "run", Fleet: vllm.Fleet{c}, Settings: pipelines.WeightTransfer{Backend: pipelines.BackendDisk}},
				Checkpoint: bad, Version: "run/iter-1",
			})
			require.Error(t, err)
			var te *Error
			require.ErrorAs(t, err, &te)
			assert.Equal(t, ServerFailed, te.Kind)
			assert.NotContains(t, err.Error(), "could not close")
			if tc.wantNote != "" {
				assert.Contains(t, err.Error(), tc.wantNote)
			}
			reqs := rec.Take()
			require.GreaterOrEqual(t, len(reqs), len(tc.wantTail))
			assert.Equal(t, tc.wantTail, reqs[len(reqs)-len(tc.wantTail):], "all requests: %q", reqs)
			assert.Equal(t, "run/iter-1-failed", d.WeightVersion())
			paused, err := c.IsPaused(ctx)
			require.NoError(t, err)
			assert.False(t, paused, "never left paused")
		})
	}
}

// writeBadCheckpoint writes a valid safetensors file holding one float32
// tensor that is not a bigram model.
func writeBadCheckpoint(t *testing.T, path string) {
	t.Helper()
	header, err := json.Marshal(map[string]any{"w": map[string]any{"dtype": "F32", "shape": []int{2}, "data_offsets": []int{0, 8}}})
	require.NoError(t, err)
	for len(header)%8 != 0 {
		header = append(header, ' ')
	}
	var b bytes.Buffer
	n := uint64(len(header))
	for i := 0; i < 8; i++ {
		b.WriteByte(byte(n >> (8 * i)))
	}
	b.Write(header)
	b.Write(make([]byte, 8))
	require.NoError(t, os.WriteFile(path, b.Bytes(), 0o644))
}
