package double_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

var allGens = []double.Generation{double.GenB, double.GenC, double.GenD, double.GenE}

func TestGenEDefaults(t *testing.T) {
	e := start(t, double.Config{Generation: double.GenE, DevMode: true}).Config()
	assert.Equal(t, double.BackendNCCL, e.Backend, "stock vLLM has no disk backend")
	assert.Equal(t, "0.30.0", e.Version)
	de := start(t, double.Config{Generation: double.GenE, Backend: double.BackendDisk}).Config()
	assert.Equal(t, double.BackendDisk, de.Backend, "the draft disk backend is an option on E")
	assert.Equal(t, double.BackendDisk, start(t, double.Config{Generation: double.GenC}).Config().Backend, "C and D keep disk as the default")
}

// TestBodyShapeRules: B-D let Python fail on a body of the wrong shape (a
// 500 from the handler or the worker); E's router refuses it first (400).
// Bad JSON and a missing info are 400 everywhere; errors inside a payload
// are 500 everywhere.
func TestBodyShapeRules(t *testing.T) {
	type want struct {
		status int
		msg    string
	}
	rows := []struct {
		path, body string
		old, e     want // old: B, C and D
	}{
		{"/init_weight_transfer_engine", `{not json`, want{400, "Invalid JSON format"}, want{400, "Invalid JSON format"}},
		{"/init_weight_transfer_engine", `{}`, want{400, "Missing 'init_info' in request body"}, want{400, "Missing 'init_info' in request body"}},
		{"/init_weight_transfer_engine", `[]`, want{500, "AttributeError: 'list' object has no attribute 'get'"}, want{400, "Request body must be a JSON object, got list"}},
		{"/init_weight_transfer_engine", `"s"`, want{500, "AttributeError: 'str' object has no attribute 'get'"}, want{400, "Request body must be a JSON object, got str"}},
		{"/init_weight_transfer_engine", `{"init_info":[1]}`, want{500, "TypeError: NCCLWeightTransferInitInfo() argument after ** must be a mapping, not list"}, want{400, "'init_info' must be a JSON object, got list"}},
		{"/init_weight_transfer_engine", `{"init_info":"x"}`, want{500, "must be a mapping, not str"}, want{400, "'init_info' must be a JSON object, got str"}},
		{"/init_weight_transfer_engine", `{"init_info":{"bogus":1}}`, want{500, "TypeError: NCCLWeightTransferInitInfo.__init__() got an unexpected keyword argument 'bogus'"}, want{500, "got an unexpected keyword argument 'bogus'"}},
		{"/update_weights", `{}`, want{400, "Missing 'update_info' in request body"}, want{400, "Missing 'update_info' in request body"}},
		{"/update_weights", `[1]`, want{500, "AttributeError: 'list' object has no attribute 'get'"}, want{400, "Request body must be a JSON object, got list"}},
		{"/update_weights", `{"update_info":5}`, want{500, "must be a mapping, not int"}, want{400, "'update_info' must be a JSON object or a list of JSON objects, got int"}},
		{"/update_weights", `{"update_info":[1,2]}`, want{500, "must be a mapping, not list"}, want{400, "'update_info' must be a JSON object or a list of JSON objects, got list"}},
		{"/update_weights", `{"update_info":[{"names":[]}]}`, want{500, "must be a mapping, not list"}, want{500, "TypeError: NCCLWeightTransferUpdateInfo.__init__() missing 2 required positional arguments: 'dtype_names' and 'shapes' (update_info[0])"}},
		{"/update_weights", `{"update_info":{"names":[],"bogus":1}}`, want{500, "got an unexpected keyword argument 'bogus'"}, want{500, "got an unexpected keyword argument 'bogus'"}},
		{"/start_weight_update", `[]`, want{500, "AttributeError: 'list' object has no attribute 'get'"}, want{400, "Request body must be a JSON object, got list"}},
		{"/finish_weight_update", `5`, want{500, "AttributeError: 'int' object has no attribute 'get'"}, want{400, "Request body must be a JSON object, got int"}},
		{"/update_weight_version", `[]`, want{500, "AttributeError"}, want{400, "Request body must be a JSON object, got list"}},
	}
	for _, gen := range allGens {
		s := start(t, double.Config{Generation: gen, Backend: double.BackendNCCL, DevMode: true})
		for _, r := range rows {
			w := r.old
			if gen == double.GenE {
				w = r.e
			}
			if r.path == "/update_weights" && gen != double.GenB {
				s.call("POST", "/start_weight_update", "") // open (or already open: a 500)
			}
			status, body := s.call("POST", r.path, r.body)
			if gen == double.GenB && status == http.StatusNotFound {
				continue // B has no sessions
			}
			assert.Equal(t, w.status, status, "gen %s %s %s: %s", gen, r.path, r.body, body)
			assert.Contains(t, body, w.msg, "gen %s %s %s", gen, r.path, r.body)
		}
	}
}

// E takes update_info as a list, one entry per inference worker; the
// double's single model needs them equal.
func TestUpdateInfoList(t *testing.T) {
	ckpt := writeCheckpoint(t, "the cat sat on the mat\n")
	other := writeCheckpoint(t, "a dog\n")
	entry := `{"path":` + jsonString(ckpt) + `}`
	list := func(entries ...string) string {
		out := `{"update_info":[`
		for i, e := range entries {
			if i > 0 {
				out += ","
			}
			out += e
		}
		return out + `]}`
	}
	e := start(t, double.Config{Generation: double.GenE, Backend: double.BackendDisk, DevMode: true, WorldSize: 2, DataParallel: 2})
	for _, c := range []struct {
		body   string
		status int
		msg    string
	}{
		{list(entry, entry, entry), 500, "ValueError: update_info has 3 entries but the server has 4 inference workers (data_parallel_size 2 x tensor_parallel_size*pipeline_parallel_size 2)"},
		{list(), 500, "update_info has 0 entries but the server has 4 inference workers"},
		{list(entry, entry, `{"path":`+jsonString(other)+`}`, entry), 500, "double: update_info[0] and update_info[2] differ: the vLLM double serves one model for all its workers and does not support differing per-worker payloads (a double limitation"},
		{list(entry, entry, `{"path":"/x","names":[]}`, entry), 500, "TypeError: DiskWeightTransferUpdateInfo.__init__() got an unexpected keyword argument 'names' (update_info[2])"},
		{list(entry, entry, entry, entry), 200, "Weights updated"},
	} {
		e.ok("POST", "/start_weight_update", "")
		status, body := e.call("POST", "/update_weights", c.body)
		assert.Equal(t, c.status, status, "%s: %s", c.body, body)
		assert.Contains(t, body, c.msg, c.body)
		if status == http.StatusOK {
			e.ok("POST", "/finish_weight_update", "")
		}
	}
	want, err := bigram.Load(ckpt)
	require.NoError(t, err)
	assert.Equal(t, want.Checksum(), e.Model().Checksum(), "the one payload of four equal entries was loaded")

	// Dense NCCL: four equal entries are one valid update (the double has
	// no data plane, which it says after validating them).
	n := start(t, double.Config{Generation: double.GenE, DevMode: true, WorldSize: 2, DataParallel: 2})
	n.ok("POST", "/init_weight_transfer_engine", `{"init_info":{"rank_offset":1,"world_size":5,"nccl_unique_id_b64":"`+ncclid.EncodeB64(testID(3))+`"}}`)
	meta := `{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]]}`
	for body, msg := range map[string]string{
		list(meta, meta, meta, meta): "double: no NCCL data plane: the update_info metadata is valid (1 tensors, 65536 bytes)",
		list(meta, meta, meta, `{"names":["bigram.logits"],"dtype_names":["bfloat16"],"shapes":[[128,128]]}`): "update_info[0] and update_info[3] differ",
	} {
		n.ok("POST", "/start_weight_update", "")
		status, out := n.call("POST", "/update_weights", body)
		assert.Equal(t, 500, status, out)
		assert.Contains(t, out, msg)
	}

	// D has no list form: Python fails on the list as a mapping.
	d := start(t, double.Config{Generation: double.GenD, DevMode: true})
	d.ok("POST", "/start_weight_update", "")
	status, body := d.call("POST", "/update_weights", list(entry))
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "TypeError: DiskWeightTransferUpdateInfo() argument after ** must be a mapping, not list")
}

// After a failed update_weights (a 500), E's worker closes the session
// itself; C and D keep it open. A 400 never reaches the engine.
func TestFailedUpdateSession(t *testing.T) {
	const eNoSession = "RuntimeError: finish_weight_update called without a matching start_weight_update"
	for _, gen := range []double.Generation{double.GenC, double.GenD, double.GenE} {
		s := start(t, double.Config{Generation: gen, Backend: double.BackendDisk, DevMode: true})
		s.ok("POST", "/start_weight_update", "")
		status, body := s.call("POST", "/update_weights", `{"update_info":{"path":"relative/dir"}}`)
		require.Equal(t, 500, status, body)
		assert.Contains(t, body, "must be an absolute directory")
		status, body = s.call("POST", "/finish_weight_update", "{}")
		if gen == double.GenE {
			assert.Equal(t, 500, status, "E closed the session itself")
			assert.JSONEq(t, `{"error":{"message":"`+eNoSession+`","type":"InternalServerError","param":null,"code":500}}`, body)
			s.ok("POST", "/start_weight_update", "") // a new session opens at once
			s.ok("POST", "/finish_weight_update", "")
		} else {
			assert.Equal(t, 200, status, "gen %s keeps the session open: %s", gen, body)
		}

		// Unknown payload keys are raised in the worker: a 500, so E closes.
		s.ok("POST", "/start_weight_update", "")
		status, _ = s.call("POST", "/update_weights", `{"update_info":{"path":"/x","bogus":1}}`)
		require.Equal(t, 500, status)
		status, _ = s.call("POST", "/start_weight_update", "")
		if gen == double.GenE {
			assert.Equal(t, 200, status, "E: the failed update closed the session")
		} else {
			assert.Equal(t, 500, status, "gen %s: still open", gen)
		}
		s.ok("POST", "/finish_weight_update", "")

		// A body refused before the engine leaves the session alone.
		s.ok("POST", "/start_weight_update", "")
		status, _ = s.call("POST", "/update_weights", `{}`)
		require.Equal(t, 400, status)
		s.ok("POST", "/finish_weight_update", "")

		status, body = s.call("POST", "/finish_weight_update", "")
		assert.Equal(t, 500, status)
		if gen == double.GenE {
			assert.Contains(t, body, eNoSession)
		} else {
			assert.Contains(t, body, "RuntimeError: finish_weight_update called without an open weight update session")
		}
	}
}

// is_checkpoint_format on a D/E nccl start makes current vLLM builds hang
// the streaming; the double answers the update with a 500 naming it.
func TestCheckpointFormatOnNCCL(t *testing.T) {
	meta := `{"update_info":{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]]}}`
	for _, gen := range []double.Generation{double.GenD, double.GenE} {
		s := start(t, double.Config{Generation: gen, Backend: double.BackendNCCL, DevMode: true})
		s.ok("POST", "/init_weight_transfer_engine", `{"init_info":{"rank_offset":1,"world_size":2,"nccl_unique_id_b64":"`+ncclid.EncodeB64(testID(1))+`"}}`)
		for _, start := range []string{`{"is_checkpoint_format":true}`, `{"is_checkpoint_format":false}`} {
			s.ok("POST", "/start_weight_update", start)
			status, body := s.call("POST", "/update_weights", meta)
			assert.Equal(t, 500, status)
			assert.Contains(t, body, "RuntimeError: double: start_weight_update was sent is_checkpoint_format, which makes current vLLM builds hang the NCCL streaming of update_weights", "gen %s %s", gen, start)
			if gen == double.GenD {
				s.ok("POST", "/finish_weight_update", "")
			}
		}
		// A start without it: the update gets as far as the data plane.
		for _, start := range []string{"", "{}", `{"is_checkpoint_format":null}`} {
			s.ok("POST", "/start_weight_update", start)
			status, body := s.call("POST", "/update_weights", meta)
			assert.Equal(t, 500, status)
			assert.Contains(t, body, "double: no NCCL data plane", "gen %s %q", gen, start)
			if gen == double.GenD {
				s.ok("POST", "/finish_weight_update", "")
			}
		}
	}
}

// The pickled id may name the vllm.backends module only on E; every
// generation takes the legacy module. PickleModule records what came.
func TestPickleModulePerGeneration(t *testing.T) {
	for _, gen := range allGens {
		for _, module := range ncclid.Modules {
			st, host, port := trainerStore(t)
			s := start(t, double.Config{Generation: gen, Backend: double.BackendNCCL, DevMode: true, RendezvousTimeout: 5 * time.Second})
			pickle, err := ncclid.PickleIn(testID(7), module)
			require.NoError(t, err)
			st.Set(tcpstore.UniqueIDKey, pickle)
			status, body := s.call("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 2))
			assert.Equal(t, module, s.PickleModule(), "gen %s", gen)
			if module == ncclid.BackendsModulePath && gen != double.GenE {
				assert.Equal(t, 500, status, "gen %s: %s", gen, body)
				assert.Contains(t, body, "ModuleNotFoundError: No module named 'vllm.backends' (unpickling the ncclUniqueId under /broadcast_from/0/0: generation "+string(gen))
				assert.Nil(t, s.NCCLUniqueID())
				continue
			}
			assert.Equal(t, 200, status, "gen %s module %s: %s", gen, module, body)
			id := testID(7)
			assert.Equal(t, id[:], s.NCCLUniqueID())
		}
	}
	e := start(t, double.Config{Generation: double.GenE, DevMode: true})
	e.ok("POST", "/init_weight_transfer_engine", `{"init_info":{"rank_offset":1,"world_size":2,"nccl_unique_id_b64":"`+ncclid.EncodeB64(testID(2))+`"}}`)
	assert.Equal(t, "", e.PickleModule(), "no pickle when the id came as base64")
}

// E removed wait_for_inflight_requests: FastAPI ignores the unknown query
// parameter, so mode decides (default abort). D still reads it.
func TestPauseQueryPerGeneration(t *testing.T) {
	for _, c := range []struct {
		gen    double.Generation
		query  string
		status int
	}{
		{double.GenD, "?wait_for_inflight_requests=maybe", 400},
		{double.GenE, "?wait_for_inflight_requests=maybe", 200},
		{double.GenE, "?clear_cache=maybe", 400},
		{double.GenE, "?mode=sideways", 400},
		{double.GenE, "?mode=keep&clear_cache=false", 200},
	} {
		s := start(t, double.Config{Generation: c.gen, DevMode: true})
		status, body := s.call("POST", "/pause"+c.query, "")
		assert.Equal(t, c.status, status, "gen %s %s: %s", c.gen, c.query, body)
	}

	// On E the old spelling of mode=wait is ignored: the default abort ends
	// the in-flight request.
	s := start(t, double.Config{Generation: double.GenE, DevMode: true, Latency: 5 * time.Second})
	inflight := s.asyncComplete(slowReq)
	testutil.Eventually(t, 5*time.Second, "sequence running", func() bool { return s.Stats().PeakRunning == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", s.url+"/pause?wait_for_inflight_requests=true", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err, "pause did not wait for the 5 s request")
	resp.Body.Close()
	c, ok := <-inflight
	require.True(t, ok)
	assert.Equal(t, "abort", c.Choices[0].FinishReason)
	assert.Equal(t, 1, s.Stats().Aborted)
}
