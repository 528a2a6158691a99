package transfer

import (
	"context"
	"time"

	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/vllm"
)

// IPC is the ipc backend: vLLM's own ipc weight-transfer backend, for a
// trainer and vLLM workers that share a GPU. A publish hands every server
// CUDA IPC handles of the resident trainer's device snapshot in
// update_info (ipc_handles_pickled: the pickle torch's reduce_tensor makes,
// written here); each server's worker opens them and copies the weights
// device to device. Nothing is broadcast and no file is written.
//
// It runs on the GPU worker that hosts the trainer (the snapshot is only
// exported to this host) and holds no connection; like Disk it remembers
// which groups it initialised (init_info {}), so an update initialises on
// first use and again after a worker restart. Safe for concurrent use.
//
// Invariants: a snapshot's handles are used by one update only: each
// tensor's ref-counter share is consumed by the servers that open it, so a
// retried update publishes again (activities do) rather than resend; only
// snapshots go this way (a checkpoint is BadInput).
type IPC struct{ inited initedGroups }

// MethodIPC is how every server of the ipc backend takes weights (the
// step's methods output).
const MethodIPC = "ipc"

// NewIPC returns the ipc backend.
func NewIPC() *IPC { return &IPC{} }

var _ Engine = (*IPC)(nil)

// Init sends init_info {} to every server.
func (e *IPC) Init(ctx context.Context, req InitRequest) (InitResult, error) {
	if req.MasterAddress != "" || req.MasterPort != 0 {
		return InitResult{}, BadInputf("master_address and master_port are for the nccl backend; the ipc backend has no rendezvous")
	}
	key := GroupKey(req.Target)
	req.Progress.SetPhase("init", key)
	topo, err := req.Fleet.WorldSizes(ctx)
	if err != nil {
		return InitResult{}, TransportErrorf(ctx, err, "ipc weight transfer init: world sizes")
	}
	if err := e.init(ctx, key, req.Fleet); err != nil {
		return InitResult{}, err
	}
	return InitResult{WorldSize: topo.WorldSize, Group: key, Methods: ipcMethods(len(req.Fleet))}, nil
}

func (e *IPC) init(ctx context.Context, key string, f vllm.Fleet) error {
	err := f.Each("init weight transfer", func(_ int, c *vllm.Client) error {
		return c.InitWeightTransfer(ctx, vllm.InitInfo{IPC: true})
	})
	if err != nil {
		return TransportErrorf(ctx, err, "ipc weight transfer init")
	}
	e.inited.add(key)
	return nil
}

// Update hands every server the snapshot's handles in one update session
// each; a failed update closes the sessions it left open, labelling the
// version as failed.
func (e *IPC) Update(ctx context.Context, req UpdateRequest) (UpdateResult, error) {
	snap := req.Snapshot
	if snap == nil {
		return UpdateResult{}, BadInputf("the ipc backend hands vLLM a resident trainer's GPU memory: a checkpoint cannot go this way (use publish, or backend nccl or disk for checkpoints)")
	}
	pickled, err := encodeSnapshotHandles(snap)
	if err != nil {
		return UpdateResult{}, err
	}
	size := snap.Bytes()
	key := GroupKey(req.Target)
	req.Progress.SetPhase("update", key)
	req.Progress.SetTotal(size)
	res := UpdateResult{Bytes: size, Tensors: len(snap.Tensors), Source: SourceSnapshot, Group: key, Methods: ipcMethods(len(req.Fleet))}
	if !e.inited.has(key) {
		if err := e.init(ctx, key, req.Fleet); err != nil {
			return UpdateResult{}, err
		}
		res.Initialized = true
	}
	info := vllm.UpdateInfo{IPCHandlesPickled: pickled, CheckpointBytes: size}
	for _, t := range snap.Tensors {
		info.Names = append(info.Names, t.Name)
		info.DTypeNames = append(info.DTypeNames, t.DType)
		info.Shapes = append(info.Shapes, t.Shape)
	}
	start := time.Now()
	err = updateFleet(ctx, req.Fleet, req.Version, "ipc update of "+req.Version, func(s *Sessions, i int, c *vllm.Client) error {
		return s.Run(ctx, i, func(ctx context.Context, c *vllm.Client) error { return c.UpdateWeights(ctx, info) }, req.Version)
	})
	if err != nil {
		return UpdateResult{}, err
	}
	res.Elapsed = time.Since(start)
	req.Progress.SetSent(size)
	return res, nil
}

// encodeSnapshotHandles writes the snapshot's ipc_handles_pickled: one
// rebuild_cuda_tensor per tensor, each with the ref-counter share the
// trainer made for it.
func encodeSnapshotHandles(snap *trainer.Snapshot) (string, error) {
	if snap.GPUUUID == "" {
		return "", BadInputf("the trainer's publish reported no gpu_uuid: vLLM's ipc backend finds each tensor's handle by its GPU's UUID")
	}
	if len(snap.Refs) != len(snap.Tensors) {
		return "", BadInputf("the trainer's publish has %d ipc_refs for %d tensors: vLLM's ipc backend needs one ref-counter share per tensor", len(snap.Refs), len(snap.Tensors))
	}
	st := vllm.IPCStorage{GPUUUID: snap.GPUUUID, Device: snap.Device, StorageBytes: snap.StorageBytes, StorageOffset: snap.StorageOffset, Handle: snap.ShareHandle()}
	tensors := make([]vllm.IPCTensor, len(snap.Tensors))
	for i, t := range snap.Tensors {
		r := snap.Refs[i]
		tensors[i] = vllm.IPCTensor{Name: t.Name, DType: t.DType, Shape: t.Shape, Offset: t.Offset,
			CounterHandle: r.CounterHandle, CounterOffset: r.CounterOffset, EventHandle: r.EventHandle, EventSyncRequired: r.EventSyncRequired}
	}
	out, err := vllm.EncodeIPCHandles(st, tensors)
	if err != nil {
		return "", BadInputf("the trainer's snapshot cannot be handed to vLLM's ipc backend: %v", err)
	}
	return out, nil
}

func ipcMethods(n int) []string {
	m := make([]string, n)
	for i := range m {
		m[i] = MethodIPC
	}
	return m
}
