package double_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

func TestGenADefaults(t *testing.T) {
	a := start(t, double.Config{Generation: double.GenA, DevMode: true}).Config()
	assert.Equal(t, double.BackendNCCL, a.Backend, "A has no disk backend")
	assert.Equal(t, "0.25.0", a.Version)
	assert.Equal(t, int64(80<<30), a.GPUMemoryBytes)
	_, err := double.New(double.Config{Generation: double.GenA, Backend: double.BackendDisk})
	assert.EqualError(t, err, "double: the disk backend needs generation C, D or E, not A")
	_, err = double.New(double.Config{Generation: double.GenA, GPUMemoryBytes: -1})
	assert.Error(t, err)
}

// bodyRecorder serves a double and keeps the body of the last request to
// each path: what the real client put on the wire.
type bodyRecorder struct {
	*double.Server
	url    string
	mu     sync.Mutex
	bodies map[string]string
}

func recordBodies(t *testing.T, cfg double.Config) *bodyRecorder {
	t.Helper()
	s, err := double.New(cfg)
	require.NoError(t, err)
	r := &bodyRecorder{Server: s, bodies: map[string]string{}}
	h := s.Handler()
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		b, _ := io.ReadAll(req.Body)
		req.Body = io.NopCloser(bytes.NewReader(b))
		r.mu.Lock()
		r.bodies[req.Method+" "+req.URL.Path] = string(b)
		r.mu.Unlock()
		h.ServeHTTP(w, req)
	}))
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	r.url = hs.URL
	return r
}

func (r *bodyRecorder) body(t *testing.T, route string) string {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	b, ok := r.bodies[route]
	require.True(t, ok, "no request to %s", route)
	return b
}

// rlflow's client speaks A; the double must take its bodies exactly as they
// are, and the client's probe must find A by its routes.
func TestGenAWithTheRealClient(t *testing.T) {
	ctx := context.Background()
	trained := bigram.Random(11)
	plane := &double.RecordingReceiver{Model: trained}
	s := recordBodies(t, double.Config{Generation: double.GenA, DevMode: true, WorldSize: 2, NCCLReceiver: plane})

	probe, err := vllm.New(s.url, vllm.Options{})
	require.NoError(t, err)
	gen, err := probe.DetectGeneration(ctx)
	require.NoError(t, err)
	assert.Equal(t, vllm.GenA, gen, "GET /init_weight_transfer_engine 404, GET /init_weight_transfer 405")
	assert.Equal(t, 1, s.Stats().Requests["unknown route"], "the probe's GET /init_weight_transfer_engine")
	assert.Equal(t, 1, s.Stats().Requests["GET /init_weight_transfer"], "answered 405, ran nothing")

	c, err := vllm.New(s.url, vllm.Options{Generation: vllm.GenA})
	require.NoError(t, err)
	st, host, port := trainerStore(t)
	id := testID(0xa)
	st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(id))
	require.NoError(t, c.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: host, MasterPort: port, RankOffset: 1, WorldSize: 3}))
	assert.JSONEq(t, `{"init_info":{"master_address":"`+host+`","master_port":`+strconv.Itoa(port)+`,"rank_offset":1,"world_size":3}}`,
		s.body(t, "POST /init_weight_transfer"))
	assert.Equal(t, id[:], s.NCCLUniqueID())
	n, _ := st.Get(tcpstore.InitKey)
	assert.Equal(t, "2", string(n), "one ADD per worker rank")
	require.Len(t, plane.Inits(), 1)
	assert.Equal(t, []int{1, 2}, plane.Inits()[0].Ranks)

	update := vllm.UpdateInfo{Names: []string{bigram.TensorName}, DTypeNames: []string{"float32"}, Shapes: [][]int64{{128, 128}}, Packed: true}
	require.NoError(t, c.StartWeightUpdate(ctx), "no sessions on A: no request")
	require.NoError(t, c.UpdateWeights(ctx, update))
	assert.JSONEq(t, `{"update_info":{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]],"packed":true}}`,
		s.body(t, "POST /update_weights"))
	u := lastUpdate(t, plane)
	assert.True(t, u.Packed)
	assert.Equal(t, int64(1717986918), u.PackedBufferSizeBytes, "min(2% of the default 80 GiB, 5 GiB)")
	assert.Equal(t, 2, u.PackedNumBuffers)
	assert.Equal(t, trained.Checksum(), s.Model().Checksum(), "the received weights serve now")
	require.NoError(t, c.FinishWeightUpdate(ctx, ""))
	assert.Equal(t, `{}`, s.body(t, "POST /finalize_weight_update"))

	update.Packed = false
	require.NoError(t, c.UpdateWeights(ctx, update))
	assert.JSONEq(t, `{"update_info":{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]]}}`,
		s.body(t, "POST /update_weights"))
	assert.False(t, lastUpdate(t, plane).Packed)
	require.NoError(t, c.FinishWeightUpdate(ctx, ""))
	st2 := s.Stats()
	assert.Equal(t, 2, st2.Requests["POST /finalize_weight_update"])
	assert.Zero(t, st2.Requests["POST /start_weight_update"]+st2.Requests["POST /finish_weight_update"])

	// A client pinned to B puts the packed buffer settings in update_info:
	// A's dataclass refuses them before any byte moves.
	wrong, err := vllm.New(s.url, vllm.Options{Generation: vllm.GenB})
	require.NoError(t, err)
	update.Packed, update.PackedBufferSizeBytes = true, 4096
	err = wrong.UpdateWeights(ctx, update)
	assert.EqualError(t, err, "vllm "+s.url+": POST /update_weights: HTTP 500: TypeError: NCCLUpdateInfo.__init__() got an unexpected keyword argument 'packed_buffer_size_bytes'")
}

// A derives its packed chunk size from the GPU: min(2% of total, 5 GiB).
func TestGenAPackedChunkFromGPUMemory(t *testing.T) {
	for _, c := range []struct {
		gpu, want int64
	}{
		{0, 1717986918},            // the default, 80 GiB
		{40 << 30, 858993459},      // int(42949672960 * 0.02)
		{143771 << 20, 3015096401}, // an H200 as torch reports it (143771 MiB)
		{250 << 30, 5 << 30},       // exactly the cap
		{1 << 40, 5 << 30},         // capped
		{1000, 20},                 // any size works: S > T closes a chunk
	} {
		plane := &double.RecordingReceiver{Model: bigram.Random(1)}
		s := start(t, double.Config{Generation: double.GenA, DevMode: true, NCCLReceiver: plane, GPUMemoryBytes: c.gpu})
		st, host, port := trainerStore(t)
		st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(testID(1)))
		s.ok("POST", "/init_weight_transfer", initBody(host, port, 1, 2))
		s.ok("POST", "/update_weights", `{"update_info":{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]],"packed":true}}`)
		u := lastUpdate(t, plane)
		assert.Equal(t, c.want, u.PackedBufferSizeBytes, "GPU memory %d", c.gpu)
		assert.Equal(t, 2, u.PackedNumBuffers)
	}
}

func TestGenARoutesAndBodies(t *testing.T) {
	s := start(t, double.Config{Generation: double.GenA, DevMode: true})
	for _, path := range []string{"/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
		"/update_weight_version", "/weight_info", "/weight_checker", "/abort_requests"} {
		status, _ := s.call("POST", path, "{}")
		assert.Equal(t, http.StatusNotFound, status, path)
	}
	const fullInit = `"master_address":"127.0.0.1","master_port":1,"rank_offset":1,"world_size":2`
	const meta = `"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]]`
	for _, r := range []struct {
		path, body string
		status     int
		msg        string
	}{
		{"/init_weight_transfer", `{not json`, 400, "Invalid JSON format"},
		{"/init_weight_transfer", `{}`, 400, "Missing 'init_info' in request body"},
		{"/init_weight_transfer", `[]`, 500, "AttributeError: 'list' object has no attribute 'get'"},
		{"/init_weight_transfer", `{"init_info":{` + fullInit + `,"packed":true}}`, 500,
			"TypeError: NCCLInitInfo.__init__() got an unexpected keyword argument 'packed'"},
		{"/init_weight_transfer", `{"init_info":{"rank_offset":1,"world_size":2,"nccl_unique_id_b64":"AAAA"}}`, 500,
			"TypeError: NCCLInitInfo.__init__() got an unexpected keyword argument 'nccl_unique_id_b64'"},
		{"/update_weights", `{}`, 400, "Missing 'update_info' in request body"},
		{"/update_weights", `{"update_info":[{` + meta + `}]}`, 500, "TypeError: NCCLUpdateInfo() argument after ** must be a mapping, not list"},
		{"/update_weights", `{"update_info":{` + meta + `,"packed":true,"packed_buffer_size_bytes":4096}}`, 500,
			"TypeError: NCCLUpdateInfo.__init__() got an unexpected keyword argument 'packed_buffer_size_bytes'"},
		{"/update_weights", `{"update_info":{` + meta + `,"packed_num_buffers":2}}`, 500,
			"TypeError: NCCLUpdateInfo.__init__() got an unexpected keyword argument 'packed_num_buffers'"},
		{"/update_weights", `{"update_info":{` + meta + `,"packed":true}}`, 500,
			"RuntimeError: weight transfer engine is not initialized; call init_weight_transfer first"},
		{"/finalize_weight_update", ``, 200, "Weight update finalized"},
		{"/finalize_weight_update", `{}`, 200, "Weight update finalized"},
		{"/finalize_weight_update", " {}\n", 200, "Weight update finalized"},
		{"/finalize_weight_update", `{"weight_version":"v1"}`, 400, "double: /finalize_weight_update takes no body or {}, got an object with key(s) 'weight_version'"},
		{"/finalize_weight_update", `[]`, 400, "takes no body or {}, got a list"},
		{"/finalize_weight_update", `{} {}`, 400, "takes no body or {}, got invalid JSON"},
		{"/finalize_weight_update", `{not json`, 400, "takes no body or {}, got invalid JSON"},
	} {
		status, body := s.call("POST", r.path, r.body)
		assert.Equal(t, r.status, status, "%s %s: %s", r.path, r.body, body)
		assert.Contains(t, body, r.msg, "%s %s", r.path, r.body)
	}

	// No sessions: after an init, update_weights alone is a whole update
	// (here refused only for want of a data plane).
	st, host, port := trainerStore(t)
	st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(testID(2)))
	s.ok("POST", "/init_weight_transfer", initBody(host, port, 1, 2))
	status, body := s.call("POST", "/update_weights", `{"update_info":{`+meta+`}}`)
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "double: no NCCL data plane: the update_info metadata is valid (1 tensors, 65536 bytes)")
}

// A's /pause declares wait_for_inflight_requests and clear_cache only:
// FastAPI ignores mode there, so mode=keep or mode=wait aborts.
func TestGenAPause(t *testing.T) {
	s := start(t, double.Config{Generation: double.GenA, DevMode: true})
	for q, want := range map[string]int{
		"?mode=sideways":                    200,
		"?wait_for_inflight_requests=maybe": 400,
		"?clear_cache=maybe":                400,
		"?wait_for_inflight_requests=true":  200,
		"?clear_cache=false&mode=keep":      200,
	} {
		status, body := s.call("POST", "/pause"+q, "")
		assert.Equal(t, want, status, "%s: %s", q, body)
	}
	s.ok("POST", "/resume", "")

	for _, q := range []string{"?mode=keep", "?mode=wait"} {
		s := start(t, double.Config{Generation: double.GenA, DevMode: true, Latency: 5 * time.Second})
		inflight := s.asyncComplete(slowReq)
		testutil.Eventually(t, 5*time.Second, "sequence running", func() bool { return s.Stats().PeakRunning == 1 })
		s.ok("POST", "/pause"+q, "")
		select {
		case c, ok := <-inflight:
			require.True(t, ok)
			assert.Equal(t, "abort", c.Choices[0].FinishReason, "%s is ignored on A: the default aborts", q)
		case <-time.After(3 * time.Second):
			s.ok("POST", "/resume", "") // let the frozen request end, so cleanup does not wait for it
			t.Errorf("%s froze the in-flight request; A has no mode and must abort it", q)
		}
	}

	s = start(t, double.Config{Generation: double.GenA, DevMode: true, Latency: 300 * time.Millisecond})
	inflight := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "sequence running", func() bool { return s.Stats().PeakRunning == 1 })
	s.ok("POST", "/pause?wait_for_inflight_requests=true", "")
	c, ok := <-inflight
	require.True(t, ok)
	assert.NotEqual(t, "abort", c.Choices[0].FinishReason, "wait_for_inflight_requests=true waits")
}
