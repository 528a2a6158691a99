package double_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/tcpstore"
	"github.com/rlflow/rlflow/vllm/double"
)

// vllm:rl_weight_update_operations_in_flight rises while a call runs: an
// NCCL init blocked on the trainer's rendezvous shows as 1.
func TestInFlightGauge(t *testing.T) {
	const gauge = `vllm:rl_weight_update_operations_in_flight{model_name="bigram-double",operation=`
	st, host, port := trainerStore(t)
	s := start(t, double.Config{Generation: double.GenE, DevMode: true})
	_, before := s.call("GET", "/metrics", "")
	assert.NotContains(t, before, "in_flight", "an operation appears once it was first called")

	done := make(chan int, 1)
	go func() {
		status, _ := s.call("POST", "/init_weight_transfer_engine", initBody(host, port, 1, 2))
		done <- status
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, st.WaitForAdds(ctx, tcpstore.InitKey, 1), "the init waits for the trainer's id")
	_, during := s.call("GET", "/metrics", "")
	assert.Contains(t, during, "# TYPE vllm:rl_weight_update_operations_in_flight gauge\n")
	assert.Contains(t, during, gauge+`"init"} 1`+"\n")
	assert.NotContains(t, during, `operation_duration_seconds_count{model_name="bigram-double",operation="init"}`, "not finished yet")

	st.Set(tcpstore.UniqueIDKey, ncclid.Pickle(testID(1)))
	require.Equal(t, 200, <-done)
	s.ok("POST", "/start_weight_update", "")
	s.call("POST", "/update_weights", `{"update_info":{"names":[],"dtype_names":[],"shapes":[]}}`)
	s.call("POST", "/finish_weight_update", "")
	_, after := s.call("GET", "/metrics", "")
	for _, op := range []string{"finish", "init", "start", "update"} {
		assert.Contains(t, after, gauge+strconv.Quote(op)+"} 0\n", op)
		assert.Contains(t, after, `vllm:rl_weight_update_operation_duration_seconds_count{model_name="bigram-double",operation=`+strconv.Quote(op)+"} 1\n", op)
	}
}
