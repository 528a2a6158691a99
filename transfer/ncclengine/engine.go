// Package ncclengine is the NCCL weight-transfer backend: the GPU worker's
// rank 0, which broadcasts a checkpoint from its GPU to the vLLM servers'
// workers over NCCL, staging the bytes through pinned host memory
// (nccl/staging), or a resident trainer's snapshot straight from the
// trainer's GPU memory, mapped with CUDA IPC (resident.go). It implements
// transfer.Engine.
//
// Invariants:
//
//   - One transfer group per transfer.GroupKey: a communicator (rank 0),
//     the group's topology and a staging pipeline of pinned buffers, reused
//     across iterations. A vLLM worker holds a single communicator, so
//     initialising a group closes every other group that shares a server
//     with it. Before a group allocates staging buffers, the buffers of
//     every idle group are freed, so a long-lived worker holds pinned memory
//     for the groups in use, not for every past run.
//   - A group is re-initialised when it is missing or its communicator is
//     poisoned (nccl.Comm.Err), and after every failed broadcast that
//     poisoned it: an NCCL failure is never retried on the same
//     communicator. Every (re)initialisation binds a fresh TCPStore port.
//   - The update_info sent to the servers and the broadcasts come from the
//     same plan (staging.Update, or a snapshot's layout), so metadata and
//     bytes cannot disagree. Checkpoint and snapshot updates share
//     everything but the data plane (runUpdate).
//   - A snapshot is mapped once per run and trainer buffer (owner and
//     handle) and stays mapped across updates, failed ones included, until
//     the run's trainer changes or CloseSnapshot or Close; when Update
//     returns, no broadcast reads it any more.
//   - Nothing waits without a way out: an HTTP failure during a broadcast
//     aborts the communicator at once, an NCCL failure cancels the HTTP
//     calls, and the whole update runs under a deadline. After a failure,
//     every update session the broadcast opened is closed (transfer's
//     session protocol), so no server is left mid-update.
//   - Errors are *transfer.Error: BadInput for requests and checkpoints
//     that can never work, ServerFailed and NCCLFailed for the transport,
//     DeviceLost when the GPU cannot be opened; a request whose context
//     ended gets an error wrapping the context's.
//
// The package never logs and never touches Temporal: progress and device
// health go to the request's transfer.Progress, problems into the errors.
package ncclengine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/gpuhealth"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
)

// cleanupTimeout bounds closing a communicator or a pipeline: cleanup must
// not turn a failure into a hang.
const cleanupTimeout = 10 * time.Second

// Config configures an Engine.
type Config struct {
	// API is NCCL and the CUDA runtime: *nccl.Library on a GPU host, or
	// the nccltest.Fake test double (tests, and rlflow worker --fake-nccl).
	API nccl.API
	// Device is the CUDA ordinal of rank 0 (and of the staging buffers).
	Device int
	// Advertise is the master address used when a request gives none: the
	// TCPStore binds exactly this address and the servers connect to it.
	Advertise string
	// Monitor reads the device's health for progress reports and errors;
	// nil means no health data (NVML missing). MonitorIndex is Device's
	// NVML index.
	Monitor      gpuhealth.Monitor
	MonitorIndex int
	// Staging tunes the pipelines; Buffers is taken from the pipeline's
	// weight_transfer.num_buffers, Progress is set by the engine.
	Staging staging.Options
	// Comm options for the communicators (poll intervals).
	Comm []nccl.CommOption
	// IPC maps a resident trainer's snapshot into this process:
	// cudaipc.Importer on a GPU, the nccltest.Fake test double with it.
	// nil: an update from a snapshot is refused (BadInput).
	IPC nccl.IPCImporter
}

// Engine is the GPU worker's NCCL backend. It is safe for concurrent use;
// operations on one group run one at a time.
type Engine struct {
	cfg Config

	mu     sync.Mutex // guards groups
	groups map[string]*group

	snapshots residents // the resident trainers' mapped snapshots
}

var _ transfer.Engine = (*Engine)(nil)

// New returns an Engine. cfg.API is required.
func New(cfg Config) (*Engine, error) {
	if cfg.API == nil {
		return nil, errors.New("ncclengine: Config.API is required")
	}
	return &Engine{cfg: cfg, groups: map[string]*group{}, snapshots: residents{runs: map[string]*resident{}}}, nil
}

// DefaultStagingNeed is the device memory the staging buffers take with
// vLLM's packed defaults (two 1 GiB buffers) plus the staging margin: a GPU
// with less free cannot broadcast with the defaults.
var DefaultStagingNeed = uint64(pipelines.DefaultPackedNumBuffers*pipelines.DefaultPackedBufferBytes + staging.DefaultOptions.DeviceMargin)

// group is one transfer group: rank 0's communicator with a server set,
// and the staging pipeline its broadcasts go through.
type group struct {
	key     string
	servers []string // base URLs, in rank order

	mu          sync.Mutex // one init or broadcast at a time; guards what follows
	comm        *nccl.Comm // nil: (re)initialise before the next broadcast
	topo        vllm.Topology
	gens        []vllm.Generation
	methods     []string // per server: MethodTCPStore or MethodUniqueID
	master      string
	packing     packing
	pipeDev     *nccl.Device
	pipe        *staging.Stager
	pipeBuffers int
	retired     bool // removed from the registry; the next user gets a new group

	// What progress reports read while an operation holds mu.
	statMu   sync.Mutex
	inits    int                // successful initialisations of this group
	progress *transfer.Progress // the running operation's
}

// name is the group's key and how many times it was initialised.
func (g *group) name() string {
	g.statMu.Lock()
	defer g.statMu.Unlock()
	return fmt.Sprintf("%s#%d", g.key, g.inits)
}

// report sends the running operation's progress to p.
func (g *group) report(p *transfer.Progress) {
	g.statMu.Lock()
	g.progress = p
	g.statMu.Unlock()
}

func (g *group) setPhase(phase string) {
	g.statMu.Lock()
	p := g.progress
	g.statMu.Unlock()
	p.SetPhase(phase, g.name())
}

// setSent is the staging pipeline's progress callback: the pipeline lives
// across broadcasts, each with its own Progress.
func (g *group) setSent(n int64) {
	g.statMu.Lock()
	p := g.progress
	g.statMu.Unlock()
	p.SetSent(n)
}

// dropComm closes the group's communicator, aborting it first when cause
// is given (its peers are gone or being replaced).
func (g *group) dropComm(cause error) {
	if g.comm == nil {
		return
	}
	if cause != nil {
		g.comm.Abort(cause)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	_ = g.comm.Close(ctx)
	g.comm = nil
}

func (g *group) closePipe() {
	if g.pipe != nil {
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		_ = g.pipe.Close(ctx)
		cancel()
		g.pipe = nil
	}
	if g.pipeDev != nil {
		g.pipeDev.Close()
		g.pipeDev = nil
	}
}

// packing is the weight_transfer packed settings as sent to vLLM.
type packing struct {
	packed    bool
	threshold int64 // packed_buffer_size_bytes (0 when not packed)
	buffers   int   // packed_num_buffers (0 when not packed)
}

func packingOf(wt pipelines.WeightTransfer) packing {
	if !wt.Packed {
		return packing{}
	}
	p := packing{packed: true, threshold: wt.BufferBytes, buffers: wt.NumBuffers}
	if p.threshold <= 0 {
		p.threshold = pipelines.DefaultPackedBufferBytes
	}
	if p.buffers <= 0 {
		p.buffers = pipelines.DefaultPackedNumBuffers
	}
	return p
}

// acquire locks the group of target, creating it, and replacing one that
// was retired while the caller waited for it.
func (e *Engine) acquire(target transfer.Target) *group {
	key := transfer.GroupKey(target)
	for {
		e.mu.Lock()
		g := e.groups[key]
		if g == nil {
			g = &group{key: key}
			for _, c := range target.Fleet {
				g.servers = append(g.servers, c.URL())
			}
			e.groups[key] = g
		}
		e.mu.Unlock()
		g.mu.Lock()
		if !g.retired {
			return g
		}
		g.mu.Unlock()
	}
}

// retireOverlapping closes every other group that shares a server with g:
// the server is about to replace its one communicator, so theirs are dead.
func (e *Engine) retireOverlapping(g *group) {
	mine := map[string]bool{}
	for _, s := range g.servers {
		mine[s] = true
	}
	var old []*group
	e.mu.Lock()
	for k, o := range e.groups {
		if o == g {
			continue
		}
		for _, s := range o.servers {
			if mine[s] {
				old = append(old, o)
				delete(e.groups, k)
				break
			}
		}
	}
	e.mu.Unlock()
	for _, o := range old {
		// Not under our lock: o may be in use (it is about to fail anyway).
		go func() {
			o.mu.Lock()
			defer o.mu.Unlock()
			o.retired = true
			o.dropComm(fmt.Errorf("ncclengine: group %s replaced by %s, which shares a server", o.key, g.key))
			o.closePipe()
		}()
	}
}

// releaseIdlePipelines frees the staging buffers of every other group not
// in use right now, before g allocates its own: runs come and go on a
// long-lived GPU worker, and each one's pinned and device buffers would
// otherwise stay allocated until its servers are taken over. A group whose
// buffers were freed allocates them again on its next broadcast.
func (e *Engine) releaseIdlePipelines(g *group) {
	e.mu.Lock()
	others := make([]*group, 0, len(e.groups))
	for _, o := range e.groups {
		if o != g {
			others = append(others, o)
		}
	}
	e.mu.Unlock()
	for _, o := range others {
		if o.mu.TryLock() {
			o.closePipe()
			o.mu.Unlock()
		}
	}
}

// Close closes every group (communicators, pipelines and their pinned
// memory), then every snapshot mapping. The Engine must not be used
// afterwards. The error is that of closing a mapping.
func (e *Engine) Close() error {
	e.mu.Lock()
	gs := e.groups
	e.groups = map[string]*group{}
	e.mu.Unlock()
	for _, g := range gs {
		g.mu.Lock()
		g.retired = true
		g.dropComm(nil)
		g.closePipe()
		g.mu.Unlock()
	}
	return e.closeSnapshots()
}

// ---- health ----

func (e *Engine) health() *gpuhealth.Health {
	if e.cfg.Monitor == nil {
		return nil
	}
	h, err := e.cfg.Monitor.Health(e.cfg.MonitorIndex)
	if err != nil {
		return &gpuhealth.Health{Device: e.cfg.MonitorIndex, Problems: []string{"health unavailable: " + err.Error()}}
	}
	return &h
}

// healthReport is what progress reports carry: nil (not a nil *Health)
// without a monitor, so the report leaves the key out.
func (e *Engine) healthReport() any {
	if h := e.health(); h != nil {
		return h
	}
	return nil
}

// healthNote describes device problems for an error message, "" if none.
func (e *Engine) healthNote() string {
	h := e.health()
	if h == nil || len(h.Problems) == 0 {
		return ""
	}
	return fmt.Sprintf(" (GPU %d health: %s)", h.Device, strings.Join(h.Problems, "; "))
}

// begin locks target's group for one operation reporting to p.
func (e *Engine) begin(target transfer.Target, p *transfer.Progress) *group {
	p.WatchHealth(e.healthReport)
	g := e.acquire(target)
	g.report(p)
	return g
}

// end unlocks g after an operation.
func (g *group) end() {
	g.report(nil)
	g.mu.Unlock()
}

// ---- init ----

// Init (re)initialises the group of req's run and servers: the old group
// for the same key (and any other sharing a server) is aborted first, then
// the rendezvous runs with POST /init_weight_transfer_engine issued to
// every server concurrently.
func (e *Engine) Init(ctx context.Context, req transfer.InitRequest) (transfer.InitResult, error) {
	master := req.MasterAddress
	if master == "" {
		master = e.cfg.Advertise
	}
	if master == "" {
		return transfer.InitResult{}, transfer.BadInputf("no master address: set init_transfer's master_address or start the GPU worker with --advertise")
	}
	if req.MasterPort < 0 || req.MasterPort > 65535 {
		return transfer.InitResult{}, transfer.BadInputf("master_port %d out of range 0..65535", req.MasterPort)
	}
	if req.Timeout <= 0 {
		return transfer.InitResult{}, transfer.BadInputf("init timeout %v must be positive", req.Timeout)
	}
	g := e.begin(req.Target, req.Progress)
	defer g.end()
	if err := e.init(ctx, g, req.Fleet, packingOf(req.Settings), req.Settings.Rendezvous, master, req.MasterPort, req.Timeout); err != nil {
		return transfer.InitResult{}, err
	}
	return transfer.InitResult{WorldSize: g.topo.WorldSize, Group: g.name(), Methods: g.methods}, nil
}

// The rendezvous methods the engine reports per server.
const (
	// MethodTCPStore: the server's workers read the pickled unique id from
	// the trainer's TCPStore (init_info.master_address/master_port).
	MethodTCPStore = "tcpstore"
	// MethodUniqueID: the server got the id in init_info.nccl_unique_id_b64.
	MethodUniqueID = "unique_id"
)

// rendezvousMethods chooses, per server, how it gets the unique id
// (weight_transfer.rendezvous: auto gives the id itself to the servers
// whose generation takes it), and the module the TCPStore's pickle names:
// the vllm.backends layout's when every server meeting there has that
// layout, else the legacy one, which the newer layout still resolves
// through its compatibility shim.
func rendezvousMethods(setting string, fleet vllm.Fleet, gens []vllm.Generation) ([]string, string, error) {
	methods := make([]string, len(gens))
	module := ncclid.ModulePath
	backends, stored := true, false
	for i, g := range gens {
		switch {
		case setting == pipelines.RendezvousUniqueID:
			if g != vllm.GenD && !g.TakesUniqueIDB64() {
				return nil, "", transfer.BadInputf("weight_transfer.rendezvous is unique_id, but server %s speaks API generation %s, which has no init_info.nccl_unique_id_b64 (D's newest builds and E have it): use tcpstore or auto", fleet[i].URL(), g)
			}
			methods[i] = MethodUniqueID
		case setting == pipelines.RendezvousTCPStore || !g.TakesUniqueIDB64():
			methods[i] = MethodTCPStore
			stored = true
			backends = backends && g.BackendsLayout()
		default:
			methods[i] = MethodUniqueID
		}
	}
	if stored && backends {
		module = ncclid.BackendsModulePath
	}
	return methods, module, nil
}

// init runs on a locked group.
func (e *Engine) init(ctx context.Context, g *group, fleet vllm.Fleet, pk packing, rendezvous, master string, port int, timeout time.Duration) error {
	g.setPhase("init")
	g.dropComm(fmt.Errorf("ncclengine: group %s is being re-initialised", g.key))
	e.retireOverlapping(g)
	ictx, cancel := withTimeoutCause(ctx, timeout, fmt.Errorf("init did not complete within %v (init_transfer timeout)", timeout))
	defer cancel()

	topo, err := fleet.WorldSizes(ictx)
	if err != nil {
		return transfer.TransportErrorf(ctx, err, "init %s: world sizes", g.key)
	}
	gens := make([]vllm.Generation, len(fleet))
	for i, c := range fleet {
		if gens[i], err = c.DetectGeneration(ictx); err != nil {
			return transfer.TransportErrorf(ctx, err, "init %s: API generation", g.key)
		}
		if gens[i] == vllm.GenA && pk.packed {
			return transfer.BadInputf("server %s speaks API generation A, which chooses its packed chunk size from its own GPU memory, so the trainer cannot lay out the same chunks: set weight_transfer.packed to false or upgrade vLLM", c.URL())
		}
	}

	methods, module, err := rendezvousMethods(rendezvous, fleet, gens)
	if err != nil {
		return err
	}
	initAll := func(ctx context.Context, port int, id nccl.UniqueID) error {
		ctx, cancel := context.WithCancelCause(ctx)
		defer cancel(nil)
		var first error
		var once sync.Once
		err := fleet.Each("init weight transfer", func(i int, c *vllm.Client) error {
			info := vllm.InitInfo{
				MasterAddress: master, MasterPort: port,
				RankOffset: topo.RankOffsets[i], WorldSize: topo.WorldSize,
				Packed: pk.packed, PackedBufferSizeBytes: pk.threshold, PackedNumBuffers: pk.buffers,
			}
			if methods[i] == MethodUniqueID {
				info.MasterAddress, info.MasterPort, info.NCCLUniqueIDB64 = "", 0, ncclid.EncodeB64(ncclid.ID(id))
			}
			err := c.InitWeightTransfer(ctx, info)
			if err != nil {
				// One server that cannot join dooms the group: stop
				// waiting for the others.
				once.Do(func() { first = err; cancel(err) })
			}
			return err
		})
		if err != nil {
			return first
		}
		return nil
	}
	comm, err := staging.Rendezvous(ictx, staging.RendezvousConfig{
		MasterAddress: master, MasterPort: port, WorldSize: topo.WorldSize, Device: e.cfg.Device, Comm: e.cfg.Comm,
		PickleModule: module,
	}, e.cfg.API, initAll)
	if err != nil {
		if deviceLost(err) {
			return transfer.Errorf(transfer.DeviceLost, err, "init %s%s", g.key, e.healthNote())
		}
		// Rendezvous names the init deadline (ictx's cause) itself.
		return transfer.TransportErrorf(ctx, err, "init %s (world size %d)%s", g.key, topo.WorldSize, e.healthNote())
	}
	g.comm, g.topo, g.gens, g.master, g.packing, g.methods = comm, topo, gens, master, pk, methods
	g.statMu.Lock()
	g.inits++
	g.statMu.Unlock()
	return nil
}

// ---- broadcast ----

// wireDType maps broadcast's dtype argument to the per-tensor wire dtype.
// Only float32 tensors are narrowed: other dtypes go as they are (vLLM's
// weight loaders convert on copy), and nccl/staging has no conversion
// between the two 16-bit formats.
func wireDType(dtype string) (func(safetensors.TensorInfo) safetensors.DType, error) {
	switch dtype {
	case "", "keep":
		return staging.KeepDType, nil
	case "bfloat16":
		return staging.F32ToBF16, nil
	case "float16":
		return func(t safetensors.TensorInfo) safetensors.DType {
			if t.DType == safetensors.F32 {
				return safetensors.F16
			}
			return t.DType
		}, nil
	}
	return nil, transfer.BadInputf("dtype %q, want keep, bfloat16 or float16", dtype)
}

// Update broadcasts a checkpoint, or a resident trainer's snapshot
// (updateSnapshot), to every server of the group, initialising the group
// first when it is missing or poisoned.
func (e *Engine) Update(ctx context.Context, req transfer.UpdateRequest) (transfer.UpdateResult, error) {
	switch {
	case req.Snapshot != nil && req.Checkpoint != "":
		return transfer.UpdateResult{}, transfer.BadInputf("an update has a checkpoint or a snapshot, not both")
	case req.Snapshot != nil:
		return e.updateSnapshot(ctx, req)
	}
	wire, err := wireDType(req.DType)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	ck, err := transfer.OpenCheckpoint(req.Checkpoint)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	defer ck.Close()
	pk := packingOf(req.Settings)
	u, err := staging.Plan(ck.Tensors(), pk.packed, pk.threshold, wire)
	if err != nil {
		return transfer.UpdateResult{}, transfer.BadInputf("broadcast of %s: %v", req.Checkpoint, err)
	}
	// Before anything reaches a server (even a first broadcast's init):
	// a layout vLLM cannot unpack, or fp8 the loaded NCCL lacks.
	if err := e.checkReceivable(u.Tensors, pk); err != nil {
		return transfer.UpdateResult{}, err
	}
	meta, err := u.Metadata()
	if err != nil {
		return transfer.UpdateResult{}, transfer.BadInputf("broadcast of %s: %v", req.Checkpoint, err)
	}

	g := e.begin(req.Target, req.Progress)
	defer g.end()
	req.Progress.SetTotal(u.Bytes())
	initialized, err := e.ensureGroup(ctx, g, req, pk)
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	if err := e.ensurePipeline(ctx, g, staging.MaxChunk(u.Chunks), req.Settings.NumBuffers); err != nil {
		return transfer.UpdateResult{}, err
	}
	res, err := e.runUpdate(ctx, g, req, meta, pk, u.Bytes(), initialized, func(ctx context.Context, comm *nccl.Comm) (sent, error) {
		r, err := g.pipe.Broadcast(ctx, comm, ck, u.Chunks)
		return sent{bytes: r.Bytes, tensors: r.Tensors}, err
	})
	if p := g.pipe; p != nil && p.Err() != nil {
		g.closePipe()
	}
	if err != nil {
		return transfer.UpdateResult{}, err
	}
	res.Source = transfer.SourceCheckpoint
	return res, nil
}

// ensureGroup (re)initialises the locked group g for req when it has no
// healthy communicator or its packing changed, and says whether it did.
func (e *Engine) ensureGroup(ctx context.Context, g *group, req transfer.UpdateRequest, pk packing) (bool, error) {
	if g.comm != nil && g.comm.Err() == nil && g.packing == pk {
		return false, nil
	}
	master := g.master
	if master == "" {
		master = e.cfg.Advertise
	}
	if master == "" {
		return false, transfer.BadInputf("broadcast needs a transfer group and there is no master address: run init_transfer with master_address first or start the GPU worker with --advertise")
	}
	if req.InitTimeout <= 0 {
		return false, transfer.BadInputf("init timeout %v must be positive", req.InitTimeout)
	}
	if err := e.init(ctx, g, req.Fleet, pk, req.Settings.Rendezvous, master, 0, req.InitTimeout); err != nil {
		return false, err
	}
	return true, nil
}

// ensurePipeline gives g a pipeline whose buffers hold need bytes,
// reusing the one it has when it is large enough.
func (e *Engine) ensurePipeline(ctx context.Context, g *group, need int64, numBuffers int) error {
	opts := e.cfg.Staging
	if numBuffers > 0 {
		opts.Buffers = numBuffers
	}
	if opts.Buffers <= 0 {
		opts.Buffers = staging.DefaultOptions.Buffers
	}
	need = max(need, 1)
	if g.pipe != nil && g.pipe.BufferBytes() >= need && g.pipeBuffers == opts.Buffers {
		return nil
	}
	g.closePipe()
	e.releaseIdlePipelines(g)
	margin := opts.DeviceMargin
	if margin <= 0 {
		margin = staging.DefaultOptions.DeviceMargin
	}
	if h := e.health(); h != nil && h.MemoryTotal > 0 {
		want := uint64(opts.Buffers)*uint64(need) + uint64(margin)
		if h.MemoryFree < want {
			return transfer.Errorf(transfer.NCCLFailed, nil,
				"GPU %d (%s) has %d bytes free of %d, the staging buffers need %d (%d x %d plus a %d margin): free device memory, use fewer weight_transfer.num_buffers or a smaller buffer_bytes",
				h.Device, h.Name, h.MemoryFree, h.MemoryTotal, want, opts.Buffers, need, margin)
		}
	}
	opts.Progress = g.setSent
	dev, err := nccl.OpenDevice(e.cfg.API, e.cfg.Device)
	if err != nil {
		if deviceLost(err) {
			return transfer.Errorf(transfer.DeviceLost, err, "staging buffers%s", e.healthNote())
		}
		return transfer.Errorf(transfer.NCCLFailed, err, "staging buffers")
	}
	p, err := staging.NewStager(ctx, dev, need, opts)
	if err != nil {
		dev.Close()
		return transfer.Errorf(transfer.NCCLFailed, err, "staging buffers")
	}
	g.pipe, g.pipeDev, g.pipeBuffers = p, dev, opts.Buffers
	return nil
}

// deviceLost reports whether err says this worker's GPU cannot be selected
// at all: then no attempt on this worker can succeed, and the step must
// move to another GPU worker.
func deviceLost(err error) bool {
	var de *nccl.DeviceError
	return errors.As(err, &de)
}

// withTimeoutCause ends ctx after d with cause, as context.WithTimeoutCause
// does, but leaves ctx's deadline the caller's (the activity's): the vLLM
// client ends a call early to report before its context's deadline
// (vllm.MaxReportMargin), which is right for the activity's deadline, while
// an operation's own timeout must let its calls run to it and name it.
func withTimeoutCause(ctx context.Context, d time.Duration, cause error) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancelCause(ctx)
	t := time.AfterFunc(d, func() { cancel(cause) })
	return c, func() { t.Stop(); cancel(context.Canceled) }
}
