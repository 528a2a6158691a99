package ncclengine

// The snapshot path: a resident trainer (trainer/PROTOCOL.md) published its
// weights into one device buffer of its own and exported it with CUDA IPC;
// the engine maps that buffer once per trainer and broadcasts straight from
// it, one ncclBroadcast per packed chunk or per tensor, with no staging
// buffer and no copy. Sessions, deadlines and aborts are the checkpoint
// path's (runUpdate); only the data plane differs.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"sync"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/cudaipc"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/trainer"
	"github.com/rlflow/rlflow/transfer"
)

// snapshotInFlight bounds the broadcasts enqueued ahead of the oldest one
// not known to be complete: enough to keep NCCL busy between completions,
// few enough that progress stays current.
const snapshotInFlight = 16

// residents are the snapshot mappings of the resident trainers, one per
// run: a trainer publishes every version into the same buffer (its IPC
// handle stays the same), so the mapping is opened once per trainer and
// reused. A mapping may keep the trainer's memory allocated after the
// trainer freed it or died, so a new owner or handle for the run closes the
// old one first, and CloseSnapshot closes it when the trainer stops.
type residents struct {
	mu     sync.Mutex
	runs   map[string]*resident
	dev    *nccl.Device // the thread OpenIPC and CloseIPC run on, opened on first use
	closed bool
}

// resident is one run's mapping.
type resident struct {
	mu       sync.Mutex // held by the update broadcasting from it, and to (un)map it
	run      string
	owner    string
	handle   nccl.IPCHandle
	base     nccl.DevPtr // 0: nothing mapped
	detached bool        // removed from residents.runs: the next user takes a new one
}

// snapshotSend is one broadcast of a snapshot: a range of it, sent as it is.
type snapshotSend struct {
	offset      int64 // from the snapshot's start
	bytes       int64
	count       int // elements of dtype: ncclBroadcast's count
	dtype       nccl.DataType
	tensors     int
	first, last string // the tensors it carries, for errors
}

// updateSnapshot is Update from req.Snapshot: validate it and lay it out
// (nothing reaches a server for a snapshot that can never be sent), map it
// (or reuse the mapping), then the update with broadcastSnapshot as the
// data plane. The mapping stays open whatever happens: the trainer owns the
// memory, and its next publish reuses it.
func (e *Engine) updateSnapshot(ctx context.Context, req transfer.UpdateRequest) (transfer.UpdateResult, error) {
	s := req.Snapshot
	if e.cfg.IPC == nil {
		return transfer.UpdateResult{}, transfer.BadInputf("snapshot %s: this GPU worker cannot import CUDA IPC memory (the NCCL engine has no IPC importer), so it cannot publish from a resident trainer", s.Version)
	}
	if _, err := wireDType(req.DType); err != nil {
		return transfer.UpdateResult{}, err
	}
	pk := packingOf(req.Settings)
	tensors, sends, err := e.planSnapshot(s, pk, req.DType)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	h, err := ipcHandleOf(s)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	meta, err := plan.NewTensorMetadata(tensors)
	if err != nil {
		return transfer.UpdateResult{}, transfer.BadInputf("snapshot %s: %v", s.Version, err)
	}

	r, opened, err := e.mapSnapshot(ctx, req.RunID, s, h)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	defer r.mu.Unlock()
	g := e.begin(req.Target, req.Progress)
	defer g.end()
	total := plan.TotalBytes(tensors)
	req.Progress.SetTotal(total)
	initialized, err := e.ensureGroup(ctx, g, req, pk)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	src := r.base + nccl.DevPtr(s.StorageOffset)
	res, err := e.runUpdate(ctx, g, req, meta, pk, total, initialized, func(ctx context.Context, comm *nccl.Comm) (sent, error) {
		return broadcastSnapshot(ctx, comm, src, sends, g.setSent)
	})
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	res.Source, res.Opened = transfer.SourceSnapshot, opened
	return res, nil
}

// planSnapshot checks s against itself and this engine once more before
// anything maps it (every byte a broadcast reads must lie inside the
// storage the trainer exported) and lays it out: update_info's tensors as
// the snapshot holds them (the trainer cast them when it published, so
// dtype only has to agree with them), and the broadcasts, each one range
// of the snapshot. A packed chunk must be one contiguous range: it is sent
// in one ncclBroadcast from the trainer's memory, with no buffer to gather
// it in.
func (e *Engine) planSnapshot(s *trainer.Snapshot, pk packing, dtype string) ([]plan.Tensor, []snapshotSend, error) {
	bad := func(format string, args ...any) error {
		return transfer.BadInputf("snapshot %s: "+format, append([]any{s.Version}, args...)...)
	}
	switch {
	case len(s.Tensors) == 0:
		return nil, nil, bad("holds no tensors")
	case s.StorageBytes <= 0 || s.StorageOffset < 0 || s.StorageOffset > math.MaxInt64-s.StorageBytes:
		return nil, nil, bad("storage of %d bytes at offset %d in its block", s.StorageBytes, s.StorageOffset)
	case s.Device != e.cfg.Device:
		return nil, nil, bad("on CUDA device %d, but this GPU worker broadcasts from device %d: the trainer must allocate on RLFLOW_TRAINER_DEVICE", s.Device, e.cfg.Device)
	}
	if err := e.checkSnapshotGPU(s); err != nil {
		return nil, nil, err
	}
	tensors := make([]plan.Tensor, len(s.Tensors))
	for i, t := range s.Tensors {
		if t.Offset < 0 || t.Bytes < 0 || t.Offset > s.StorageBytes-t.Bytes {
			return nil, nil, bad("tensor %q: bytes %d to %d lie outside its storage of %d bytes", t.Name, t.Offset, t.Offset+t.Bytes, s.StorageBytes)
		}
		if (dtype == "bfloat16" || dtype == "float16") && t.DType == "float32" {
			return nil, nil, bad("tensor %q is float32, but the update's dtype is %s: the trainer casts float32 tensors to it when it publishes", t.Name, dtype)
		}
		tensors[i] = plan.Tensor{Name: t.Name, DType: t.DType, Shape: t.Shape, Size: t.Bytes}
	}
	if err := plan.Validate(tensors); err != nil {
		return nil, nil, bad("%v", err)
	}
	if err := e.checkReceivable(tensors, pk); err != nil {
		return nil, nil, err
	}
	var sends []snapshotSend
	if pk.packed {
		for ci, c := range plan.Packed(tensors, pk.threshold) {
			for j := 1; j < len(c.Tensors); j++ {
				prev, next := s.Tensors[c.Tensors[j-1]], s.Tensors[c.Tensors[j]]
				if next.Offset != prev.Offset+prev.Bytes {
					return nil, nil, bad("broadcast refused, nothing sent: packed chunk %d holds %q right after %q, but in the snapshot %q ends at byte %d and %q starts at byte %d: a packed chunk is sent in one piece straight from the snapshot, so its tensors must lie back to back (trainer/PROTOCOL.md, publish); set weight_transfer.packed to false",
						ci, next.Name, prev.Name, prev.Name, prev.Offset+prev.Bytes, next.Name, next.Offset)
				}
			}
			first, last := s.Tensors[c.Tensors[0]], s.Tensors[c.Tensors[len(c.Tensors)-1]]
			sends = append(sends, snapshotSend{offset: first.Offset, bytes: c.Size, count: int(c.Size), dtype: nccl.Uint8,
				tensors: len(c.Tensors), first: first.Name, last: last.Name})
		}
		return tensors, sends, nil
	}
	bs, err := plan.NonPacked(tensors)
	if err != nil {
		return nil, nil, bad("%v", err)
	}
	for _, b := range bs {
		t := s.Tensors[b.Tensor]
		sends = append(sends, snapshotSend{offset: t.Offset, bytes: b.Size, count: int(b.Count), dtype: b.DType,
			tensors: 1, first: t.Name, last: t.Name})
	}
	return tensors, sends, nil
}

// checkSnapshotGPU compares the snapshot's GPU with the engine's where both
// UUIDs are known: a trainer started with other CUDA_VISIBLE_DEVICES has
// other ordinals, and its memory would be mapped through peer access on the
// wrong GPU.
func (e *Engine) checkSnapshotGPU(s *trainer.Snapshot) error {
	if s.GPUUUID == "" || e.cfg.Monitor == nil {
		return nil
	}
	devs, err := e.cfg.Monitor.Devices()
	if err != nil {
		return nil // no inventory: the ordinal check stands alone
	}
	for _, d := range devs {
		if d.Index != e.cfg.MonitorIndex || d.UUID == "" {
			continue
		}
		mine := strings.TrimPrefix(strings.ToLower(d.UUID), "gpu-")
		if theirs := strings.TrimPrefix(strings.ToLower(s.GPUUUID), "gpu-"); theirs != mine {
			return transfer.BadInputf("snapshot %s: on GPU %s, but this GPU worker broadcasts from GPU %s (CUDA device %d): the trainer must allocate on RLFLOW_TRAINER_DEVICE with the worker's CUDA_VISIBLE_DEVICES", s.Version, theirs, mine, e.cfg.Device)
		}
	}
	return nil
}

// ipcHandleOf is the handle that maps s: torch's handle bytes parsed into
// the cudaIpcMemHandle_t, or the fake_shm file with the block's size (the
// storage starts StorageOffset bytes into the file).
func ipcHandleOf(s *trainer.Snapshot) (nccl.IPCHandle, error) {
	switch s.IPC {
	case nccl.IPCCUDA:
		mem, err := cudaipc.ParseTorchHandle(s.Handle)
		if err != nil {
			return nccl.IPCHandle{}, transfer.BadInputf("snapshot %s: handle: %v", s.Version, err)
		}
		return nccl.IPCHandle{Kind: nccl.IPCCUDA, Mem: mem}, nil
	case nccl.IPCFakeShm:
		if !filepath.IsAbs(s.Path) {
			return nccl.IPCHandle{}, transfer.BadInputf("snapshot %s: fake_shm path %q is not absolute", s.Version, s.Path)
		}
		return nccl.IPCHandle{Kind: nccl.IPCFakeShm, Path: s.Path, Bytes: s.StorageOffset + s.StorageBytes}, nil
	}
	return nccl.IPCHandle{}, transfer.BadInputf("snapshot %s: ipc %q, want %q or %q", s.Version, s.IPC, nccl.IPCCUDA, nccl.IPCFakeShm)
}

// mapSnapshot returns run's mapping of h, locked, opening it unless it is
// open for the same owner and handle already (opened says it was not); a
// mapping of another owner or handle is closed first. The caller unlocks
// r.mu once its broadcasts are over.
func (e *Engine) mapSnapshot(ctx context.Context, run string, s *trainer.Snapshot, h nccl.IPCHandle) (r *resident, opened bool, err error) {
	for {
		rs := &e.snapshots
		rs.mu.Lock()
		if rs.closed {
			rs.mu.Unlock()
			return nil, false, transfer.Errorf(transfer.NCCLFailed, nccl.ErrClosed, "snapshot %s", s.Version)
		}
		if rs.dev == nil {
			dev, err := nccl.OpenDevice(e.cfg.API, e.cfg.Device)
			if err != nil {
				rs.mu.Unlock()
				if deviceLost(err) {
					return nil, false, transfer.Errorf(transfer.DeviceLost, err, "snapshot %s: mapping it%s", s.Version, e.healthNote())
				}
				return nil, false, transfer.Errorf(transfer.NCCLFailed, err, "snapshot %s: mapping it", s.Version)
			}
			rs.dev = dev
		}
		r = rs.runs[run]
		if r == nil {
			r = &resident{run: run}
			rs.runs[run] = r
		}
		dev := rs.dev
		rs.mu.Unlock()

		r.mu.Lock()
		if r.detached {
			r.mu.Unlock()
			continue
		}
		if r.base != 0 && (r.owner != s.Owner || r.handle != h) {
			owner := r.owner
			if err := e.unmap(dev, r); err != nil {
				r.mu.Unlock()
				return nil, false, transfer.Errorf(transfer.NCCLFailed, err, "snapshot %s: closing run %s's mapping of the snapshot of trainer %s first (forgotten: the next attempt maps the new one)", s.Version, run, owner)
			}
		}
		if r.base == 0 {
			var p nccl.DevPtr
			err := dev.Do(ctx, func(nccl.API) (err error) {
				p, err = e.cfg.IPC.OpenIPC(h)
				return err
			})
			if err != nil {
				r.mu.Unlock()
				kind := transfer.NCCLFailed
				if errors.Is(err, nccl.ErrIPCKind) {
					kind = transfer.BadInput
				}
				return nil, false, transfer.Errorf(kind, err, "snapshot %s of trainer %s: mapping its %s memory on device %d", s.Version, s.Owner, h.Kind, e.cfg.Device)
			}
			r.base, r.owner, r.handle, opened = p, s.Owner, h, true
		}
		return r, opened, nil
	}
}

// unmap closes r's mapping (r.mu held); r has none afterwards, even when
// closing failed.
func (e *Engine) unmap(dev *nccl.Device, r *resident) error {
	if r.base == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	p := r.base
	r.base, r.owner, r.handle = 0, "", nccl.IPCHandle{}
	return dev.Do(ctx, func(nccl.API) error { return e.cfg.IPC.CloseIPC(p) })
}

// CloseSnapshot closes the mapping of runID's snapshot, once the update
// broadcasting from it (if any) is over. Call it when the run's trainer
// stops (it exited, was killed, or the run ended): the mapping may keep
// the trainer's memory allocated. A later update from a snapshot of the
// run maps it again. Nothing mapped for the run is not an error.
func (e *Engine) CloseSnapshot(runID string) error {
	rs := &e.snapshots
	rs.mu.Lock()
	r, dev := rs.runs[runID], rs.dev
	delete(rs.runs, runID)
	rs.mu.Unlock()
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.detached = true
	owner := r.owner
	if err := e.unmap(dev, r); err != nil {
		return fmt.Errorf("ncclengine: closing run %s's mapping of the snapshot of trainer %s: %w", runID, owner, err)
	}
	return nil
}

// closeSnapshots closes every mapping and the thread they were opened on,
// for Close.
func (e *Engine) closeSnapshots() error {
	rs := &e.snapshots
	rs.mu.Lock()
	rs.closed = true
	runs := make([]string, 0, len(rs.runs))
	for run := range rs.runs {
		runs = append(runs, run)
	}
	rs.mu.Unlock()
	var errs []error
	for _, run := range runs {
		errs = append(errs, e.CloseSnapshot(run))
	}
	rs.mu.Lock()
	dev := rs.dev
	rs.dev = nil
	rs.mu.Unlock()
	if dev != nil {
		dev.Close()
	}
	return errors.Join(errs...)
}

// broadcastSnapshot is the snapshot's data plane: every send, in order, as
// an ncclBroadcast on comm's stream straight from src (the mapped
// snapshot), at most snapshotInFlight enqueued past the oldest not known to
// be complete; progress gets the bytes completed after each. It returns
// once the last broadcast completed, so that nothing reads the trainer's
// memory after the update (on failure comm is aborted, which stops them).
func broadcastSnapshot(ctx context.Context, comm *nccl.Comm, src nccl.DevPtr, sends []snapshotSend, progress func(int64)) (res sent, err error) {
	dev := comm.Device()
	n := min(snapshotInFlight, len(sends))
	events := make([]nccl.Event, 0, n)
	defer func() {
		if err != nil {
			comm.Abort(err)
		}
		cctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		defer cancel()
		_ = dev.Do(cctx, func(api nccl.API) error {
			for _, ev := range events {
				_ = api.EventDestroy(ev)
			}
			return nil
		})
	}()
	err = dev.Do(ctx, func(api nccl.API) error {
		for range n {
			ev, err := api.EventCreate(nccl.EventDisableTiming)
			if err != nil {
				return err
			}
			events = append(events, ev)
		}
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("snapshot broadcast: creating its events: %w", err)
	}
	fail := func(k int, what string, err error) error {
		s := sends[k]
		names := fmt.Sprintf("tensor %q", s.first)
		if s.tensors > 1 {
			names = fmt.Sprintf("tensors %q..%q", s.first, s.last)
		}
		return fmt.Errorf("snapshot broadcast %d of %d (%d bytes, %s): %s: %w", k+1, len(sends), s.bytes, names, what, err)
	}
	complete := func(k int) error {
		if err := comm.WaitEvent(ctx, events[k%n]); err != nil {
			return fail(k, "waiting for it", err)
		}
		res.bytes += sends[k].bytes
		res.tensors += sends[k].tensors
		progress(res.bytes)
		return nil
	}
	for k, s := range sends {
		if k >= n {
			if err := complete(k - n); err != nil {
				return res, err
			}
		}
		if err := comm.BroadcastAsync(ctx, src+nccl.DevPtr(s.offset), s.count, s.dtype, nccl.Order{Done: events[k%n]}); err != nil {
			return res, fail(k, "enqueueing it", err)
		}
	}
	for k := max(len(sends)-n, 0); k < len(sends); k++ {
		if err := complete(k); err != nil {
			return res, err
		}
	}
	return res, nil
}
