package transfer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm"
)

// Disk is the disk backend: every server loads the checkpoint directory
// from a path they all see. Per server, it speaks one of two methods,
// probed at each update (GET /server_info and the routes):
//
//   - MethodDraftDisk, where the server advertises the draft "disk"
//     weight-transfer backend (vLLM pull request #52152, not in stock
//     vLLM): init_info {}, then an update session around update_weights
//     {path}, the version set by finish_weight_update.
//   - MethodReload everywhere else (stock vLLM, dev mode): POST
//     /collective_rpc reload_weights with the directory, which bypasses
//     the weight-transfer session, so the server is paused around it
//     (clearing its cache) unless the run holds it paused already, its
//     workers get update_config load_format auto first when it was not
//     started on a checkpoint load format (a dummy-weights server would
//     otherwise draw new random weights and answer success), and the
//     version is set with update_weight_version and read back.
//
// It runs on any worker and holds no connection; it remembers which groups
// this process initialised (draft-disk servers need init_info {} once), so
// an update initialises on first use and again after a worker restart.
// Safe for concurrent use.
type Disk struct{ inited initedGroups }

// The per-server methods of the disk backend, as the step's outputs name
// them.
const (
	MethodDraftDisk = "draft_disk"
	MethodReload    = "collective_rpc"
	// MethodReloadDummy is MethodReload on a server started with dummy
	// weights (or whose load format is unknown): update_config first.
	MethodReloadDummy = "collective_rpc+update_config"
)

// NewDisk returns the disk backend.
func NewDisk() *Disk { return &Disk{} }

var _ Engine = (*Disk)(nil)

// Init probes each server's method and sends init_info {} to the servers
// of the draft disk backend; reload servers need no init.
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
	methods, err := probeMethods(ctx, req.Fleet)
	if err != nil {
		return InitResult{}, err
	}
	if err := d.init(ctx, key, req.Fleet, methods); err != nil {
		return InitResult{}, err
	}
	return InitResult{WorldSize: topo.WorldSize, Group: key, Methods: methods}, nil
}

func (d *Disk) init(ctx context.Context, key string, f vllm.Fleet, methods []string) error {
	err := f.Each("init weight transfer", func(i int, c *vllm.Client) error {
		if methods[i] != MethodDraftDisk {
			return nil
		}
		return c.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true})
	})
	if err != nil {
		return TransportErrorf(ctx, err, "disk weight transfer init")
	}
	d.inited.add(key)
	return nil
}

// probeMethods chooses each server's method (see Disk).
func probeMethods(ctx context.Context, f vllm.Fleet) ([]string, error) {
	methods := make([]string, len(f))
	err := f.Each("probe checkpoint loading", func(i int, c *vllm.Client) error {
		m, err := probeMethod(ctx, c)
		methods[i] = m
		return err
	})
	if err != nil {
		return nil, TransportErrorf(ctx, err, "disk weight transfer: choosing how each server loads a checkpoint")
	}
	return methods, nil
}

func probeMethod(ctx context.Context, c *vllm.Client) (string, error) {
	info, known, err := c.ServerInfo(ctx)
	if err != nil {
		return "", err
	}
	if known && info.WeightTransferBackend == "disk" {
		gen, err := c.DetectGeneration(ctx)
		if err != nil {
			return "", err
		}
		if gen.HasSessions() {
			return MethodDraftDisk, nil
		}
	}
	rpc, err := c.HasCollectiveRPC(ctx)
	if err != nil {
		return "", err
	}
	if !rpc {
		return "", &vllm.Error{Server: c.URL(), Call: "probe checkpoint loading", Status: 404,
			Message: "the server has neither POST /collective_rpc (stock vLLM started with VLLM_SERVER_DEV_MODE=1) nor the draft disk weight-transfer backend: it cannot load a checkpoint directory"}
	}
	if known && info.LoadFormat != "" && info.LoadFormat != "dummy" {
		return MethodReload, nil
	}
	// Started with dummy weights, or the load format is unknown: setting it
	// to auto costs one call and a reload can then only load the checkpoint.
	return MethodReloadDummy, nil
}

// Update loads the checkpoint's directory into every server by its method.
func (d *Disk) Update(ctx context.Context, req UpdateRequest) (UpdateResult, error) {
	if req.Snapshot != nil {
		return UpdateResult{}, BadInputf("publish from a resident trainer needs weight_transfer.backend nccl or ipc: its snapshot lives in the trainer's GPU memory, and the disk backend loads checkpoint directories")
	}
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
	methods, err := probeMethods(ctx, req.Fleet)
	if err != nil {
		return UpdateResult{}, err
	}
	res := UpdateResult{Bytes: size, Tensors: tensors, Source: SourceCheckpoint, Group: key, Methods: methods}
	if !d.inited.has(key) {
		if err := d.init(ctx, key, req.Fleet, methods); err != nil {
			return UpdateResult{}, err
		}
		res.Initialized = true
	}
	start := time.Now()
	info := vllm.UpdateInfo{Path: dir, CheckpointBytes: size}
	err = updateFleet(ctx, req.Fleet, req.Version, "disk update of "+dir, func(s *Sessions, i int, c *vllm.Client) error {
		if methods[i] == MethodDraftDisk {
			return s.Run(ctx, i, func(ctx context.Context, c *vllm.Client) error { return c.UpdateWeights(ctx, info) }, req.Version)
		}
		return reload(ctx, c, dir, size, req.Version, methods[i] == MethodReloadDummy, req.Paused)
	})
	if err != nil {
		return UpdateResult{}, err
	}
	res.Elapsed = time.Since(start)
	req.Progress.SetSent(size)
	return res, nil
}

// reload is one stock server's update: pause (keep: requests in flight
// wait; the pause clears the cache) unless the run holds it paused,
// update_config when needed, reload_weights, the version set and read
// back, resume when it paused. A failed reload labels the weights
// version+"-failed" (part of the checkpoint may have loaded) and still
// resumes a server it paused: the run's weight checks see the label and
// re-sync.
func reload(ctx context.Context, c *vllm.Client, dir string, size int64, version string, dummy, paused bool) (err error) {
	gen, err := c.DetectGeneration(ctx)
	if err != nil {
		return err
	}
	if !paused {
		// keep: requests in flight wait and go on after; A cannot keep
		// them, so there they finish first.
		mode := vllm.PauseKeep
		if gen == vllm.GenA {
			mode = vllm.PauseWait
		}
		if err := c.Pause(ctx, mode); err != nil {
			return err
		}
		defer func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), vllm.SessionCloseTimeout)
			defer cancel()
			if rerr := c.Resume(rctx); rerr != nil {
				err = errors.Join(err, fmt.Errorf("resuming the server paused for the reload failed, it may still be paused: %w", rerr))
			}
		}()
	}
	if dummy {
		if err := c.UseCheckpointLoadFormat(ctx); err != nil {
			return err
		}
	}
	if err := c.ReloadWeights(ctx, dir, size); err != nil {
		if gen.HasSessions() && version != "" {
			if lerr := c.LabelWeights(ctx, failedVersion(version)); lerr != nil {
				err = errors.Join(err, fmt.Errorf("labelling its weights %q failed too: %w", failedVersion(version), lerr))
			}
		}
		return err
	}
	if !gen.HasSessions() {
		return nil // A and B keep no weight version
	}
	if err := c.UpdateWeightVersion(ctx, version); err != nil {
		return err
	}
	got, err := c.WeightInfo(ctx)
	if err == nil && got != version {
		err = fmt.Errorf("vllm %s: GET /weight_info: weight version %q after the reload, want %q", c.URL(), got, version)
	}
	return err
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
