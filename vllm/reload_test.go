package vllm

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestServerInfoForms(t *testing.T) {
	tests := []struct {
		name string
		body string
		want ServerInfo
		ok   bool
	}{
		{"json", `{"vllm_config": {"load_config": {"load_format": "dummy"}, "weight_transfer_config": {"backend": "nccl"}}}`, ServerInfo{LoadFormat: "dummy", WeightTransferBackend: "nccl"}, true},
		{"json enum repr", `{"vllm_config": {"load_config": {"load_format": "LoadFormat.AUTO"}}}`, ServerInfo{LoadFormat: "auto"}, true},
		{"text", `{"vllm_config": "model='m', speculative_config=None, load_format=dummy, weight_transfer_config=WeightTransferConfig(backend='disk'), seed=0"}`, ServerInfo{LoadFormat: "dummy", WeightTransferBackend: "disk"}, true},
		{"text enum", `{"vllm_config": "load_format=<LoadFormat.SAFETENSORS: 'safetensors'>, x=1"}`, ServerInfo{LoadFormat: "safetensors"}, true},
		{"json without the fields", `{"vllm_config": {"model_config": {}}}`, ServerInfo{}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				assert.Equal(t, "json", r.URL.Query().Get("config_format"))
				w.Write([]byte(tc.body))
			}))
			defer hs.Close()
			c, err := New(hs.URL, Options{})
			require.NoError(t, err)
			got, ok, err := c.ServerInfo(context.Background())
			require.NoError(t, err)
			assert.Equal(t, tc.ok, ok)
			assert.Equal(t, tc.want, got)
		})
	}
	hs := httptest.NewServer(http.NotFoundHandler())
	defer hs.Close()
	c, _ := New(hs.URL, Options{})
	_, ok, err := c.ServerInfo(context.Background())
	require.NoError(t, err, "404 is a server without the route, not an error")
	assert.False(t, ok)
}

func TestGenerationOfVersion(t *testing.T) {
	for v, want := range map[string]Generation{"0.27.1": GenC, "0.28.0": GenD, "0.29.3rc1": GenD, "0.30.0": GenE, "1.0.0": GenE} {
		major, minor, ok := parseVersion(v)
		require.True(t, ok, v)
		assert.Equal(t, want, generationOf(major, minor), v)
	}
	for _, g := range Generations {
		p, err := ParseGeneration(strings.ToLower(string(g)))
		require.NoError(t, err)
		assert.Equal(t, g, p)
	}
	_, err := ParseGeneration("F")
	assert.ErrorContains(t, err, "want A, B, C, D or E")
}

func TestNoSessionOpen(t *testing.T) {
	finish := func(status int, msg string) error {
		return &Error{Server: "http://s", Call: "POST /finish_weight_update", Status: status, Message: msg}
	}
	assert.True(t, NoSessionOpen(finish(500, "RuntimeError: finish_weight_update called without a matching start_weight_update")))
	assert.True(t, NoSessionOpen(finish(500, "RuntimeError: finish_weight_update called without an open weight update session")))
	assert.False(t, NoSessionOpen(finish(500, "NCCL error")))
	assert.False(t, NoSessionOpen(finish(400, "called without a matching start_weight_update")), "a 400 is the router's, not the worker's")
	assert.False(t, NoSessionOpen(&Error{Call: "POST /update_weights", Status: 500, Message: "without a matching start_weight_update"}))
	assert.False(t, NoSessionOpen(nil))
}

func TestInitPayloadUniqueIDByGeneration(t *testing.T) {
	id := base64.StdEncoding.EncodeToString(make([]byte, 128))
	for _, g := range Generations {
		_, err := initPayload(g, InitInfo{NCCLUniqueIDB64: id, RankOffset: 1, WorldSize: 2})
		if g == GenD || g == GenE {
			assert.NoError(t, err, g)
		} else {
			assert.ErrorContains(t, err, "nccl_unique_id_b64 needs generation D (newest builds) or E", g)
		}
	}
	p, err := initPayload(GenE, InitInfo{NCCLUniqueIDB64: id, RankOffset: 1, WorldSize: 3, Packed: true, PackedBufferSizeBytes: 1 << 20, PackedNumBuffers: 2})
	require.NoError(t, err)
	b, _ := json.Marshal(p)
	assert.JSONEq(t, `{"rank_offset":1,"world_size":3,"packed":true,"packed_buffer_size_bytes":1048576,"packed_num_buffers":2,"nccl_unique_id_b64":"`+id+`"}`, string(b))
}

func TestUpdateWeightsPerWorker(t *testing.T) {
	var got []byte
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/get_world_size":
			w.Write([]byte(`{"world_size": 2}`))
		case "/update_weights":
			got = make([]byte, r.ContentLength)
			r.Body.Read(got)
			w.Write([]byte(`{"message": "ok"}`))
		}
	}))
	defer hs.Close()
	ctx := context.Background()
	info := UpdateInfo{Names: []string{"w"}, DTypeNames: []string{"bfloat16"}, Shapes: [][]int64{{2}}}
	for _, g := range []Generation{GenB, GenC, GenD} {
		c, _ := New(hs.URL, Options{Generation: g})
		assert.ErrorContains(t, c.UpdateWeightsPerWorker(ctx, []UpdateInfo{info, info}), "needs generation E", g)
	}
	c, _ := New(hs.URL, Options{Generation: GenE})
	assert.ErrorContains(t, c.UpdateWeightsPerWorker(ctx, []UpdateInfo{info}), "1 payloads, the server has 2 inference workers")
	require.NoError(t, c.UpdateWeightsPerWorker(ctx, []UpdateInfo{info, info}))
	assert.JSONEq(t, `{"update_info":[{"names":["w"],"dtype_names":["bfloat16"],"shapes":[[2]]},{"names":["w"],"dtype_names":["bfloat16"],"shapes":[[2]]}]}`, string(got))
}
