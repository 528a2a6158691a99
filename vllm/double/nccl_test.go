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

	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
	"github.com/rlflow/rlflow/vllm/double"
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
