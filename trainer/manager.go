package trainer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// Options configure a Manager.
type Options struct {
	// IdleTimeout stops a trainer that had no call for that long
	// (shutdown, then kill); 0: never.
	IdleTimeout time.Duration
	// Log receives starts, restarts and stops (nil: none).
	Log *slog.Logger
	// OnStop is called with the run's id after its trainer was stopped
	// (idle, Stop, Close): what the worker holds of it, such as the NCCL
	// engine's mapping of its snapshot, can go.
	OnStop func(runID string)
}

// Manager supervises the resident trainers of the runs on this worker.
type Manager struct {
	opts Options
	log  *slog.Logger

	mu     sync.Mutex
	runs   map[string]*run
	closed bool

	// idleStopped, when set (tests), is called after the idle timer
	// stopped a run's trainer.
	idleStopped func(runID string)
}

// run is one run's trainer slot.
type run struct {
	id string
	// lock is held (a value sent) by the one call in progress.
	lock chan struct{}

	// Under lock.
	spec       Spec   // the spec p was started with
	generation int    // p's, or the last one's
	gone       string // why there is no trainer, when p is nil after one ran
	uses       uint64 // calls so far: an idle timer armed before a later call does nothing
	idle       *time.Timer

	// pmu guards p, which Running and Stop read without lock.
	pmu sync.Mutex
	p   *proc
}

// NewManager returns a Manager with no trainers.
func NewManager(o Options) *Manager {
	log := o.Log
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return &Manager{opts: o, log: log, runs: map[string]*run{}}
}

func (r *run) current() *proc {
	r.pmu.Lock()
	defer r.pmu.Unlock()
	return r.p
}

func (r *run) setCurrent(p *proc) {
	r.pmu.Lock()
	r.p = p
	r.pmu.Unlock()
}

// live is the run's trainer when it is running (under lock).
func (r *run) live() *proc {
	if p := r.current(); p != nil && !p.exited() {
		return p
	}
	return nil
}

func (m *Manager) lookup(runID string) *run {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.runs[runID]
}

// acquire takes the run's lock (creating the run's slot), waiting for a
// call in progress, up to ctx.
func (m *Manager) acquire(ctx context.Context, runID string) (*run, error) {
	if runID == "" {
		return nil, errorf(BadInput, nil, "trainer: empty run id")
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, errorf(Died, nil, "run %s: the trainer manager is closed (the worker is stopping)", runID)
	}
	r := m.runs[runID]
	if r == nil {
		r = &run{id: runID, lock: make(chan struct{}, 1)}
		m.runs[runID] = r
	}
	m.mu.Unlock()
	select {
	case r.lock <- struct{}{}:
		return r, nil
	case <-ctx.Done():
		return nil, errorf(Died, ctx.Err(), "run %s: waiting for the trainer's call in progress", runID)
	}
}

// release ends a call: the idle timer starts over.
func (m *Manager) release(r *run) {
	r.uses++
	if r.idle != nil {
		r.idle.Stop()
	}
	if d := m.opts.IdleTimeout; d > 0 && r.live() != nil {
		seq := r.uses
		r.idle = time.AfterFunc(d, func() { m.idleStop(r, seq) })
	}
	<-r.lock
}

// idleStop stops the run's trainer when no call came since call seq.
func (m *Manager) idleStop(r *run, seq uint64) {
	select {
	case r.lock <- struct{}{}:
	default:
		return // a call is in progress; its end arms a new timer
	}
	stopped := r.uses == seq && r.live() != nil
	if stopped {
		m.stopProc(context.Background(), r, fmt.Sprintf("stopped after %v without a call", m.opts.IdleTimeout))
	}
	<-r.lock
	if stopped && m.idleStopped != nil {
		m.idleStopped(r.id)
	}
}

// stopProc ends the run's trainer (under lock): a shutdown request and up
// to KillGrace for it to exit, then the kill of whatever is left.
func (m *Manager) stopProc(ctx context.Context, r *run, why string) error {
	p := r.current()
	if p == nil {
		return nil
	}
	if !p.exited() {
		p.mu.Lock()
		p.why = why
		p.mu.Unlock()
		sctx, cancel := context.WithTimeout(ctx, p.grace)
		if _, err := p.call(sctx, "shutdown", "shutdown", nil); err == nil {
			select {
			case <-p.done:
			case <-sctx.Done():
			}
		}
		cancel()
	}
	err := p.end(why)
	r.gone = p.goneCause()
	r.setCurrent(nil)
	m.log.Info("trainer stopped", "run", r.id, "pid", p.pid(), "generation", p.generation, "cause", r.gone)
	if m.opts.OnStop != nil {
		m.opts.OnStop(r.id)
	}
	return within(err, "run %s", r.id)
}

// ensure returns the run's running trainer, starting and restoring one
// when there is none (the *Restart says so).
func (m *Manager) ensure(ctx context.Context, r *run, spec Spec) (*proc, *Restart, error) {
	if p := r.live(); p != nil {
		if spec.CheckpointDir != r.spec.CheckpointDir || spec.Device != r.spec.Device {
			return nil, nil, errorf(BadInput, nil, "run %s: the spec's checkpoint directory or device differs from the running trainer's", r.id)
		}
		return p, nil, nil
	}
	cause := "no trainer for this run on this worker"
	if p := r.current(); p != nil {
		_ = p.end("")
		cause = p.goneCause()
	} else if r.gone != "" {
		cause = r.gone
	}
	r.generation++
	began := time.Now()
	rs := &Restart{Generation: r.generation, Cause: cause}
	p, err := m.restore(ctx, r.id, spec, rs)
	if p != nil {
		r.setCurrent(p)
		r.spec = spec
	}
	if err != nil {
		if p != nil {
			_ = p.end("its start failed")
		}
		m.log.Warn("trainer start failed", "run", r.id, "generation", rs.Generation, "cause", cause, "err", err)
		return nil, nil, within(err, "starting trainer generation %d", rs.Generation)
	}
	rs.Seconds = time.Since(began).Seconds()
	m.log.Info("trainer started", "run", r.id, "pid", p.pid(), "generation", rs.Generation, "cause", cause,
		"restored_from", rs.RestoredFrom, "replayed", rs.Replayed, "seconds", rs.Seconds)
	return p, rs, nil
}

// errStartTimeout is the cause of the start context's deadline.
var errStartTimeout = errors.New("start timeout")

// restore starts generation rs.Generation of the run's trainer, says hello,
// loads LATEST's checkpoint and replays the journal after it, filling rs.
// The journal and the rollouts are checked before anything is started. It
// returns the process whenever one was started, also with an error.
func (m *Manager) restore(ctx context.Context, runID string, spec Spec, rs *Restart) (*proc, error) {
	dir := spec.CheckpointDir
	from, ckpt, err := readLatest(dir)
	if err != nil {
		return nil, err
	}
	if ckpt != "" {
		if st, err := os.Stat(ckpt); err != nil || !st.IsDir() {
			return nil, errorf(Lost, nil, "%s names checkpoint %s, which is not a directory", filepath.Join(dir, LatestFile), ckpt)
		}
	}
	lines, err := readJournal(dir)
	if err != nil {
		return nil, err
	}
	replay, err := checkReplayable(dir, from, lines)
	if err != nil {
		return nil, err
	}

	startCtx, cancel := context.WithTimeoutCause(ctx, spec.StartTimeout, errStartTimeout)
	defer cancel()
	timedOut := func(err error, what string) error {
		if ctx.Err() == nil && errors.Is(context.Cause(startCtx), errStartTimeout) {
			return errorf(Timeout, nil, "%s: not done within the start timeout %v (log %s)", what, spec.StartTimeout, spec.LogPath)
		}
		return err
	}
	p, err := startProc(runID, spec, rs.Generation)
	if err != nil {
		return nil, err
	}
	r, err := p.call(startCtx, "hello", "hello", map[string]any{"protocol": ProtocolVersion})
	if err != nil {
		return p, timedOut(err, "hello")
	}
	h, err := decodeHello(r)
	if err != nil {
		return p, p.protocolFault(err)
	}
	if h.Device != int64(spec.Device) {
		return p, p.protocolFault(r.ref.protocolError("field \"device\": %d, but the trainer was given device %d", h.Device, spec.Device))
	}
	p.helloPID, p.iteration = int(h.PID), int(h.Iteration)
	if ckpt != "" {
		r, err := p.call(startCtx, "load", "load", map[string]any{"path": ckpt})
		var e *Error
		if errors.As(err, &e) && e.Kind == Refused {
			return p, errorf(Lost, err, "checkpoint %s is unreadable", ckpt)
		}
		if err != nil {
			return p, timedOut(err, "load of "+ckpt)
		}
		l, err := decodeLoad(r)
		if err != nil {
			return p, p.protocolFault(err)
		}
		if l.Iteration != int64(from) {
			return p, errorf(Lost, nil, "checkpoint %s holds iteration %d, not %d", ckpt, l.Iteration, from)
		}
		p.iteration = from
		rs.RestoredFrom, rs.Checkpoint = from, ckpt
	} else if p.iteration != 0 {
		return p, p.protocolFault(r.ref.protocolError("field \"iteration\": %d, want 0 from a trainer that loaded nothing", p.iteration))
	}
	cancel() // the replay is the call's to bound
	for _, l := range replay {
		if _, err := m.trainOnce(ctx, p, "replay of iteration", l.Iteration, l.Rollouts, l.Args); err != nil {
			return p, err
		}
		rs.Replayed = append(rs.Replayed, l.Iteration)
	}
	return p, nil
}

// trainOnce sends one train request and checks its reply.
func (m *Manager) trainOnce(ctx context.Context, p *proc, what string, iteration int, rollouts string, args json.RawMessage) (trainReply, error) {
	what = fmt.Sprintf("%s %d", what, iteration)
	r, err := p.call(ctx, what, "train", map[string]any{"iteration": iteration, "rollouts": rollouts, "args": args})
	if err != nil {
		return trainReply{}, err
	}
	t, err := decodeTrain(r)
	if err != nil {
		return t, p.protocolFault(err)
	}
	if t.Iteration != int64(iteration) {
		return t, p.protocolFault(r.ref.protocolError("field \"iteration\": %d, want %d", t.Iteration, iteration))
	}
	p.iteration = iteration
	return t, nil
}

// Train trains iteration req.Iteration on req.Rollouts. An iteration the
// journal holds is answered from it without starting anything; otherwise
// the trainer is (re)started when needed and must be at the iteration
// before. The journal line is durable before Train returns; every
// CheckpointEvery-th iteration is then saved and LATEST moved to it.
func (m *Manager) Train(ctx context.Context, runID string, spec Spec, req TrainRequest) (TrainResult, error) {
	what := fmt.Sprintf("run %s: train of iteration %d", runID, req.Iteration)
	if err := spec.Validate(); err != nil {
		return TrainResult{}, within(err, "%s", what)
	}
	if err := req.validate(); err != nil {
		return TrainResult{}, within(err, "%s", what)
	}
	args := json.RawMessage("{}")
	if req.Args != nil {
		b, err := json.Marshal(req.Args)
		if err != nil {
			return TrainResult{}, errorf(BadInput, err, "%s: args", what)
		}
		args = b
	}
	r, err := m.acquire(ctx, runID)
	if err != nil {
		return TrainResult{}, err
	}
	defer m.release(r)

	lines, err := readJournal(spec.CheckpointDir)
	if err != nil {
		return TrainResult{}, within(err, "%s", what)
	}
	if i := slices.IndexFunc(lines, func(l journalLine) bool { return l.Iteration == req.Iteration }); i >= 0 {
		l := lines[i]
		if l.Rollouts != req.Rollouts {
			return TrainResult{}, errorf(BadInput, nil, "%s: the journal holds this iteration trained on %s, not %s", what, l.Rollouts, req.Rollouts)
		}
		return TrainResult{Iteration: l.Iteration, Metrics: l.Metrics, Seconds: l.Seconds, StepDoneUnix: l.StepDoneUnix, FromJournal: true}, nil
	}

	p, rs, err := m.ensure(ctx, r, spec)
	if err != nil {
		return TrainResult{}, within(err, "%s", what)
	}
	res := TrainResult{Iteration: req.Iteration, Restart: rs}
	if p.iteration != req.Iteration-1 {
		return res, errorf(BadInput, nil, "%s: the trainer is at iteration %d, so the next it can train is %d", what, p.iteration, p.iteration+1)
	}
	t, err := m.trainOnce(ctx, p, "train of iteration", req.Iteration, req.Rollouts, args)
	if err != nil {
		if e := (*Error)(nil); errors.As(err, &e) && e.Kind == Refused {
			// Its train step failed part way: the model may be half
			// updated. End it, so the next call restores and replays
			// instead of training on top.
			_ = p.end("its train was refused")
		}
		return res, within(err, "run %s", runID)
	}
	line := journalLine{Iteration: req.Iteration, Rollouts: req.Rollouts, Args: args, Metrics: t.Metrics, Seconds: t.Seconds, StepDoneUnix: t.StepDoneUnix}
	if err := appendJournal(spec.CheckpointDir, line); err != nil {
		// The trainer is ahead of what is durable: end it, so the next
		// call restores and replays instead of finding a gap.
		_ = p.end("its train could not be journaled")
		return res, within(err, "%s", what)
	}
	res.Metrics, res.Seconds, res.StepDoneUnix = t.Metrics, t.Seconds, t.StepDoneUnix
	if req.Iteration%spec.CheckpointEvery == 0 {
		s, err := m.checkpoint(ctx, p, spec, req.Iteration)
		if err != nil {
			return res, within(err, "%s: saving its checkpoint", what)
		}
		res.Checkpoint, res.CheckpointSeconds = s.Path, s.Seconds
	}
	return res, nil
}

// checkpoint saves the trainer's state as iteration's checkpoint, moves
// LATEST to it and prunes the journal up to it. A directory of that name
// left by an earlier attempt is removed first unless LATEST names it (then
// it is the answer).
func (m *Manager) checkpoint(ctx context.Context, p *proc, spec Spec, iteration int) (SaveResult, error) {
	dir := spec.CheckpointDir
	path := filepath.Join(dir, CheckpointName(iteration))
	latest, _, err := readLatest(dir)
	if err != nil {
		return SaveResult{}, err
	}
	if _, err := os.Lstat(path); err == nil {
		if latest == iteration {
			n, err := dirBytes(path)
			if err != nil {
				return SaveResult{}, errorf(IO, err, "measuring checkpoint %s", path)
			}
			return SaveResult{Path: path, Bytes: n, Iteration: iteration}, nil
		}
		if err := os.RemoveAll(path); err != nil {
			return SaveResult{}, errorf(IO, err, "removing an earlier attempt's incomplete checkpoint %s", path)
		}
	}
	r, err := p.call(ctx, fmt.Sprintf("save of iteration %d", iteration), "save", map[string]any{"path": path, "iteration": iteration})
	if err != nil {
		return SaveResult{}, err
	}
	s, err := decodeSave(r)
	if err != nil {
		return SaveResult{}, p.protocolFault(err)
	}
	if s.Path != path {
		return SaveResult{}, p.protocolFault(r.ref.protocolError("field \"path\": not the requested path"))
	}
	if err := writeLatest(dir, iteration); err != nil {
		return SaveResult{}, err
	}
	if err := pruneJournal(dir, iteration); err != nil {
		return SaveResult{}, err
	}
	// The checkpoint is durable and named: a failed deletion of older
	// ones costs disk, not the step.
	if err := pruneCheckpoints(dir, iteration, spec.KeepCheckpoints); err != nil && m.opts.Log != nil {
		m.opts.Log.Warn("trainer: deleting old checkpoints", "dir", dir, "error", err)
	}
	return SaveResult{Path: path, Bytes: s.Bytes, Seconds: s.Seconds, Iteration: iteration}, nil
}

// Save is the save_checkpoint step: a checkpoint of iteration, which must
// be the trainer's (after a restart when needed). When LATEST already
// names iteration's checkpoint, that is the answer and nothing is started.
func (m *Manager) Save(ctx context.Context, runID string, spec Spec, iteration int) (SaveResult, *Restart, error) {
	what := fmt.Sprintf("run %s: save_checkpoint of iteration %d", runID, iteration)
	if err := spec.Validate(); err != nil {
		return SaveResult{}, nil, within(err, "%s", what)
	}
	if iteration < 1 {
		return SaveResult{}, nil, errorf(BadInput, nil, "%s: want an iteration >= 1", what)
	}
	r, err := m.acquire(ctx, runID)
	if err != nil {
		return SaveResult{}, nil, err
	}
	defer m.release(r)
	latest, path, err := readLatest(spec.CheckpointDir)
	if err != nil {
		return SaveResult{}, nil, within(err, "%s", what)
	}
	if latest == iteration {
		if n, err := dirBytes(path); err == nil {
			return SaveResult{Path: path, Bytes: n, Iteration: iteration}, nil, nil
		}
	}
	p, rs, err := m.ensure(ctx, r, spec)
	if err != nil {
		return SaveResult{}, nil, within(err, "%s", what)
	}
	if p.iteration != iteration {
		return SaveResult{}, rs, errorf(BadInput, nil, "%s: the trainer is at iteration %d", what, p.iteration)
	}
	s, err := m.checkpoint(ctx, p, spec, iteration)
	if err != nil {
		return SaveResult{}, rs, within(err, "%s", what)
	}
	return s, rs, nil
}

// Publish has the trainer snapshot its weights (cast to dtype: keep,
// bfloat16 or float16) as version: PublishWith without IPC refs.
func (m *Manager) Publish(ctx context.Context, runID string, spec Spec, version, dtype string) (*Snapshot, *Restart, error) {
	return m.PublishWith(ctx, runID, spec, PublishRequest{Version: version, DType: dtype})
}

// PublishWith has the trainer snapshot its weights as req says, restarting
// it first when needed, and returns the snapshot, checked in full, with
// Owner naming the process and, when req.IPCRefs, Refs one per tensor.
func (m *Manager) PublishWith(ctx context.Context, runID string, spec Spec, req PublishRequest) (*Snapshot, *Restart, error) {
	version, dtype := req.Version, req.DType
	what := fmt.Sprintf("run %s: publish of version %s", runID, version)
	if err := spec.Validate(); err != nil {
		return nil, nil, within(err, "%s", what)
	}
	if version == "" {
		return nil, nil, errorf(BadInput, nil, "run %s: publish: empty version", runID)
	}
	if dtype != DTypeKeep && dtype != DTypeBFloat16 && dtype != DTypeFloat16 {
		return nil, nil, errorf(BadInput, nil, "%s: dtype: want %s, %s or %s", what, DTypeKeep, DTypeBFloat16, DTypeFloat16)
	}
	r, err := m.acquire(ctx, runID)
	if err != nil {
		return nil, nil, err
	}
	defer m.release(r)
	p, rs, err := m.ensure(ctx, r, spec)
	if err != nil {
		return nil, nil, within(err, "%s", what)
	}
	fields := map[string]any{"version": version, "dtype": dtype}
	if req.IPCRefs {
		// Sent only when asked: a trainer that predates it refuses
		// unknown fields.
		fields["ipc_refs"] = true
	}
	rep, err := p.call(ctx, fmt.Sprintf("publish of version %s", version), "publish", fields)
	if err != nil {
		return nil, rs, within(err, "run %s", runID)
	}
	s, err := decodePublish(rep, req.IPCRefs)
	if err != nil {
		return nil, rs, within(p.protocolFault(err), "run %s", runID)
	}
	var bad *Error
	switch {
	case s.Version != version:
		bad = rep.ref.protocolError("field \"version\": not the requested version")
	case s.Device != spec.Device:
		bad = rep.ref.protocolError("field \"device\": %d, but the trainer was given device %d", s.Device, spec.Device)
	case dtype != DTypeKeep:
		if i := slices.IndexFunc(s.Tensors, func(t Tensor) bool { return t.DType == "float32" }); i >= 0 {
			bad = rep.ref.protocolError("field \"tensors[%d].dtype\": float32, but the publish asked for %s", i, dtype)
		}
	}
	if bad != nil {
		return nil, rs, within(p.protocolFault(bad), "run %s", runID)
	}
	s.Owner = fmt.Sprintf("pid %d generation %d", p.helloPID, p.generation)
	s.Iteration = p.iteration
	p.published = version
	return s, rs, nil
}

// Release tells the trainer the worker is done with version's snapshot. A
// trainer that is gone, or a later generation that did not publish it, has
// nothing to release: no error.
func (m *Manager) Release(ctx context.Context, runID, version string) error {
	if m.lookup(runID) == nil {
		return nil
	}
	r, err := m.acquire(ctx, runID)
	if err != nil {
		return err
	}
	defer m.release(r)
	p := r.live()
	if p == nil || p.published != version {
		return nil
	}
	if _, err := p.call(ctx, fmt.Sprintf("release of version %s", version), "release", map[string]any{"version": version}); err != nil {
		return within(err, "run %s", runID)
	}
	p.published = ""
	return nil
}

// Stop ends the run's trainer: a shutdown request, then the kill of its
// processes after KillGrace. A call in progress is waited for up to ctx;
// when ctx ends first the trainer is killed under it. A later call starts
// a new trainer.
func (m *Manager) Stop(ctx context.Context, runID string) error {
	r := m.lookup(runID)
	if r == nil {
		return nil
	}
	select {
	case r.lock <- struct{}{}:
	case <-ctx.Done():
		if p := r.current(); p != nil {
			_ = p.end("stopped during a call")
		}
		return errorf(Died, ctx.Err(), "run %s: stopping the trainer during a call", runID)
	}
	defer func() { <-r.lock }()
	if r.idle != nil {
		r.idle.Stop()
	}
	return m.stopProc(ctx, r, "stopped by the worker")
}

// Close stops every run's trainer; later calls fail (Died: the worker is
// stopping).
func (m *Manager) Close(ctx context.Context) error {
	m.mu.Lock()
	m.closed = true
	ids := make([]string, 0, len(m.runs))
	for id := range m.runs {
		ids = append(ids, id)
	}
	m.mu.Unlock()
	errs := make([]error, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() { errs[i] = m.Stop(ctx, id) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Running reports the run's live trainer: its pid (the process this
// worker started) and generation.
func (m *Manager) Running(runID string) (pid, generation int, ok bool) {
	r := m.lookup(runID)
	if r == nil {
		return 0, 0, false
	}
	p := r.current()
	if p == nil || p.exited() {
		return 0, 0, false
	}
	return p.pid(), p.generation, true
}
