package double

import (
	"context"
	"sync"

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// RecordingReceiver is a TEST DOUBLE of the NCCL data plane
// (Config.NCCLReceiver) for tests without NCCL: it records each init and
// update the double hands it and "receives" Model's logits, whatever the
// trainer sent, as a receiver that loads only the bigram table would.
type RecordingReceiver struct {
	Model *bigram.Model

	mu      sync.Mutex
	inits   []NCCLInit
	updates []NCCLUpdate
}

var _ NCCLReceiver = (*RecordingReceiver)(nil)

// Init records in.
func (r *RecordingReceiver) Init(_ context.Context, in NCCLInit) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inits = append(r.inits, in)
	return nil
}

// Receive records u and answers Model's logits.
func (r *RecordingReceiver) Receive(_ context.Context, u NCCLUpdate) ([]Tensor, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.updates = append(r.updates, u)
	return []Tensor{{Name: bigram.TensorName, DType: "float32", Shape: []int64{bigram.Vocab, bigram.Vocab}, Data: r.Model.Bytes()}}, nil
}

// Inits returns the inits recorded so far.
func (r *RecordingReceiver) Inits() []NCCLInit {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]NCCLInit(nil), r.inits...)
}

// Updates returns the updates recorded so far.
func (r *RecordingReceiver) Updates() []NCCLUpdate {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]NCCLUpdate(nil), r.updates...)
}
