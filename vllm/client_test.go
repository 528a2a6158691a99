package vllm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// recorded is one request as the double received it.
type recorded struct {
	Method, Path, Query, Body string
}

// server is a double behind an httptest server that records every request.
type server struct {
	*double.Server
	URL string

	mu   sync.Mutex
	reqs []recorded
}

func newServer(t *testing.T, cfg double.Config) *server {
	t.Helper()
	d, err := double.New(cfg)
	require.NoError(t, err)
	s := &server{Server: d}
	h := d.Handler()
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(b))
		s.mu.Lock()
		s.reqs = append(s.reqs, recorded{r.Method, r.URL.Path, r.URL.RawQuery, string(b)})
		s.mu.Unlock()
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		hs.Close()
		d.Close()
	})
	s.URL = hs.URL
	return s
}

// last returns the last recorded request to path.
func (s *server) last(t *testing.T, path string) recorded {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.reqs) - 1; i >= 0; i-- {
		if s.reqs[i].Path == path {
			return s.reqs[i]
		}
	}
	t.Fatalf("no request to %s", path)
	return recorded{}
}

func (s *server) requests() []recorded {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]recorded(nil), s.reqs...)
}

func client(t *testing.T, s *server, opts vllm.Options) *vllm.Client {
	t.Helper()
	c, err := vllm.New(s.URL, opts)
	require.NoError(t, err)
	return c
}

func vllmError(t *testing.T, err error) *vllm.Error {
	t.Helper()
	var e *vllm.Error
	require.ErrorAs(t, err, &e)
	return e
}

// Generation A's /pause knows only wait_for_inflight_requests: wait
// reaches it as that, and keep, which it cannot do, is refused before
// anything is sent.
func TestPauseOnGenerationA(t *testing.T) {
	ctx := context.Background()
	s := newServer(t, double.Config{Generation: double.GenA, DevMode: true})
	c := client(t, s, vllm.Options{})
	err := c.Pause(ctx, vllm.PauseKeep)
	assert.ErrorContains(t, err, "generation A's /pause cannot keep requests frozen")
	assert.Zero(t, s.Stats().Requests["POST /pause"])
	require.NoError(t, c.Pause(ctx, vllm.PauseWait))
	assert.Equal(t, "mode=wait&wait_for_inflight_requests=true", s.last(t, "/pause").Query)
	require.NoError(t, c.Resume(ctx))
}

func TestNewRejectsBadURLs(t *testing.T) {
	for raw, want := range map[string]string{
		"ftp://h:1":              "scheme must be http or https",
		"http://":                "has no host",
		"http://u:p@h:1":         "must not carry credentials",
		"http://h:1/v1":          "ends in /v1",
		"http://h:1/?x=1":        "must not have a query",
		"http://h:1":             "",
		"https://h/prefix/":      "",
		"http://h:1 ":            "",
		"http://h:1/x/v1/":       "ends in /v1",
		"%zz":                    "invalid base URL",
		"http://h:1#frag":        "must not have a query or fragment",
		"http://[::1]:8000/root": "",
	} {
		c, err := vllm.New(raw, vllm.Options{})
		if want == "" {
			assert.NoError(t, err, raw)
			assert.False(t, strings.HasSuffix(c.URL(), "/"), raw)
			continue
		}
		assert.ErrorContains(t, err, want, raw)
		assert.NotContains(t, err.Error(), ":p@", "a password never reaches an error")
	}
	_, err := vllm.New("http://h:1", vllm.Options{Generation: "F"})
	assert.ErrorContains(t, err, `unknown vLLM API generation "F"`)
}

func TestUpdateTimeoutFor(t *testing.T) {
	assert.Equal(t, vllm.DefaultUpdateTimeout, vllm.UpdateTimeoutFor(0))
	assert.Equal(t, 61*time.Second, vllm.UpdateTimeoutFor(1))
	assert.Equal(t, 61*time.Second, vllm.UpdateTimeoutFor(200<<20))
	assert.Equal(t, 62*time.Second, vllm.UpdateTimeoutFor(200<<20+1))
	assert.Equal(t, 60*time.Second+82*time.Second, vllm.UpdateTimeoutFor(16<<30))
	assert.Greater(t, vllm.UpdateTimeoutFor(1_580_000_000_000), 2*time.Hour, "a 790B bf16 checkpoint")
}

func TestDetectGeneration(t *testing.T) {
	ctx := context.Background()
	for _, gen := range []double.Generation{double.GenB, double.GenC, double.GenD} {
		s := newServer(t, double.Config{Generation: gen, DevMode: true, Backend: double.BackendNCCL})
		c := client(t, s, vllm.Options{})
		assert.Equal(t, vllm.Generation(""), c.Generation())
		g, err := c.DetectGeneration(ctx)
		require.NoError(t, err)
		assert.Equal(t, vllm.Generation(gen), g)
		assert.Equal(t, g, c.Generation(), "remembered")
		for _, r := range s.requests() {
			assert.Equal(t, http.MethodGet, r.Method, "the probe never runs a route: %+v", r)
		}
		assert.Equal(t, 0, s.Stats().Requests["POST /start_weight_update"], "no session opened")
	}

	// A dev build of 0.27 is C; an unreadable version cannot tell C from D.
	s := newServer(t, double.Config{Generation: double.GenD, DevMode: true, Version: "0.27.1.dev45+g1234"})
	g, err := client(t, s, vllm.Options{}).DetectGeneration(ctx)
	require.NoError(t, err)
	assert.Equal(t, vllm.GenC, g)
	s = newServer(t, double.Config{Generation: double.GenD, DevMode: true, Version: "main"})
	_, err = client(t, s, vllm.Options{}).DetectGeneration(ctx)
	assert.ErrorContains(t, err, `GET /version: server has sessions, so it is C, D or E, but version "main" does not parse`)
	// The newest generation by its version.
	s = newServer(t, double.Config{Generation: double.GenE, DevMode: true})
	g, err = client(t, s, vllm.Options{}).DetectGeneration(ctx)
	require.NoError(t, err)
	assert.Equal(t, vllm.GenE, g)

	off := newServer(t, double.Config{})
	_, err = client(t, off, vllm.Options{}).DetectGeneration(ctx)
	assert.ErrorContains(t, err, "detect generation: HTTP 404: no weight-transfer routes: start vllm serve with VLLM_SERVER_DEV_MODE=1")
	assert.ErrorContains(t, client(t, off, vllm.Options{}).StartWeightUpdate(ctx), "VLLM_SERVER_DEV_MODE=1", "lazy detection reports it too")

	pinned := newServer(t, double.Config{Generation: double.GenB, DevMode: true})
	c := client(t, pinned, vllm.Options{Generation: vllm.GenC})
	g, err = c.DetectGeneration(ctx)
	require.NoError(t, err)
	assert.Equal(t, vllm.GenC, g)
	assert.Empty(t, pinned.requests(), "a pinned generation is not probed")
	// Pinned wrong: the server's 404 names the call.
	err = c.StartWeightUpdate(ctx)
	assert.EqualError(t, err, "vllm "+pinned.URL+": POST /start_weight_update: HTTP 404: Not Found")
	assert.Equal(t, http.StatusNotFound, vllmError(t, err).Status)
}

func TestControlCalls(t *testing.T) {
	ctx := context.Background()
	for _, gen := range []double.Generation{double.GenB, double.GenC, double.GenD} {
		s := newServer(t, double.Config{Generation: gen, DevMode: true, Backend: double.BackendNCCL, WorldSize: 2, DataParallel: 3})
		c := client(t, s, vllm.Options{})
		n, err := c.WorldSize(ctx, true)
		require.NoError(t, err)
		assert.Equal(t, 6, n)
		assert.Equal(t, "include_dp=true", s.last(t, "/get_world_size").Query)
		n, err = c.WorldSize(ctx, false)
		require.NoError(t, err)
		assert.Equal(t, 2, n)

		for _, mode := range []string{vllm.PauseAbort, vllm.PauseWait, vllm.PauseKeep} {
			require.NoError(t, c.Pause(ctx, mode))
			want := "mode=" + mode
			if mode == vllm.PauseWait {
				want += "&wait_for_inflight_requests=true" // what generation A reads
			}
			assert.Equal(t, want, s.last(t, "/pause").Query)
			paused, err := c.IsPaused(ctx)
			require.NoError(t, err)
			assert.True(t, paused)
			require.NoError(t, c.Resume(ctx))
			paused, err = c.IsPaused(ctx)
			require.NoError(t, err)
			assert.False(t, paused)
		}
		before := len(s.requests())
		err = c.Pause(ctx, "")
		assert.EqualError(t, err, "vllm "+s.URL+`: POST /pause: pause mode "", want abort, wait or keep`)
		assert.Len(t, s.requests(), before, "refused before sending")
	}
}

var logitsUpdate = vllm.UpdateInfo{
	Names:      []string{bigram.TensorName},
	DTypeNames: []string{"float32"},
	Shapes:     [][]int64{{128, 128}},
	Packed:     true, PackedBufferSizeBytes: 4096, PackedNumBuffers: 3,
}

// TestPayloadPlacement asserts the exact bodies per generation and that the
// double (as strict as vLLM's dataclasses) accepts them.
func TestPayloadPlacement(t *testing.T) {
	ctx := context.Background()
	const updateBC = `{"update_info":{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]],"packed":true,"packed_buffer_size_bytes":4096,"packed_num_buffers":3}}`
	const updateD = `{"update_info":{"names":["bigram.logits"],"dtype_names":["float32"],"shapes":[[128,128]]}}`

	for _, gen := range []double.Generation{double.GenB, double.GenC} {
		s := newServer(t, double.Config{Generation: gen, DevMode: true, Backend: double.BackendNCCL})
		c := client(t, s, vllm.Options{Generation: vllm.Generation(gen)})
		require.NoError(t, c.StartWeightUpdate(ctx))
		err := c.UpdateWeights(ctx, logitsUpdate)
		// The double decoded update_info strictly (an unknown key would be a
		// TypeError) and only then found no initialised transfer engine.
		assert.ErrorContains(t, err, "POST /update_weights: HTTP 500: RuntimeError: weight transfer engine is not initialized")
		assert.JSONEq(t, updateBC, s.last(t, "/update_weights").Body, "generation %s", gen)
	}

	rcv := &double.RecordingReceiver{Model: mustTrain(t, "the cat sat\n")}
	s := newServer(t, double.Config{Generation: double.GenD, DevMode: true, Backend: double.BackendNCCL, NCCLReceiver: rcv, WorldSize: 2})
	c := client(t, s, vllm.Options{})
	var id ncclid.ID
	copy(id[:], bytes.Repeat([]byte{7}, ncclid.Size))
	require.NoError(t, c.InitWeightTransfer(ctx, vllm.InitInfo{
		RankOffset: 3, WorldSize: 5, NCCLUniqueIDB64: ncclid.EncodeB64(id),
		Packed: true, PackedBufferSizeBytes: 4096, PackedNumBuffers: 3,
	}))
	assert.JSONEq(t, `{"init_info":{"rank_offset":3,"world_size":5,"packed":true,"packed_buffer_size_bytes":4096,"packed_num_buffers":3,"nccl_unique_id_b64":"`+ncclid.EncodeB64(id)+`"}}`,
		s.last(t, "/init_weight_transfer_engine").Body)
	assert.Equal(t, id[:], s.NCCLUniqueID())
	require.Len(t, rcv.Inits(), 1)
	assert.Equal(t, []int{3, 4}, rcv.Inits()[0].Ranks)

	require.NoError(t, c.StartWeightUpdate(ctx))
	assert.Equal(t, `{}`, s.last(t, "/start_weight_update").Body)
	require.NoError(t, c.UpdateWeights(ctx, logitsUpdate))
	assert.JSONEq(t, updateD, s.last(t, "/update_weights").Body)
	require.NoError(t, c.FinishWeightUpdate(ctx, "step-7"))
	assert.JSONEq(t, `{"weight_version":"step-7"}`, s.last(t, "/finish_weight_update").Body)
	require.Len(t, rcv.Updates(), 1)
	assert.Equal(t, double.NCCLUpdate{
		Names: logitsUpdate.Names, DTypeNames: logitsUpdate.DTypeNames, Shapes: logitsUpdate.Shapes,
		Bytes: []int64{4 * 128 * 128}, Packed: true, PackedBufferSizeBytes: 4096, PackedNumBuffers: 3,
	}, rcv.Updates()[0], "D takes the packed settings from init_info")
	assert.Equal(t, rcv.Model.Checksum(), s.Model().Checksum(), "the received weights serve now")
	v, err := c.WeightInfo(ctx)
	require.NoError(t, err)
	assert.Equal(t, "step-7", v)

	// A client pinned to C against a D server puts packed in update_info:
	// the server's dataclass refuses it, and the error says where and why.
	wrong := client(t, s, vllm.Options{Generation: vllm.GenC})
	require.NoError(t, wrong.StartWeightUpdate(ctx))
	err = wrong.UpdateWeights(ctx, logitsUpdate)
	assert.EqualError(t, err, "vllm "+s.URL+": POST /update_weights: HTTP 500: TypeError: NCCLWeightTransferUpdateInfo.__init__() got an unexpected keyword argument 'packed'")
	require.NoError(t, wrong.FinishWeightUpdate(ctx, ""))
	assert.Equal(t, `{}`, s.last(t, "/finish_weight_update").Body)
}

func TestClientSideRefusals(t *testing.T) {
	ctx := context.Background()
	s := newServer(t, double.Config{Generation: double.GenC, DevMode: true, Backend: double.BackendNCCL})
	c := client(t, s, vllm.Options{Generation: vllm.GenC})
	a := client(t, s, vllm.Options{Generation: vllm.GenA})
	b := client(t, s, vllm.Options{Generation: vllm.GenB})
	d := client(t, s, vllm.Options{Generation: vllm.GenD})
	cases := []struct {
		err  error
		want string
	}{
		{c.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: "h", MasterPort: 1, RankOffset: 1, WorldSize: 2, NCCLUniqueIDB64: "x"}), "nccl_unique_id_b64 needs generation D"},
		{c.InitWeightTransfer(ctx, vllm.InitInfo{MasterPort: 1, RankOffset: 1, WorldSize: 2}), "master_address is empty"},
		{d.InitWeightTransfer(ctx, vllm.InitInfo{RankOffset: 1, WorldSize: 2, NCCLUniqueIDB64: "AAAA"}), "nccl_unique_id_b64: 3 bytes, want 128"},
		{d.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: "h", RankOffset: 1, WorldSize: 2, NCCLUniqueIDB64: "AAAA"}), "replaces master_address/master_port"},
		{c.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: "h", MasterPort: 70000, RankOffset: 1, WorldSize: 2}), "master_port 70000 out of range"},
		{c.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: "h", MasterPort: 1, RankOffset: 0, WorldSize: 2}), "rank_offset 0, want >= 1"},
		{c.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: "h", MasterPort: 1, RankOffset: 1, WorldSize: 1}), "world_size 1 must exceed rank_offset 1"},
		{c.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true, MasterPort: 1}), "init_info is {}, but NCCL fields are set"},
		{b.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true}), "generation B has no disk backend"},
		{c.UpdateWeights(ctx, vllm.UpdateInfo{Names: []string{"a", "b"}, DTypeNames: []string{"float32"}, Shapes: [][]int64{{1}, {2}}}), "2 names, 1 dtype_names, 2 shapes: lengths must match"},
		{c.UpdateWeights(ctx, vllm.UpdateInfo{}), "no tensors"},
		{c.UpdateWeights(ctx, vllm.UpdateInfo{Path: "rel/dir"}), "must be absolute"},
		{c.UpdateWeights(ctx, vllm.UpdateInfo{Path: "/abs", Names: []string{"a"}}), "exclusive"},
		{c.UpdateWeights(ctx, vllm.UpdateInfo{Names: []string{"a"}, DTypeNames: []string{"f"}, Shapes: [][]int64{{-1}}}), "negative dimension"},
		{c.UpdateWeights(ctx, vllm.UpdateInfo{Names: []string{"a"}, DTypeNames: []string{"f"}, Shapes: [][]int64{{1}}, PackedNumBuffers: 2}), "packed is false"},
		{a.UpdateWeights(ctx, logitsUpdate), "generation A derives the packed chunk size itself"},
		{b.UpdateWeightVersion(ctx, "v"), "POST /update_weight_version: not available on generation B"},
		{c.UpdateWeightVersion(ctx, ""), "new_version is empty"},
		{c.Pause(ctx, "ABORT"), `pause mode "ABORT"`},
	}
	for _, cs := range cases {
		require.Error(t, cs.err, cs.want)
		assert.Contains(t, cs.err.Error(), cs.want)
		assert.True(t, strings.HasPrefix(cs.err.Error(), "vllm "+s.URL+": "), cs.err.Error())
	}
	assert.Empty(t, s.requests(), "every refusal happens before a request")

	// A and B have no sessions: start and (on B) finish send nothing.
	require.NoError(t, b.StartWeightUpdate(ctx))
	require.NoError(t, b.FinishWeightUpdate(ctx, "v"))
	require.NoError(t, a.StartWeightUpdate(ctx))
	assert.Empty(t, s.requests())
	// A's routes: the double serves B..D, so A's calls are 404s that name them.
	assert.ErrorContains(t, a.FinishWeightUpdate(ctx, ""), "POST /finalize_weight_update: HTTP 404")
	assert.ErrorContains(t, a.InitWeightTransfer(ctx, vllm.InitInfo{MasterAddress: "h", MasterPort: 1, RankOffset: 1, WorldSize: 2}), "POST /init_weight_transfer: HTTP 404")
	a.UpdateWeights(ctx, vllm.UpdateInfo{Names: []string{"x"}, DTypeNames: []string{"float32"}, Shapes: [][]int64{{}}, Packed: true})
	assert.JSONEq(t, `{"update_info":{"names":["x"],"dtype_names":["float32"],"shapes":[[]],"packed":true}}`, s.last(t, "/update_weights").Body)
}

func mustTrain(t *testing.T, corpus string) *bigram.Model {
	t.Helper()
	m, err := bigram.Train(corpus, bigram.TrainOptions{})
	require.NoError(t, err)
	return m
}

func saveCheckpoint(t *testing.T, m *bigram.Model) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, m.Save(filepath.Join(dir, "model.safetensors")))
	return dir
}

func TestDiskUpdateFlow(t *testing.T) {
	ctx := context.Background()
	for _, gen := range []double.Generation{double.GenC, double.GenD} {
		s := newServer(t, double.Config{Generation: gen, DevMode: true, Seed: 2})
		c := client(t, s, vllm.Options{})
		v, err := c.WeightInfo(ctx)
		require.NoError(t, err)
		assert.Equal(t, "", v, "null before any update")
		before, err := c.WeightChecker(ctx, "checksum", nil)
		require.NoError(t, err)

		require.NoError(t, c.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true}))
		assert.JSONEq(t, `{"init_info":{}}`, s.last(t, "/init_weight_transfer_engine").Body)
		require.NoError(t, c.Pause(ctx, vllm.PauseKeep))
		_, err = c.WeightChecker(ctx, "checksum", nil)
		assert.EqualError(t, err, "vllm "+s.URL+": POST /weight_checker: HTTP 409: weight checker is unavailable while generation is paused; resume first")
		require.NoError(t, c.StartWeightUpdate(ctx))
		ckpt := saveCheckpoint(t, mustTrain(t, "the cat sat on the mat\n"))
		require.NoError(t, c.UpdateWeights(ctx, vllm.UpdateInfo{Path: ckpt, CheckpointBytes: 65536}))
		assert.JSONEq(t, `{"update_info":{"path":`+strings.TrimSpace(mustJSON(ckpt))+`}}`, s.last(t, "/update_weights").Body)
		require.NoError(t, c.FinishWeightUpdate(ctx, "iter-1"))
		require.NoError(t, c.Resume(ctx))

		v, err = c.WeightInfo(ctx)
		require.NoError(t, err)
		assert.Equal(t, "iter-1", v)
		require.NoError(t, c.UpdateWeightVersion(ctx, "iter-1b"))
		assert.JSONEq(t, `{"new_version":"iter-1b"}`, s.last(t, "/update_weight_version").Body)
		v, err = c.WeightInfo(ctx)
		require.NoError(t, err)
		assert.Equal(t, "iter-1b", v)

		var cmp struct {
			Match bool `json:"match"`
		}
		var sums struct {
			Checksums map[string]string `json:"checksums"`
		}
		require.NoError(t, json.Unmarshal(before, &sums))
		require.Contains(t, sums.Checksums, "dp0:pp0:pcp0:tp0:bigram.logits", "keys per shard")
		out, err := c.WeightChecker(ctx, "compare", sums.Checksums)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(out, &cmp))
		assert.False(t, cmp.Match, "the weights changed")
		now, err := c.WeightChecker(ctx, "checksum", nil)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(now, &sums))
		out, err = c.WeightChecker(ctx, "compare", sums.Checksums)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(out, &cmp))
		assert.True(t, cmp.Match, "the same weights match")
		_, err = c.WeightChecker(ctx, "bogus", nil)
		assert.EqualError(t, err, "vllm "+s.URL+`: POST /weight_checker: HTTP 400: unknown action "bogus": want checksum, reset or compare`)

		// Session rules surface as the server's 500 with its reason.
		err = c.UpdateWeights(ctx, vllm.UpdateInfo{Path: ckpt})
		assert.EqualError(t, err, "vllm "+s.URL+": POST /update_weights: HTTP 500: RuntimeError: update_weights called without an open weight update session; call start_weight_update first")
		assert.ErrorContains(t, c.FinishWeightUpdate(ctx, ""), "POST /finish_weight_update: HTTP 500: RuntimeError: finish_weight_update called without an open weight update session")
		require.NoError(t, c.StartWeightUpdate(ctx))
		assert.ErrorContains(t, c.StartWeightUpdate(ctx), "POST /start_weight_update: HTTP 500: RuntimeError: a weight update session is already open")
		assert.ErrorContains(t, c.UpdateWeights(ctx, vllm.UpdateInfo{Path: filepath.Join(ckpt, "nope")}), "HTTP 500: FileNotFoundError")
		require.NoError(t, c.FinishWeightUpdate(ctx, ""))
		assert.Equal(t, 3, s.Stats().Requests["POST /start_weight_update"], "each start sent once, the failed one not retried")
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestTimeoutsAndRetries(t *testing.T) {
	ctx := context.Background()
	slow := newServer(t, double.Config{DevMode: true, Faults: double.Faults{SlowRate: map[string]float64{"*": 1}, SlowBy: time.Second}})
	c := client(t, slow, vllm.Options{Timeouts: vllm.Timeouts{Control: 50 * time.Millisecond}, Retry: vllm.RetryPolicy{Attempts: 2, Initial: time.Millisecond}})
	t0 := time.Now()
	err := c.Resume(ctx)
	assert.EqualError(t, err, "vllm "+slow.URL+": POST /resume: no answer within 50ms (Timeouts.Control)")
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(t0), 900*time.Millisecond)
	assert.Equal(t, 2, slow.Stats().Requests["POST /resume"], "idempotent: retried once (2 attempts)")
	// Not idempotent: one attempt only.
	err = client(t, slow, vllm.Options{Generation: vllm.GenD, Timeouts: vllm.Timeouts{Control: 50 * time.Millisecond}}).StartWeightUpdate(ctx)
	assert.ErrorContains(t, err, "POST /start_weight_update: no answer within 50ms (Timeouts.Control)")
	assert.Equal(t, 1, slow.Stats().Requests["POST /start_weight_update"])

	// The caller's context wins when it is sooner, and is named as such.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	err = c.Resume(cctx)
	assert.ErrorIs(t, err, context.Canceled)
	assert.ErrorContains(t, err, "POST /resume: context canceled")

	flaky := newServer(t, double.Config{DevMode: true, Seed: 1, Faults: double.Faults{ErrorRate: map[string]float64{"/is_paused": 0.5, "/start_weight_update": 1}}})
	fc := client(t, flaky, vllm.Options{Retry: vllm.RetryPolicy{Attempts: 10, Initial: time.Millisecond}})
	for range 10 {
		_, err := fc.IsPaused(ctx)
		require.NoError(t, err, "retries ride out a 50% error rate")
	}
	assert.Greater(t, flaky.Stats().Requests["GET /is_paused"], 10)
	err = fc.StartWeightUpdate(ctx)
	assert.EqualError(t, err, "vllm "+flaky.URL+": POST /start_weight_update: HTTP 500: double: injected fault (Faults.ErrorRate)")
	assert.Equal(t, 1, flaky.Stats().Requests["POST /start_weight_update"], "never retried")

	// Transport errors name server and call.
	dead, _ := vllm.New("http://127.0.0.1:1", vllm.Options{Retry: vllm.RetryPolicy{Attempts: 1}})
	_, err = dead.IsPaused(ctx)
	assert.ErrorContains(t, err, "vllm http://127.0.0.1:1: GET /is_paused: dial tcp 127.0.0.1:1: connect: connection refused")
	assert.Equal(t, 0, vllmError(t, err).Status)
}

func TestCompletionsAndChat(t *testing.T) {
	ctx := context.Background()
	s := newServer(t, double.Config{ModelName: "m", APIKey: "sekrit"})
	c := client(t, s, vllm.Options{APIKey: "sekrit"})
	zero := float32(0)
	seed := 5
	res, err := c.Completions(ctx, vllm.CompletionRequest{Model: "m", Prompts: []string{"ab", "c"}, N: 2, MaxTokens: 6, Seed: &seed, Logprobs: 2, Stop: []string{"\n"}})
	require.NoError(t, err)
	require.Len(t, res.Choices, 4)
	for i, ch := range res.Choices {
		assert.Equal(t, i, ch.Index)
		assert.Equal(t, i/2, ch.PromptIndex)
		assert.Contains(t, []string{"stop", "length"}, ch.FinishReason)
		require.NotEmpty(t, ch.Logprobs)
		assert.Len(t, ch.Logprobs[0].Top, 2)
	}
	assert.Equal(t, 3, res.Usage.PromptTokens)
	assert.Equal(t, res.Usage.PromptTokens+res.Usage.CompletionTokens, res.Usage.TotalTokens)
	body := s.last(t, "/v1/completions").Body
	assert.JSONEq(t, `{"model":"m","prompt":["ab","c"],"logprobs":2,"max_tokens":6,"n":2,"seed":5,"stop":["\n"],"stream":false}`, body)

	// Temperature 0 is greedy, though go-openai cannot send a zero float.
	g1, err := c.Completions(ctx, vllm.CompletionRequest{Model: "m", Prompts: []string{"x"}, MaxTokens: 20, Temperature: &zero})
	require.NoError(t, err)
	assert.Contains(t, s.last(t, "/v1/completions").Body, `"temperature":0.000001`)
	g2, err := c.Completions(ctx, vllm.CompletionRequest{Model: "m", Prompts: []string{"x"}, MaxTokens: 20, Temperature: &zero})
	require.NoError(t, err)
	assert.Equal(t, g1.Choices, g2.Choices)

	chat, err := c.Chat(ctx, vllm.ChatRequest{Model: "m", Messages: []vllm.Message{{Role: "user", Content: "hi"}}, N: 3, MaxTokens: 5, Logprobs: true, TopLogprobs: 1})
	require.NoError(t, err)
	require.Len(t, chat.Choices, 3)
	assert.Equal(t, 3, chat.Usage.PromptTokens)
	assert.Len(t, chat.Choices[0].Logprobs[0].Top, 1)
	assert.JSONEq(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5,"n":3,"stream":false,"logprobs":true,"top_logprobs":1}`,
		s.last(t, "/v1/chat/completions").Body)

	_, err = c.Completions(ctx, vllm.CompletionRequest{Model: "nope", Prompts: []string{"x"}})
	assert.EqualError(t, err, "vllm "+s.URL+": POST /v1/completions: HTTP 404: The model `nope` does not exist.")
	_, err = c.Chat(ctx, vllm.ChatRequest{Model: "m", Messages: []vllm.Message{{Role: "user", Content: "x"}}, MaxTokens: 5000})
	assert.ErrorContains(t, err, "POST /v1/chat/completions: HTTP 400: This model's maximum context length is 2048 tokens")
	nokey := client(t, s, vllm.Options{})
	_, err = nokey.Completions(ctx, vllm.CompletionRequest{Model: "m", Prompts: []string{"x"}})
	assert.EqualError(t, err, "vllm "+s.URL+": POST /v1/completions: HTTP 401: Unauthorized")
	_, err = c.Completions(ctx, vllm.CompletionRequest{Model: "m"})
	assert.ErrorContains(t, err, "no prompts")
}

func TestAbortedGenerationsSayAbort(t *testing.T) {
	ctx := context.Background()
	s := newServer(t, double.Config{DevMode: true, Latency: 500 * time.Millisecond})
	c := client(t, s, vllm.Options{})
	done := make(chan *vllm.Result, 1)
	go func() {
		r, _ := c.Completions(ctx, vllm.CompletionRequest{Model: double.DefaultModelName, Prompts: []string{"a", "b"}, MaxTokens: 40})
		done <- r
	}()
	for s.Stats().Prompts["b"] == 0 {
		time.Sleep(2 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	require.NoError(t, c.Pause(ctx, vllm.PauseAbort))
	r := <-done
	require.NotNil(t, r)
	for _, ch := range r.Choices {
		assert.Equal(t, "abort", ch.FinishReason)
	}
	require.NoError(t, c.Resume(ctx))
}

func TestFleet(t *testing.T) {
	ctx := context.Background()
	var servers []*server
	var fleet vllm.Fleet
	for i, ws := range []int{2, 4, 1} {
		cfg := double.Config{DevMode: true, WorldSize: ws}
		if i == 1 {
			cfg.Faults = double.Faults{ErrorRate: map[string]float64{"/pause": 1}}
		}
		s := newServer(t, cfg)
		servers = append(servers, s)
		fleet = append(fleet, client(t, s, vllm.Options{Retry: vllm.RetryPolicy{Attempts: 1}}))
	}
	top, err := fleet.WorldSizes(ctx)
	require.NoError(t, err)
	assert.Equal(t, vllm.Topology{Sizes: []int{2, 4, 1}, RankOffsets: []int{1, 3, 7}, WorldSize: 8}, top)

	err = fleet.PauseAll(ctx, vllm.PauseKeep)
	var fe *vllm.FleetError
	require.ErrorAs(t, err, &fe)
	require.Len(t, fe.Failed, 1)
	assert.Equal(t, servers[1].URL, fe.Failed[0].Server)
	// The 500 leaves the outcome unknown, so server 1 is resumed too.
	assert.ElementsMatch(t, []string{servers[0].URL, servers[1].URL, servers[2].URL}, fe.Resumed)
	assert.Empty(t, fe.ResumeFailed)
	assert.Equal(t, "vllm fleet: pause failed on 1 of 3 servers; vllm "+servers[1].URL+": POST /pause: HTTP 500: double: injected fault (Faults.ErrorRate); resumed "+
		strings.Join(fe.Resumed, ", ")+" again", err.Error())
	for _, s := range servers {
		assert.False(t, s.paused(t), "no server is left paused")
	}
	var one *vllm.Error
	assert.ErrorAs(t, err, &one, "per-server errors unwrap")

	// A server that answered 4xx certainly did not pause: it is not resumed.
	noDev := newServer(t, double.Config{})
	err = vllm.Fleet{fleet[0], client(t, noDev, vllm.Options{})}.PauseAll(ctx, vllm.PauseWait)
	require.ErrorAs(t, err, &fe)
	assert.Equal(t, []string{servers[0].URL}, fe.Resumed)
	assert.Equal(t, 1, noDev.Stats().Requests["unknown route"], "only the pause reached it, no resume")
	assert.False(t, servers[0].paused(t))

	ok := vllm.Fleet{fleet[0], fleet[2]}
	require.NoError(t, ok.PauseAll(ctx, vllm.PauseAbort))
	assert.True(t, servers[0].paused(t))
	assert.True(t, servers[2].paused(t))

	dead, _ := vllm.New("http://127.0.0.1:1", vllm.Options{Retry: vllm.RetryPolicy{Attempts: 1}})
	err = vllm.Fleet{fleet[0], dead, fleet[2]}.ResumeAll(ctx)
	require.ErrorAs(t, err, &fe)
	require.Len(t, fe.Failed, 1)
	assert.Equal(t, "http://127.0.0.1:1", fe.Failed[0].Server)
	assert.False(t, servers[0].paused(t), "the reachable servers were resumed anyway")
	assert.False(t, servers[2].paused(t))

	_, err = vllm.Fleet{}.WorldSizes(ctx)
	assert.ErrorContains(t, err, "no servers")
	_, err = vllm.Fleet{dead}.WorldSizes(ctx)
	assert.ErrorContains(t, err, "vllm fleet: world size failed on 1 of 1 servers; vllm http://127.0.0.1:1: GET /get_world_size")
}

func (s *server) paused(t *testing.T) bool {
	t.Helper()
	resp, err := http.Get(s.URL + "/is_paused")
	require.NoError(t, err)
	defer resp.Body.Close()
	var v struct {
		IsPaused bool `json:"is_paused"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&v))
	return v.IsPaused
}

// TestNCCLFlow runs the whole NCCL control plane for B, C and D: the
// double joins the trainer's TCPStore as a worker, and a fake data plane
// hands it the "broadcast" weights.
func TestNCCLFlow(t *testing.T) {
	ctx := context.Background()
	for _, gen := range []vllm.Generation{vllm.GenB, vllm.GenC, vllm.GenD} {
		st, err := tcpstore.Listen(ctx, "127.0.0.1:0", tcpstore.Options{})
		require.NoError(t, err)
		defer st.Close()
		port := st.Addr().(*net.TCPAddr).Port
		var id ncclid.ID
		id[5] = 42
		st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(id))

		trained := mustTrain(t, "the dog ran\n")
		rcv := &double.RecordingReceiver{Model: trained}
		s := newServer(t, double.Config{Generation: double.Generation(gen), Backend: double.BackendNCCL, DevMode: true, NCCLReceiver: rcv, WorldSize: 2})
		c := client(t, s, vllm.Options{})
		top, err := vllm.Fleet{c}.WorldSizes(ctx)
		require.NoError(t, err)
		init := vllm.InitInfo{MasterAddress: "127.0.0.1", MasterPort: port, RankOffset: top.RankOffsets[0], WorldSize: top.WorldSize,
			Packed: true, PackedBufferSizeBytes: 4096, PackedNumBuffers: 3}
		require.NoError(t, c.InitWeightTransfer(ctx, init))
		want := `{"init_info":{"master_address":"127.0.0.1","master_port":` + strconv.Itoa(port) + `,"rank_offset":1,"world_size":3}}`
		if gen == vllm.GenD {
			want = `{"init_info":{"master_address":"127.0.0.1","master_port":` + strconv.Itoa(port) + `,"rank_offset":1,"world_size":3,"packed":true,"packed_buffer_size_bytes":4096,"packed_num_buffers":3}}`
		}
		assert.JSONEq(t, want, s.last(t, "/init_weight_transfer_engine").Body, "generation %s", gen)
		assert.Equal(t, id[:], s.NCCLUniqueID())
		n, _ := st.Get(tcpstore.InitKey)
		assert.Equal(t, "2", string(n), "one ADD per worker rank")
		require.Len(t, rcv.Inits(), 1)
		assert.Equal(t, []int{1, 2}, rcv.Inits()[0].Ranks)
		assert.Equal(t, 3, rcv.Inits()[0].WorldSize)

		require.NoError(t, c.StartWeightUpdate(ctx))
		require.NoError(t, c.UpdateWeights(ctx, logitsUpdate))
		require.NoError(t, c.FinishWeightUpdate(ctx, "nccl-1"))
		require.Len(t, rcv.Updates(), 1)
		assert.True(t, rcv.Updates()[0].Packed)
		assert.Equal(t, int64(4096), rcv.Updates()[0].PackedBufferSizeBytes, "generation %s: packed settings reach the data plane", gen)
		assert.Equal(t, trained.Checksum(), s.Model().Checksum())
		if gen == vllm.GenB {
			assert.Equal(t, "1", s.WeightVersion(), "B numbers its updates; it has no finish")
			assert.Equal(t, 0, s.Stats().Requests["POST /finish_weight_update"])
		} else {
			assert.Equal(t, "nccl-1", s.WeightVersion())
		}
	}
}

func TestModels(t *testing.T) {
	ctx := context.Background()
	s := newServer(t, double.Config{ModelName: "m1", APIKey: "k"})
	models, err := client(t, s, vllm.Options{APIKey: "k"}).Models(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"m1"}, models)

	_, err = client(t, s, vllm.Options{APIKey: "wrong", Retry: vllm.RetryPolicy{Attempts: 1}}).Models(ctx)
	e := vllmError(t, err)
	assert.Equal(t, http.StatusUnauthorized, e.Status)
	assert.Equal(t, "GET /v1/models", e.Call)

	empty := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(`{"object":"list","data":[]}`))
	}))
	defer empty.Close()
	c, err := vllm.New(empty.URL, vllm.Options{})
	require.NoError(t, err)
	_, err = c.Models(ctx)
	assert.ErrorContains(t, err, "lists no models")
}

func TestNewHTTPClientKeepsConcurrentConnections(t *testing.T) {
	for _, n := range []int{0, 1, 256, 2048} {
		tr := vllm.NewHTTPClient(n).Transport.(*http.Transport)
		assert.GreaterOrEqual(t, tr.MaxIdleConnsPerHost, max(n, 2), "conns %d", n)
		assert.GreaterOrEqual(t, tr.MaxIdleConns, tr.MaxIdleConnsPerHost)
		assert.Zero(t, tr.MaxConnsPerHost, "no cap on open connections")
	}
}
