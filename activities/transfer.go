package activities

import (
	"context"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
)

// InitTransferInput is the `with` of an init_transfer step.
type InitTransferInput struct {
	Context       pipelines.StepContext `json:"context"`
	MasterAddress string                `json:"master_address,omitempty"`
	MasterPort    int                   `json:"master_port,omitempty"`
	Timeout       pipelines.Duration    `json:"timeout,omitempty"`
}

// InitTransferOutput is an init_transfer step's outputs.
type InitTransferOutput struct {
	WorldSize int    `json:"world_size"`
	Backend   string `json:"backend"`
	// Group names the transfer group (run id + server set + generation of
	// the group on its worker), so a re-initialisation is visible.
	Group   string `json:"group"`
	Attempt int    `json:"_attempt"`
}

// BroadcastInput is the `with` of a broadcast step.
type BroadcastInput struct {
	Context       pipelines.StepContext `json:"context"`
	Checkpoint    string                `json:"checkpoint"`
	Version       string                `json:"version,omitempty"`
	DType         string                `json:"dtype,omitempty"`
	UpdateTimeout pipelines.Duration    `json:"update_timeout,omitempty"`
	Verify        bool                  `json:"verify,omitempty"`
}

// BroadcastOutput is a broadcast step's outputs.
type BroadcastOutput struct {
	Backend string  `json:"backend"`
	Bytes   int64   `json:"bytes"`
	Tensors int     `json:"tensors"`
	Seconds float64 `json:"seconds"`
	GBps    float64 `json:"gb_per_s"`
	Version string  `json:"version"`
	// Initialized is true when this broadcast had to (re)initialise the
	// transfer group first (first use, or the old group was lost).
	Initialized bool `json:"initialized"`
	Attempt     int  `json:"_attempt"`
}

// NCCLTransfer is the GPU worker's NCCL weight path (package gpu implements
// it). It is nil on control workers, which never receive nccl transfer steps
// because the interpreter routes them to a GPU worker.
//
// Implementations keep one transfer group per (run id, server set), reuse it
// across iterations, and re-initialise it when it is missing or poisoned.
type NCCLTransfer interface {
	Init(ctx context.Context, in InitTransferInput, fleet vllm.Fleet) (*InitTransferOutput, error)
	Broadcast(ctx context.Context, in BroadcastInput, fleet vllm.Fleet) (*BroadcastOutput, error)
}
