package transfer

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm"
)

// Disk is the disk backend: every server loads the checkpoint directory
// from a path they all see (init_info {}, update_info {path}). It runs on
// any worker and holds no connection; it remembers which groups this
// process initialised, so an update initialises on first use and again
// after a worker restart. Safe for concurrent use.
type Disk struct {
	mu          sync.Mutex
	initialized map[string]bool
}

// NewDisk returns the disk backend.
func NewDisk() *Disk { return &Disk{initialized: map[string]bool{}} }

var _ Engine = (*Disk)(nil)

// Init sends init_info {} to every server.
func (d *Disk) Init(ctx context.Context, req InitRequest) (InitResult, error) {
	if req.MasterAddress != "" || req.MasterPort != 0 {
		return InitResult{}, BadInputf("master_address and master_port are for the nccl backend; the disk backend has no rendezvous")
	}
	key := GroupKey(req.Target)
	req.Progress.SetPhase("init", key)
	topo, err := req.Fleet.WorldSizes(ctx)
	if err != nil {
		return InitResult{}, TransportErrorf(ctx, err, "disk weight transfer init: world sizes")
	}
	if err := d.init(ctx, key, req.Fleet); err != nil {
		return InitResult{}, err
	}
	return InitResult{WorldSize: topo.WorldSize, Group: key}, nil
}

func (d *Disk) init(ctx context.Context, key string, f vllm.Fleet) error {
	err := f.Each("init weight transfer", func(_ int, c *vllm.Client) error {
		return c.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true})
	})
	if err != nil {
		return TransportErrorf(ctx, err, "disk weight transfer init")
	}
	d.mu.Lock()
	d.initialized[key] = true
	d.mu.Unlock()
	return nil
}

// Update hands every server the checkpoint's directory in one update
// session each.
func (d *Disk) Update(ctx context.Context, req UpdateRequest) (UpdateResult, error) {
	if req.DType != "" && req.DType != "keep" {
		return UpdateResult{}, BadInputf("dtype %q converts tensors on the nccl path only; the disk backend loads the checkpoint as stored", req.DType)
	}
	dir, size, tensors, err := checkpointDir(req.Checkpoint)
	if err != nil {
		return UpdateResult{}, err
	}
	key := GroupKey(req.Target)
	req.Progress.SetPhase("update", key)
	req.Progress.SetTotal(size)
	d.mu.Lock()
	initialized := d.initialized[key]
	d.mu.Unlock()
	res := UpdateResult{Bytes: size, Tensors: tensors, Group: key}
	if !initialized {
		if err := d.init(ctx, key, req.Fleet); err != nil {
			return UpdateResult{}, err
		}
		res.Initialized = true
	}
	// Any session a server has open is a dead attempt's: this process holds
	// no other (disk updates of one group do not overlap).
	start := time.Now()
	s := NewSessions(req.Fleet, true)
	info := vllm.UpdateInfo{Path: dir, CheckpointBytes: size}
	err = req.Fleet.Each("update weights", func(i int, _ *vllm.Client) error {
		return s.Run(ctx, i, func(ctx context.Context, c *vllm.Client) error { return c.UpdateWeights(ctx, info) }, req.Version)
	})
	if err != nil {
		if note := s.CloseLeftOpen(ctx, req.Version); note != "" {
			return UpdateResult{}, TransportErrorf(ctx, err, "disk update of %s on %s (%s)", dir, ServerList(req.Fleet), note)
		}
		return UpdateResult{}, TransportErrorf(ctx, err, "disk update of %s on %s", dir, ServerList(req.Fleet))
	}
	res.Elapsed = time.Since(start)
	req.Progress.SetSent(size)
	return res, nil
}

// checkpointDir resolves a checkpoint to the absolute directory vLLM
// loads (every *.safetensors in it) and reads its size and tensor count.
func checkpointDir(path string) (dir string, size int64, tensors int, err error) {
	if err := checkAbsolute(path); err != nil {
		return "", 0, 0, err
	}
	st, err := os.Stat(path)
	if err != nil {
		return "", 0, 0, BadInputf("checkpoint %s: %v", path, errors.Unwrap(err))
	}
	dir = path
	if !st.IsDir() {
		if !strings.HasSuffix(path, ".safetensors") {
			return "", 0, 0, BadInputf("checkpoint %s is neither a directory nor a .safetensors file", path)
		}
		// The disk backend loads a whole directory: a file stands for its
		// directory only when nothing else there would be loaded with it.
		dir = filepath.Dir(path)
		others, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
		if len(others) != 1 {
			return "", 0, 0, BadInputf("checkpoint %s: the disk backend loads its whole directory, which holds %d *.safetensors files; give a directory holding one checkpoint", path, len(others))
		}
	}
	ck, err := OpenCheckpoint(dir)
	if err != nil {
		return "", 0, 0, err
	}
	defer ck.Close()
	return dir, ck.TotalBytes(), len(ck.Tensors()), nil
}

// OpenCheckpoint opens a checkpoint file or directory that holds at least
// one tensor; every other outcome is BadInput.
func OpenCheckpoint(path string) (*safetensors.Checkpoint, error) {
	if err := checkAbsolute(path); err != nil {
		return nil, err
	}
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		return nil, BadInputf("checkpoint: %v", err)
	}
	if len(ck.Tensors()) == 0 {
		ck.Close()
		return nil, BadInputf("checkpoint %s holds no tensors", path)
	}
	return ck, nil
}

// checkAbsolute refuses a relative checkpoint path: which file it names
// would depend on the worker's working directory.
func checkAbsolute(path string) error {
	if !filepath.IsAbs(path) {
		return BadInputf("checkpoint %q is not an absolute path", path)
	}
	return nil
}
