package activities

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
)

// Weight-transfer backends (pipelines.WeightTransfer.Backend).
const (
	BackendNCCL = "nccl"
	BackendDisk = "disk"
)

// closeTimeout bounds the best-effort finish_weight_update that closes a
// session after a failed update, even when the step's context is done.
const closeTimeout = 30 * time.Second

// transferBackend returns the pipeline's backend, or the BadInput error for
// a pipeline without (or with an unknown) weight_transfer.
func transferBackend(ctx context.Context, step string, sc pipelines.StepContext) (string, error) {
	wt := sc.WeightTransfer
	if wt == nil {
		return "", badInput(ctx, "%s: the pipeline has no weight_transfer (add weight_transfer: {backend: nccl} or {backend: disk})", step)
	}
	switch wt.Backend {
	case BackendNCCL, BackendDisk:
		return wt.Backend, nil
	}
	return "", badInput(ctx, "%s: weight_transfer.backend %q, want nccl or disk", step, wt.Backend)
}

func noGPU(ctx context.Context, step string) error {
	return stepError(ctx, ErrTypeNoGPUWorker, nil,
		"%s: the nccl backend must run on a GPU worker (start one with `rlflow worker --gpu` on the trainer's host); this worker has no NCCL weight path", step)
}

// transferError keeps the typed errors of the NCCL path and classifies the
// rest as server errors.
func transferError(ctx context.Context, step string, err error) error {
	var app *temporal.ApplicationError
	if errors.As(err, &app) || ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return err
	}
	return serverError(ctx, err, "%s", step)
}

// group names a transfer group: the run and the set of servers.
func group(backend string, sc pipelines.StepContext) string {
	urls := make([]string, len(sc.Servers))
	for i, s := range sc.Servers {
		urls[i] = s.URL
	}
	h := sha256.Sum256([]byte(strings.Join(urls, "\n")))
	return fmt.Sprintf("%s/%s/%s", backend, sc.RunID, hex.EncodeToString(h[:4]))
}

// InitTransfer initialises weight transfer with every server: on a GPU
// worker through Deps.NCCL for nccl; here, with init_info {}, for disk.
func (a *Activities) InitTransfer(ctx context.Context, in InitTransferInput) (*InitTransferOutput, error) {
	backend, err := transferBackend(ctx, "init_transfer", in.Context)
	if err != nil {
		return nil, err
	}
	if backend == BackendNCCL && a.NCCL == nil {
		return nil, noGPU(ctx, "init_transfer")
	}
	f, err := a.fleet(ctx, "init_transfer", in.Context, vllm.Timeouts{Init: in.Timeout.D()})
	if err != nil {
		return nil, err
	}
	if backend == BackendNCCL {
		// The NCCL path heartbeats itself (with its own details).
		out, err := a.NCCL.Init(ctx, in, f)
		if err != nil {
			return nil, transferError(ctx, "init_transfer", err)
		}
		return out, nil
	}
	if in.MasterAddress != "" || in.MasterPort != 0 {
		return nil, badInput(ctx, "init_transfer: master_address and master_port are for the nccl backend; the disk backend has no rendezvous")
	}
	defer a.keepHeartbeating(ctx)()
	topo, err := f.WorldSizes(ctx)
	if err != nil {
		return nil, serverError(ctx, err, "init_transfer")
	}
	if err := a.initDisk(ctx, in.Context, f); err != nil {
		return nil, err
	}
	return &InitTransferOutput{WorldSize: topo.WorldSize, Backend: BackendDisk, Group: group(BackendDisk, in.Context), Attempt: attemptOf(ctx)}, nil
}

// initDisk sends init_info {} to every server and remembers the group.
func (a *Activities) initDisk(ctx context.Context, sc pipelines.StepContext, f vllm.Fleet) error {
	errs := make([]error, len(f))
	var wg sync.WaitGroup
	for i, c := range f {
		wg.Go(func() { errs[i] = c.InitWeightTransfer(ctx, vllm.InitInfo{Disk: true}) })
	}
	wg.Wait()
	if err := fleetError("init weight transfer", f, errs); err != nil {
		return serverError(ctx, err, "disk weight transfer init")
	}
	a.diskMu.Lock()
	if a.diskInit == nil {
		a.diskInit = map[string]bool{}
	}
	a.diskInit[group(BackendDisk, sc)] = true
	a.diskMu.Unlock()
	return nil
}

func (a *Activities) diskInitialized(sc pipelines.StepContext) bool {
	a.diskMu.Lock()
	defer a.diskMu.Unlock()
	return a.diskInit[group(BackendDisk, sc)]
}

// Broadcast sends a checkpoint to every server: through Deps.NCCL for
// nccl; for disk, by handing each server the checkpoint's absolute
// directory in one update session.
func (a *Activities) Broadcast(ctx context.Context, in BroadcastInput) (*BroadcastOutput, error) {
	backend, err := transferBackend(ctx, "broadcast", in.Context)
	if err != nil {
		return nil, err
	}
	if backend == BackendNCCL && a.NCCL == nil {
		return nil, noGPU(ctx, "broadcast")
	}
	if in.Checkpoint == "" {
		return nil, badInput(ctx, "broadcast: checkpoint is required")
	}
	f, err := a.fleet(ctx, "broadcast", in.Context, vllm.Timeouts{Update: in.UpdateTimeout.D()})
	if err != nil {
		return nil, err
	}
	if backend == BackendNCCL {
		out, err := a.NCCL.Broadcast(ctx, in, f)
		if err != nil {
			return nil, transferError(ctx, "broadcast", err)
		}
		return out, nil
	}
	return a.broadcastDisk(ctx, in, f)
}

// checkpointDir resolves a disk checkpoint to the absolute directory vLLM
// loads (every *.safetensors in it) and reads its size and tensor count.
func checkpointDir(base, ckpt string) (dir string, size int64, tensors int, err error) {
	p, err := filepath.Abs(resolvePath(base, ckpt))
	if err != nil {
		return "", 0, 0, fmt.Errorf("checkpoint %q: %v", ckpt, err)
	}
	st, err := os.Stat(p)
	if err != nil {
		return "", 0, 0, fmt.Errorf("checkpoint %s: %w", p, errors.Unwrap(err))
	}
	dir = p
	if !st.IsDir() {
		if !strings.HasSuffix(p, ".safetensors") {
			return "", 0, 0, fmt.Errorf("checkpoint %s is neither a directory nor a .safetensors file", p)
		}
		// The disk backend loads a whole directory: a file stands for its
		// directory only when nothing else there would be loaded with it.
		dir = filepath.Dir(p)
		others, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
		if len(others) != 1 {
			return "", 0, 0, fmt.Errorf("checkpoint %s: the disk backend loads its whole directory, which holds %d *.safetensors files; give a directory holding one checkpoint", p, len(others))
		}
	}
	ck, err := safetensors.OpenCheckpoint(dir)
	if err != nil {
		return "", 0, 0, fmt.Errorf("checkpoint %s: %v", dir, err)
	}
	defer ck.Close()
	if len(ck.Tensors()) == 0 {
		return "", 0, 0, fmt.Errorf("checkpoint %s holds no tensors", dir)
	}
	return dir, ck.TotalBytes(), len(ck.Tensors()), nil
}

func (a *Activities) broadcastDisk(ctx context.Context, in BroadcastInput, f vllm.Fleet) (*BroadcastOutput, error) {
	sc := in.Context
	if in.DType != "" && in.DType != "keep" {
		return nil, badInput(ctx, "broadcast: dtype %q converts tensors on the nccl path only; the disk backend loads the checkpoint as stored", in.DType)
	}
	dir, size, tensors, err := checkpointDir(sc.BaseDir, in.Checkpoint)
	if err != nil {
		return nil, badInput(ctx, "broadcast: %v", err)
	}
	version := in.Version
	if version == "" {
		version = fmt.Sprintf("%s/iter-%d", sc.RunID, sc.Iteration)
	}
	defer a.keepHeartbeating(ctx)()
	initialized := false
	if !a.diskInitialized(sc) {
		if err := a.initDisk(ctx, sc, f); err != nil {
			return nil, err
		}
		initialized = true
	}
	start := time.Now()
	errs := make([]error, len(f))
	var wg sync.WaitGroup
	for i, c := range f {
		wg.Go(func() { errs[i] = updateDisk(ctx, c, dir, size, version) })
	}
	wg.Wait()
	if err := fleetError("update weights", f, errs); err != nil {
		return nil, serverError(ctx, err, "broadcast %s", dir)
	}
	elapsed := time.Since(start)
	if in.Verify {
		for i, c := range f {
			wg.Go(func() {
				got, err := c.WeightInfo(ctx)
				if err == nil && got != version {
					err = fmt.Errorf("vllm %s: GET /weight_info: weight version %q after the update, want %q", c.URL(), got, version)
				}
				errs[i] = err
			})
		}
		wg.Wait()
		if err := fleetError("verify", f, errs); err != nil {
			return nil, serverError(ctx, err, "broadcast: verify")
		}
	}
	out := &BroadcastOutput{Backend: BackendDisk, Bytes: size, Tensors: tensors, Seconds: elapsed.Seconds(),
		Version: version, Initialized: initialized, Attempt: attemptOf(ctx)}
	if out.Seconds > 0 {
		out.GBps = float64(size) / out.Seconds / 1e9
	}
	return out, nil
}

// updateDisk runs one server's update session. A failure after the
// session opened closes it, so the server is not left mid-update; its
// version then says the update failed, since part of the checkpoint may
// have loaded and neither the old nor the new label would be true.
func updateDisk(ctx context.Context, c *vllm.Client, dir string, size int64, version string) error {
	if err := c.StartWeightUpdate(ctx); err != nil {
		// An earlier attempt that died mid-update leaves its session open,
		// and start then fails: close it, and start once more.
		var e *vllm.Error
		if !errors.As(err, &e) || e.Status < http.StatusInternalServerError || closeSession(ctx, c, "") != nil {
			return err
		}
		if err2 := c.StartWeightUpdate(ctx); err2 != nil {
			return fmt.Errorf("%w (closed a session left open, then start failed again: %v)", err, err2)
		}
	}
	if err := c.UpdateWeights(ctx, vllm.UpdateInfo{Path: dir, CheckpointBytes: size}); err != nil {
		if ferr := closeSession(ctx, c, version+"-failed"); ferr != nil {
			return fmt.Errorf("%w; closing the update session failed too, the server may be left mid-update: %v", err, ferr)
		}
		return fmt.Errorf("%w (update session closed)", err)
	}
	return c.FinishWeightUpdate(ctx, version)
}

// closeSession finishes a session even when ctx is done: a cancelled step
// must not leave the server mid-update.
func closeSession(ctx context.Context, c *vllm.Client, version string) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
	defer cancel()
	return c.FinishWeightUpdate(cctx, version)
}

// keepHeartbeating heartbeats until stop, for steps that wait on one long
// call (update_weights of a large checkpoint).
func (a *Activities) keepHeartbeating(ctx context.Context) (stop func()) {
	return a.heartbeatLoop(ctx, func() { activity.RecordHeartbeat(ctx) })
}

// heartbeatLoop calls beat every heartbeatEvery until the returned stop (or
// ctx's end); stop waits for a beat in progress. Outside an activity it does
// nothing, so the activities run in plain tests too.
func (a *Activities) heartbeatLoop(ctx context.Context, beat func()) (stop func()) {
	if !activity.IsActivity(ctx) {
		return func() {}
	}
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(a.heartbeatEvery(ctx))
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				beat()
			}
		}
	})
	return func() { close(quit); wg.Wait() }
}
