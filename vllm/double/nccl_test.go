package double_test

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/nccl/tcpstore"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// trainerStore is rank 0's TCPStore, as the trainer hosts it.
func trainerStore(t *testing.T) (*tcpstore.Server, string, int) {
	t.Helper()
	st, err := tcpstore.Listen(context.Background(), "127.0.0.1:0", tcpstore.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { st.Close() })
	host, port, err := net.SplitHostPort(st.Addr().String())
	require.NoError(t, err)
	p, err := strconv.Atoi(port)
	require.NoError(t, err)
	return st, host, p
}

func testID(b byte) ncclid.ID {
	var id ncclid.ID
	copy(id[:], bytes.Repeat([]byte{b}, ncclid.Size))
	id[0] = 0x02 // NCCL ids start with the socket family; any bytes do here
	return id
}

func initBody(host string, port, rankOffset, worldSize int) string {
	return `{"init_info":{"master_address":"` + host + `","master_port":` + strconv.Itoa(port) +
		`,"rank_offset":` + strconv.Itoa(rankOffset) + `,"world_size":` + strconv.Itoa(worldSize) + `}}`
}

func TestNCCLRendezvousLikeAWorker(t *testing.T) {
	for _, gen := range []double.Generation{double.GenB, double.GenC, double.GenD} {
		st, host, port := trainerStore(t)
		s := start(t, double.Config{Generation: gen, Backend: double.BackendNCCL, DevMode: true, WorldSize: 2, DataParallel: 2})
		id := testID(byte(len(gen)))

		// The init call blocks until the trainer publishes the id, as in vLLM:
		// the trainer sees the workers' ADDs first.
		done := make(chan string, 1)
		go func() {
			status, body := s.call("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 5))
			done <- strconv.Itoa(status) + " " + body
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		require.NoError(t, st.WaitForAdds(ctx, tcpstore.InitKey, 4), "one ADD per worker rank (2 TP x 2 DP)")
		cancel()
		assert.Nil(t, s.NCCLUniqueID())
		st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(id))
		assert.Equal(t, `200 {"message":"Weight transfer initialized"}`, <-done)
		assert.Equal(t, id[:], s.NCCLUniqueID(), "generation %s", gen)
		count, _ := st.Get(tcpstore.InitKey)
		assert.Equal(t, "4", string(count))

		// Valid metadata, but no data plane: a 500 that says so.
		if gen != double.GenB {
			s.ok("POST", "/start_weight_update", "")
		}
		status, body := s.call("POST", "/update_weights", `{"update_info":{"names":["bigram.logits","b"],"dtype_names":["float32","bfloat16"],"shapes":[[128,128],[]]}}`)
		assert.Equal(t, 500, status)
		assert.Contains(t, body, "double: no NCCL data plane: the update_info metadata is valid (2 tensors, 65538 bytes)")
	}
}

func TestNCCLRendezvousWaitsForALateStore(t *testing.T) {
	// Reserve a port, start the init, and only then start the store there.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	s := start(t, double.Config{Generation: double.GenC, Backend: double.BackendNCCL, DevMode: true})
	done := make(chan int, 1)
	go func() {
		status, _ := s.call("POST", "/init_weight_transfer_engine", initBody("127.0.0.1", port, 1, 2))
		done <- status
	}()
	time.Sleep(150 * time.Millisecond)
	st, err := tcpstore.Listen(context.Background(), "127.0.0.1:"+strconv.Itoa(port), tcpstore.Options{})
	require.NoError(t, err)
	defer st.Close()
	st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(testID(9)))
	assert.Equal(t, 200, <-done)
	id := testID(9)
	assert.Equal(t, id[:], s.NCCLUniqueID())
}

func TestNCCLRendezvousFailures(t *testing.T) {
	st, host, port := trainerStore(t)
	s := start(t, double.Config{Generation: double.GenC, Backend: double.BackendNCCL, DevMode: true, RendezvousTimeout: 200 * time.Millisecond})
	t0 := time.Now()
	status, body := s.call("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 2))
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "RuntimeError: TCPStore rendezvous with "+host+":"+strconv.Itoa(port)+": worker 0: ")
	assert.Contains(t, body, "WAIT")
	assert.Contains(t, body, "timed out after 200ms (Config.RendezvousTimeout)")
	assert.Less(t, time.Since(t0), 2*time.Second, "bounded")

	st.Set(tcpstore.UniqueIDKey, []byte("not a pickle"))
	status, body = s.call("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 2))
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "/broadcast_from/0/0 does not hold a pickled ncclUniqueId")
	assert.Nil(t, s.NCCLUniqueID())

	status, body = s.call("POST", "/init_weight_transfer_engine", initBody("127.0.0.1", 1, 1, 2))
	assert.Equal(t, 500, status)
	assert.Contains(t, body, "timed out after 200ms (Config.RendezvousTimeout) (last dial error:")

	// Metadata is validated after a successful init, before any byte moves.
	st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(testID(1)))
	s.ok("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 2))
	s.ok("POST", "/start_weight_update", "")
	for body, want := range map[string]string{
		`{"update_info":{"names":["a","b"],"dtype_names":["float32"],"shapes":[[1],[1]]}}`:              "lists differ in length: 2 names, 1 dtype_names, 2 shapes",
		`{"update_info":{"names":["a"],"dtype_names":["complex64"],"shapes":[[1]]}}`:                    "complex64",
		`{"update_info":{"names":["a"],"dtype_names":["bool"],"shapes":[[1]]}}`:                         "has no NCCL data type",
		`{"update_info":{"names":["a","a"],"dtype_names":["int8","int8"],"shapes":[[1],[1]]}}`:          "update_info.names repeats",
		`{"update_info":{"names":["a"],"dtype_names":["int8"],"shapes":[[-1]]}}`:                        "shapes must be a list of lists of integers",
		`{"update_info":{"names":["a"],"dtype_names":["int8"],"shapes":[[4294967296,4294967296]]}}`:     "is too large",
		`{"update_info":{"names":["a"],"dtype_names":["int8"],"shapes":[[1]],"packed":"yes"}}`:          "packed must be a boolean",
		`{"update_info":{"names":["a"],"dtype_names":["int8"],"shapes":[[1]],"packed_num_buffers":-1}}`: "must be positive",
	} {
		status, out := s.call("POST", "/update_weights", body)
		assert.Equal(t, 500, status, body)
		assert.Contains(t, out, want, body)
	}

	d := start(t, double.Config{Generation: double.GenD, Backend: double.BackendNCCL, DevMode: true})
	for body, want := range map[string]string{
		`{"init_info":{"rank_offset":1,"world_size":2,"nccl_unique_id_b64":"AAAA"}}`:                                                                     "nccl_unique_id_b64: ncclid: decode base64: 3 bytes, want 128",
		`{"init_info":{"rank_offset":1,"world_size":2}}`:                                                                                                 "master_address and master_port are required (or nccl_unique_id_b64)",
		`{"init_info":{"master_address":"h","master_port":1,"rank_offset":1,"world_size":2,"nccl_unique_id_b64":"` + ncclid.EncodeB64(testID(1)) + `"}}`: "not both",
	} {
		status, out := d.call("POST", "/init_weight_transfer_engine", body)
		assert.Equal(t, 500, status, body)
		assert.Contains(t, out, want, body)
	}
}

// lastUpdate is the last update r recorded.
func lastUpdate(t *testing.T, r *double.RecordingReceiver) double.NCCLUpdate {
	t.Helper()
	u := r.Updates()
	require.NotEmpty(t, u, "the data plane received no update")
	return u[len(u)-1]
}

// fp8 (spec section 8): vLLM broadcasts float8_e4m3fn as NCCL type 10 when
// not packed and refuses the other fp8 dtypes (and uint32, uint64, bool)
// there; a packed update carries every dtype as bytes.
func TestNCCLDTypesPackedAndNot(t *testing.T) {
	const noType = "has no NCCL data type in a non-packed broadcast"
	rows := []struct {
		dtype    string
		packed   bool
		err      string // "" means accepted
		ncclType nccl.DataType
	}{
		{"float8_e4m3fn", false, "", nccl.Float8e4m3},
		{"bfloat16", false, "", nccl.Bfloat16},
		{"float8_e5m2", false, noType, 0},
		{"float8_e8m0fnu", false, noType, 0},
		{"uint32", false, noType, 0},
		{"uint64", false, noType, 0},
		{"bool", false, noType, 0},
		{"float8_e4m3fn", true, "", 0},
		{"float8_e5m2", true, "", 0},
		{"float8_e8m0fnu", true, "", 0},
		{"uint32", true, "", 0},
		{"bool", true, "", 0},
		{"complex64", true, `dtype "complex64" is not a torch dtype the vLLM double knows the item size of`, 0},
	}
	servers := map[bool]*testServer{}
	planes := map[bool]*double.RecordingReceiver{}
	for _, packed := range []bool{false, true} {
		planes[packed] = &double.RecordingReceiver{Model: bigram.Random(5)}
		s := start(t, double.Config{Generation: double.GenD, Backend: double.BackendNCCL, DevMode: true, NCCLReceiver: planes[packed]})
		s.ok("POST", "/init_weight_transfer_engine", `{"init_info":{"rank_offset":1,"world_size":2,"packed":`+strconv.FormatBool(packed)+
			`,"nccl_unique_id_b64":"`+ncclid.EncodeB64(testID(4))+`"}}`)
		servers[packed] = s
	}
	for _, r := range rows {
		s, plane := servers[r.packed], planes[r.packed]
		s.ok("POST", "/start_weight_update", "{}")
		status, body := s.call("POST", "/update_weights", `{"update_info":{"names":["bigram.logits","scale"],"dtype_names":["float32","`+r.dtype+`"],"shapes":[[128,128],[4]]}}`)
		s.ok("POST", "/finish_weight_update", "{}")
		if r.err != "" {
			assert.Equal(t, 500, status, "%s packed=%v: %s", r.dtype, r.packed, body)
			assert.Contains(t, errorMessage(t, body), r.err, "%s packed=%v", r.dtype, r.packed)
			continue
		}
		require.Equal(t, 200, status, "%s packed=%v: %s", r.dtype, r.packed, body)
		u := lastUpdate(t, plane)
		dt, err := safetensors.DTypeFromTorch(r.dtype)
		require.NoError(t, err)
		assert.Equal(t, []int64{4 * 128 * 128, 4 * int64(dt.ItemSize())}, u.Bytes, "%s: prod(shape) x item size (fp8: one byte)", r.dtype)
		if r.packed {
			assert.Nil(t, u.NCCLDataTypes, "packed chunks are ncclUint8; no per-tensor type")
		} else {
			assert.Equal(t, []nccl.DataType{nccl.Float32, r.ncclType}, u.NCCLDataTypes, r.dtype)
		}
	}
	servers[false].ok("POST", "/start_weight_update", "{}")
	_, body := servers[false].call("POST", "/update_weights", `{"update_info":{"names":["a"],"dtype_names":["float8_e5m2"],"shapes":[[1]]}}`)
	assert.Contains(t, errorMessage(t, body), "vLLM maps only bfloat16, float16, float32, float64, float8_e4m3fn, int32, int64, int8, uint8; a packed update carries any dtype as bytes",
		"the refusal names what a non-packed update may carry")
}

// The double's non-packed dtype table and the trainer's broadcast plan
// (package plan) both write down vLLM's ncclDataTypeEnum.from_torch; they
// must agree on every dtype, or the trainer sends what the double refuses
// (or the reverse).
func TestNCCLDTypesAgreeWithThePlan(t *testing.T) {
	plane := &double.RecordingReceiver{Model: bigram.Random(5)}
	s := start(t, double.Config{Generation: double.GenB, Backend: double.BackendNCCL, DevMode: true, NCCLReceiver: plane})
	st, host, port := trainerStore(t)
	st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(testID(6)))
	s.ok("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 2))
	for _, d := range safetensors.DTypes() {
		torch := d.TorchName()
		want, planErr := plan.NCCLDataType(torch)
		status, body := s.call("POST", "/update_weights", `{"update_info":{"names":["bigram.logits","t"],"dtype_names":["float32","`+torch+`"],"shapes":[[128,128],[2]]}}`)
		if planErr != nil {
			assert.Equal(t, 500, status, "%s: the plan refuses it, so must the double: %s", torch, body)
			continue
		}
		require.Equal(t, 200, status, "%s: the plan sends it, so the double must take it: %s", torch, body)
		assert.Equal(t, []nccl.DataType{nccl.Float32, want}, lastUpdate(t, plane).NCCLDataTypes, torch)
	}
}
