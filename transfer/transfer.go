// Package transfer moves a checkpoint's weights, or a resident trainer's,
// into a fleet of vLLM servers. It holds the contract every weight-transfer
// backend implements (Engine), the disk backend (Disk), the ipc backend
// (IPC: vLLM opens CUDA IPC handles of the trainer's snapshot), and what
// they share: group keys, the update-session protocol with its cleanup,
// progress for heartbeats and typed errors. The NCCL backend, which needs a
// GPU, is transfer/ncclengine.
//
// Invariants:
//
//   - Nothing here imports Temporal: the activities call an Engine and
//     classify its *Error (Kind says how); a request whose context ends
//     gets an error wrapping the context's.
//   - Requests are complete: paths are absolute, the version is set and
//     timeouts are positive (or zero where the doc says what zero means);
//     defaults are the activities' business (from the pipelines registry),
//     never an engine's.
//   - A server whose update session an update opened is never left
//     mid-update: a failed update closes every session it opened and did
//     not finish (bounded, best effort), labelling the version as failed,
//     since part of the checkpoint may have loaded.
//   - One group per GroupKey (run and servers with their API generation
//     pins), initialised on first use and again after its loss.
package transfer

import (
	"context"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/vllm"
)

// Engine moves weights to the servers with one backend.
type Engine interface {
	// Init (re)initialises the weight-transfer group of req's run and
	// servers.
	Init(ctx context.Context, req InitRequest) (InitResult, error)
	// Update loads a checkpoint into every server of the fleet, initialising
	// the group first when it has none (or lost it).
	Update(ctx context.Context, req UpdateRequest) (UpdateResult, error)
}

// Target is the run and the servers a transfer serves.
type Target struct {
	RunID string
	Fleet vllm.Fleet
	// Pins are the API generations the pipeline pins, per server ("" =
	// probed); a different pin is a different payload shape, so a
	// different group.
	Pins []vllm.Generation
	// Settings are the pipeline's weight_transfer (packing for nccl).
	Settings pipelines.WeightTransfer
}

// InitRequest initialises a group.
type InitRequest struct {
	Target
	// MasterAddress and MasterPort (nccl) are where rank 0's TCPStore
	// listens: "" means the engine's own address, 0 a free port, fresh on
	// every init. The disk backend has no rendezvous and refuses them.
	MasterAddress string
	MasterPort    int
	// Timeout bounds the whole init.
	Timeout  time.Duration
	Progress *Progress
}

// InitResult is what an init reports.
type InitResult struct {
	// WorldSize is the group: 1 (the trainer) plus every server's world
	// size with data parallelism.
	WorldSize int
	// Group names the group, with how many times it was initialised on
	// this worker (nccl), so a re-initialisation is visible.
	Group string
	// Methods name, per server, how it takes weights (the disk backend's
	// Method*; the nccl engine's rendezvous); nil where there is no choice.
	Methods []string
}

// UpdateRequest loads a checkpoint, or a resident trainer's snapshot, into
// the servers. Exactly one of Checkpoint and Snapshot is set.
type UpdateRequest struct {
	Target
	// Checkpoint is an absolute path: a safetensors file, or a directory
	// of one (single or sharded with model.safetensors.index.json).
	Checkpoint string
	// Snapshot is a resident trainer's published weights in its GPU memory
	// (trainer/PROTOCOL.md "publish"), which the trainer keeps intact until
	// it is released, after Update returned. The nccl backend broadcasts
	// from it straight from the trainer's memory (CUDA IPC); the ipc
	// backend hands its handles to the servers; the disk backend refuses
	// it.
	Snapshot *trainer.Snapshot
	// DType is "keep", "bfloat16" or "float16": float32 tensors of a
	// checkpoint are narrowed on the way (nccl only; the disk backend
	// loads as stored). A snapshot's tensors are sent as they are, the
	// trainer cast them when it published: DType only has to agree.
	DType string
	// Version is the weight version the servers record (C, D).
	Version string
	// Timeout bounds update_weights; 0 scales it with the checkpoint
	// (vllm.UpdateTimeoutFor).
	Timeout time.Duration
	// InitTimeout bounds the init an update runs first when the group has
	// none.
	InitTimeout time.Duration
	// Paused says the run holds every server paused: a backend that must
	// pause around its load (the disk backend's reload) leaves them so.
	Paused   bool
	Progress *Progress
}

// UpdateResult is what an update reports.
type UpdateResult struct {
	Bytes   int64
	Tensors int
	// Source is what was sent: SourceCheckpoint or SourceSnapshot.
	Source string
	// Opened says this update mapped the snapshot's memory (the first
	// from this trainer's snapshot buffer); later ones reuse the mapping.
	Opened bool
	Group  string
	// Initialized says the update had to (re)initialise the group first.
	Initialized bool
	// Methods name, per server, how it took the weights (see
	// InitResult.Methods).
	Methods []string
	// Elapsed is the update itself, without an init it needed first.
	Elapsed time.Duration
}

// The sources of an update (UpdateResult.Source).
const (
	SourceCheckpoint = "checkpoint"
	SourceSnapshot   = "snapshot"
)

// GroupKey names the group of a target: the run, and the servers in rank
// order with their generation pins.
func GroupKey(t Target) string {
	parts := make([]string, len(t.Fleet))
	for i, c := range t.Fleet {
		parts[i] = c.URL()
		if i < len(t.Pins) && t.Pins[i] != "" {
			parts[i] += "=" + string(t.Pins[i])
		}
	}
	return t.RunID + "@" + strings.Join(parts, ",")
}
