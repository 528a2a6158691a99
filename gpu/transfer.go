package gpu

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/activity"
)

// Defaults.
const (
	// DefaultInitTimeout bounds an init_transfer (or the implicit init of a
	// broadcast) when the step sets no timeout: vLLM's workers wait 300 s
	// for the TCPStore, then NCCL init and the warm-up follow.
	DefaultInitTimeout = 6 * time.Minute
	// DefaultHeartbeatEvery is the longest gap between heartbeats.
	DefaultHeartbeatEvery = 5 * time.Second
	// cleanupTimeout bounds closing a failed update's server sessions and
	// closing a communicator: cleanup must not turn a failure into a hang.
	cleanupTimeout = 10 * time.Second
)

// Config configures a Transfer.
type Config struct {
	// API is NCCL and the CUDA runtime: *nccl.Library on a GPU host, or the
	// nccltest.Fake test double (tests, and rlflow worker --fake-nccl).
	API nccl.API
	// Device is the CUDA ordinal of rank 0 (and of the staging buffers).
	Device int
	// Advertise is the master address used when a step gives none: the
	// TCPStore binds exactly this address and the servers connect to it.
	Advertise string
	// Monitor reads the device's health for heartbeats and errors; nil
	// means no health data (NVML missing). MonitorIndex is Device's NVML
	// index (see Select).
	Monitor      Monitor
	MonitorIndex int
	// Staging tunes the pipelines; Buffers is taken from the pipeline's
	// weight_transfer.num_buffers when set, Progress is set by Transfer.
	Staging staging.Options
	// Comm options for the communicators (poll intervals).
	Comm []nccl.CommOption
	// HeartbeatEvery is the longest gap between heartbeats (default 5s; an
	// activity's heartbeat timeout shortens it to a third of that).
	HeartbeatEvery time.Duration
	// Heartbeat records progress; nil means Temporal's activity heartbeat
	// when ctx is an activity context (tests set it to observe progress).
	Heartbeat func(ctx context.Context, p Progress)
}

// Progress is the heartbeat detail of init_transfer and broadcast.
type Progress struct {
	Phase      string  `json:"phase"` // "init" or "broadcast"
	Group      string  `json:"group,omitempty"`
	BytesSent  int64   `json:"bytes_sent"`
	BytesTotal int64   `json:"bytes_total"`
	Health     *Health `json:"health,omitempty"`
}

// Transfer is the GPU worker's activities.NCCLTransfer. It is safe for
// concurrent use; operations on one group run one at a time.
type Transfer struct {
	cfg Config

	mu     sync.Mutex // guards groups
	groups map[string]*group
}

var _ activities.NCCLTransfer = (*Transfer)(nil)

// New returns a Transfer. cfg.API is required.
func New(cfg Config) (*Transfer, error) {
	if cfg.API == nil {
		return nil, errors.New("gpu: Config.API is required")
	}
	if cfg.HeartbeatEvery <= 0 {
		cfg.HeartbeatEvery = DefaultHeartbeatEvery
	}
	return &Transfer{cfg: cfg, groups: map[string]*group{}}, nil
}

// group is one transfer group: rank 0's communicator with a server set,
// and the staging pipeline its broadcasts go through.
type group struct {
	key     string
	servers []string // base URLs, in rank order

	mu          sync.Mutex // one init or broadcast at a time; guards what follows
	comm        *nccl.Comm // nil: (re)initialise before the next broadcast
	topo        vllm.Topology
	gens        []vllm.Generation
	master      string
	packing     packing
	pipeDev     *nccl.Device
	pipe        *staging.Pipeline
	pipeBuffers int
	retired     bool // removed from the registry; the next user gets a new group

	// What heartbeats read while an operation holds mu.
	statMu sync.Mutex
	inits  int    // successful initialisations of this group
	sent   int64  // bytes of the running broadcast known to be on the wire
	phase  string // "init" or "broadcast"
}

func (g *group) setPhase(p string) {
	g.statMu.Lock()
	g.phase = p
	g.statMu.Unlock()
}

func (g *group) progress(total int64) Progress {
	g.statMu.Lock()
	defer g.statMu.Unlock()
	return Progress{Phase: g.phase, Group: fmt.Sprintf("%s#%d", g.key, g.inits), BytesSent: g.sent, BytesTotal: total}
}

func (g *group) name() string {
	g.statMu.Lock()
	defer g.statMu.Unlock()
	return fmt.Sprintf("%s#%d", g.key, g.inits)
}

func (g *group) setSent(n int64) {
	g.statMu.Lock()
	g.sent = n
	g.statMu.Unlock()
}

func (g *group) bytesSent() int64 {
	g.statMu.Lock()
	defer g.statMu.Unlock()
	return g.sent
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

func packingOf(wt *pipelines.WeightTransfer) packing {
	if !wt.Packed {
		return packing{}
	}
	p := packing{packed: true, threshold: wt.BufferBytes, buffers: wt.NumBuffers}
	if p.threshold <= 0 {
		p.threshold = plan.DefaultBufferSizeBytes
	}
	if p.buffers <= 0 {
		p.buffers = plan.DefaultNumBuffers
	}
	return p
}

// groupKey names a group: the run, and the servers in rank order with
// their generation pins (a different pin is a different payload shape).
func groupKey(sc pipelines.StepContext, fleet vllm.Fleet) (string, []string) {
	urls := make([]string, len(fleet))
	parts := make([]string, len(fleet))
	for i, c := range fleet {
		urls[i] = c.URL()
		parts[i] = urls[i]
		if i < len(sc.Servers) && sc.Servers[i].API != "" {
			parts[i] += "=" + strings.ToUpper(sc.Servers[i].API)
		}
	}
	return sc.RunID + "@" + strings.Join(parts, ","), urls
}

// lookup returns the group for key, creating it.
func (t *Transfer) lookup(key string, urls []string) *group {
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.groups[key]
	if g == nil {
		g = &group{key: key, servers: urls}
		t.groups[key] = g
	}
	return g
}

// acquire locks the group for key, replacing one that was retired while
// the caller waited for it.
func (t *Transfer) acquire(key string, urls []string) *group {
	for {
		g := t.lookup(key, urls)
		g.mu.Lock()
		if !g.retired {
			return g
		}
		g.mu.Unlock()
	}
}

// retireOverlapping closes every other group that shares a server with g:
// the server is about to replace its one communicator, so theirs are dead.
func (t *Transfer) retireOverlapping(g *group) {
	mine := map[string]bool{}
	for _, s := range g.servers {
		mine[s] = true
	}
	var old []*group
	t.mu.Lock()
	for k, o := range t.groups {
		if o == g {
			continue
		}
		for _, s := range o.servers {
			if mine[s] {
				old = append(old, o)
				delete(t.groups, k)
				break
			}
		}
	}
	t.mu.Unlock()
	for _, o := range old {
		// Not under our lock: o may be in use (it is about to fail anyway).
		go func() {
			o.mu.Lock()
			defer o.mu.Unlock()
			o.retired = true
			o.dropComm(fmt.Errorf("gpu: group %s replaced by %s, which shares a server", o.key, g.key))
			o.closePipe()
		}()
	}
}

// releaseIdlePipelines frees the staging buffers of every other group not
// in use right now, before g allocates its own: runs come and go on a
// long-lived GPU worker, and each one's pinned and device buffers would
// otherwise stay allocated until its servers are taken over. A group whose
// buffers were freed allocates them again on its next broadcast.
func (t *Transfer) releaseIdlePipelines(g *group) {
	t.mu.Lock()
	others := make([]*group, 0, len(t.groups))
	for _, o := range t.groups {
		if o != g {
			others = append(others, o)
		}
	}
	t.mu.Unlock()
	for _, o := range others {
		if o.mu.TryLock() {
			o.closePipe()
			o.mu.Unlock()
		}
	}
}

// Close closes every group: communicators, pipelines and their pinned
// memory. The Transfer must not be used afterwards.
func (t *Transfer) Close() error {
	t.mu.Lock()
	gs := t.groups
	t.groups = map[string]*group{}
	t.mu.Unlock()
	for _, g := range gs {
		g.mu.Lock()
		g.retired = true
		g.dropComm(nil)
		g.closePipe()
		g.mu.Unlock()
	}
	return nil
}

// ---- errors ----

func attempt(ctx context.Context) int {
	if activity.IsActivity(ctx) {
		return int(activity.GetInfo(ctx).Attempt)
	}
	return 0
}

func badInput(ctx context.Context, format string, args ...any) error {
	return activities.StepError(ctx, activities.ErrTypeBadInput, nil, format, args...)
}

// transportError types err: a cancelled caller gets its context error back
// (Temporal reports the cancellation), a vLLM server's failure is a
// ServerError, anything else an NCCLError. All are retryable.
func transportError(ctx context.Context, err error, format string, args ...any) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w (%w)", fmt.Sprintf(format, args...), ctx.Err(), err)
	}
	var ve *vllm.Error
	var fe *vllm.FleetError
	typ := activities.ErrTypeNCCL
	if errors.As(err, &ve) || errors.As(err, &fe) {
		typ = activities.ErrTypeServerError
	}
	// The cause is attached, and ApplicationError.Error appends it.
	return activities.StepError(ctx, typ, err, format, args...)
}

func ncclWeightTransfer(ctx context.Context, sc pipelines.StepContext) (*pipelines.WeightTransfer, error) {
	wt := sc.WeightTransfer
	if wt == nil || wt.Backend != "nccl" {
		backend := "none"
		if wt != nil {
			backend = wt.Backend
		}
		return nil, badInput(ctx, "gpu: the GPU worker runs the nccl backend only; this pipeline's weight_transfer backend is %s", backend)
	}
	if len(sc.Servers) == 0 {
		return nil, badInput(ctx, "gpu: the pipeline lists no servers")
	}
	return wt, nil
}

// ---- heartbeats ----

func (t *Transfer) heartbeatEvery(ctx context.Context) time.Duration {
	d := t.cfg.HeartbeatEvery
	if activity.IsActivity(ctx) {
		if ht := activity.GetInfo(ctx).HeartbeatTimeout; ht > 0 && ht/3 < d {
			d = max(ht/3, 100*time.Millisecond)
		}
	}
	return d
}

func (t *Transfer) health() *Health {
	if t.cfg.Monitor == nil {
		return nil
	}
	h, err := t.cfg.Monitor.Health(t.cfg.MonitorIndex)
	if err != nil {
		return &Health{Device: t.cfg.MonitorIndex, Problems: []string{"health unavailable: " + err.Error()}}
	}
	return &h
}

func (t *Transfer) beat(ctx context.Context, p Progress) {
	switch {
	case t.cfg.Heartbeat != nil:
		t.cfg.Heartbeat(ctx, p)
	case activity.IsActivity(ctx):
		activity.RecordHeartbeat(ctx, p)
	}
}

// heartbeats records progress now and then every interval until stop is
// called.
func (t *Transfer) heartbeats(ctx context.Context, progress func() Progress) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	send := func() {
		p := progress()
		p.Health = t.health()
		t.beat(ctx, p)
	}
	send()
	go func() {
		defer close(finished)
		tick := time.NewTicker(t.heartbeatEvery(ctx))
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-tick.C:
				send()
			}
		}
	}()
	return func() { close(done); <-finished }
}

// healthNote describes device problems for an error message, "" if none.
func (t *Transfer) healthNote() string {
	h := t.health()
	if h == nil || len(h.Problems) == 0 {
		return ""
	}
	return fmt.Sprintf(" (GPU %d health: %s)", h.Device, strings.Join(h.Problems, "; "))
}

// ---- init ----

// Init (re)initialises the group of in's run and fleet: the old group for
// the same key (and any other sharing a server) is aborted first, then the
// rendezvous runs with POST /init_weight_transfer_engine issued to every
// server concurrently.
func (t *Transfer) Init(ctx context.Context, in activities.InitTransferInput, fleet vllm.Fleet) (*activities.InitTransferOutput, error) {
	wt, err := ncclWeightTransfer(ctx, in.Context)
	if err != nil {
		return nil, err
	}
	master := in.MasterAddress
	if master == "" {
		master = t.cfg.Advertise
	}
	if master == "" {
		return nil, badInput(ctx, "gpu: no master address: set init_transfer's master_address or start the GPU worker with --advertise")
	}
	if in.MasterPort < 0 || in.MasterPort > 65535 {
		return nil, badInput(ctx, "gpu: master_port %d out of range 0..65535", in.MasterPort)
	}
	key, urls := groupKey(in.Context, fleet)
	g := t.acquire(key, urls)
	defer g.mu.Unlock()
	stop := t.heartbeats(ctx, func() Progress { return g.progress(0) })
	defer stop()
	if err := t.init(ctx, g, fleet, packingOf(wt), master, in.MasterPort, in.Timeout.D()); err != nil {
		return nil, err
	}
	return &activities.InitTransferOutput{WorldSize: g.topo.WorldSize, Backend: "nccl", Group: g.name(), Attempt: attempt(ctx)}, nil
}

// init runs on a locked group.
func (t *Transfer) init(ctx context.Context, g *group, fleet vllm.Fleet, pk packing, master string, port int, timeout time.Duration) error {
	g.setPhase("init")
	g.dropComm(fmt.Errorf("gpu: group %s is being re-initialised", g.key))
	t.retireOverlapping(g)
	if timeout <= 0 {
		timeout = DefaultInitTimeout
	}
	ictx, cancel := context.WithTimeoutCause(ctx, timeout, fmt.Errorf("init did not complete within %v (init_transfer timeout)", timeout))
	defer cancel()

	topo, err := fleet.WorldSizes(ictx)
	if err != nil {
		return transportError(ctx, err, "gpu: init %s: world sizes", g.key)
	}
	gens := make([]vllm.Generation, len(fleet))
	for i, c := range fleet {
		if gens[i], err = c.DetectGeneration(ictx); err != nil {
			return transportError(ctx, err, "gpu: init %s: API generation", g.key)
		}
		if gens[i] == vllm.GenA && pk.packed {
			return badInput(ctx, "gpu: server %s speaks API generation A, which chooses its packed chunk size from its own GPU memory, so the trainer cannot lay out the same chunks: set weight_transfer.packed to false or upgrade vLLM", c.URL())
		}
	}

	initAll := func(ctx context.Context, port int) error {
		ctx, cancel := context.WithCancelCause(ctx)
		defer cancel(nil)
		errs := make([]error, len(fleet))
		var first error
		var once sync.Once
		var wg sync.WaitGroup
		for i, c := range fleet {
			wg.Go(func() {
				errs[i] = c.InitWeightTransfer(ctx, vllm.InitInfo{
					MasterAddress: master, MasterPort: port,
					RankOffset: topo.RankOffsets[i], WorldSize: topo.WorldSize,
					Packed: pk.packed, PackedBufferSizeBytes: pk.threshold, PackedNumBuffers: pk.buffers,
				})
				if errs[i] != nil {
					// One server that cannot join dooms the group: stop
					// waiting for the others.
					once.Do(func() { first = errs[i]; cancel(errs[i]) })
				}
			})
		}
		wg.Wait()
		return first
	}
	comm, err := staging.Rendezvous(ictx, staging.RendezvousConfig{
		MasterAddress: master, MasterPort: port, WorldSize: topo.WorldSize, Device: t.cfg.Device, Comm: t.cfg.Comm,
	}, t.cfg.API, initAll)
	if err != nil {
		// Rendezvous names the init deadline (ictx's cause) itself.
		return transportError(ctx, err, "gpu: init %s (world size %d)%s", g.key, topo.WorldSize, t.healthNote())
	}
	g.comm, g.topo, g.gens, g.master, g.packing = comm, topo, gens, master, pk
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
	return nil, fmt.Errorf("dtype %q, want keep, bfloat16 or float16", dtype)
}

// Broadcast sends a checkpoint to every server of the group, initialising
// the group first when it is missing or poisoned.
func (t *Transfer) Broadcast(ctx context.Context, in activities.BroadcastInput, fleet vllm.Fleet) (*activities.BroadcastOutput, error) {
	wt, err := ncclWeightTransfer(ctx, in.Context)
	if err != nil {
		return nil, err
	}
	if in.Checkpoint == "" {
		return nil, badInput(ctx, "gpu: broadcast: checkpoint is empty")
	}
	path := in.Checkpoint
	if !filepath.IsAbs(path) && in.Context.BaseDir != "" {
		path = filepath.Join(in.Context.BaseDir, path)
	}
	wire, err := wireDType(in.DType)
	if err != nil {
		return nil, badInput(ctx, "gpu: broadcast: %v", err)
	}
	version := in.Version
	if version == "" {
		version = fmt.Sprintf("%s/iter-%d", in.Context.RunID, in.Context.Iteration)
	}
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		return nil, badInput(ctx, "gpu: broadcast: %v", err)
	}
	defer ck.Close()
	pk := packingOf(wt)
	u, err := staging.Plan(ck.Tensors(), pk.packed, pk.threshold, wire)
	if err != nil {
		return nil, badInput(ctx, "gpu: broadcast of %s: %v", path, err)
	}
	meta, err := u.UpdateInfo()
	if err != nil {
		return nil, badInput(ctx, "gpu: broadcast of %s: %v", path, err)
	}
	if len(meta.Names) == 0 {
		return nil, badInput(ctx, "gpu: broadcast: checkpoint %s holds no tensors", path)
	}

	key, urls := groupKey(in.Context, fleet)
	g := t.acquire(key, urls)
	defer g.mu.Unlock()
	total := u.Bytes()
	g.setSent(0)
	stop := t.heartbeats(ctx, func() Progress { return g.progress(total) })
	defer stop()

	initialized := false
	if g.comm == nil || g.comm.Err() != nil || g.packing != pk {
		master := g.master
		if master == "" {
			master = t.cfg.Advertise
		}
		if master == "" {
			return nil, badInput(ctx, "gpu: broadcast needs a transfer group and there is no master address: run init_transfer with master_address first or start the GPU worker with --advertise")
		}
		if err := t.init(ctx, g, fleet, pk, master, 0, 0); err != nil {
			return nil, err
		}
		initialized = true
	}
	if err := t.ensurePipeline(ctx, g, staging.MaxChunk(u.Chunks), wt.NumBuffers); err != nil {
		return nil, err
	}

	timeout := in.UpdateTimeout.D()
	if timeout <= 0 {
		timeout = vllm.UpdateTimeoutFor(total)
	}
	info := vllm.UpdateInfo{
		Names: meta.Names, DTypeNames: meta.DTypeNames, Shapes: meta.Shapes,
		Packed: pk.packed, PackedBufferSizeBytes: pk.threshold, PackedNumBuffers: pk.buffers,
		CheckpointBytes: total,
	}
	start := time.Now()
	g.setPhase("broadcast")
	res, err := t.update(ctx, g, fleet, ck, u, info, version, timeout, initialized)
	took := time.Since(start)
	if p := g.pipe; p != nil && p.Err() != nil {
		g.closePipe()
	}
	if err != nil {
		if g.comm != nil && g.comm.Err() != nil {
			g.dropComm(nil) // the next attempt re-initialises
		}
		return nil, err
	}
	if in.Verify {
		if err := verify(ctx, fleet, g.gens, version); err != nil {
			return nil, err
		}
	}
	out := &activities.BroadcastOutput{
		Backend: "nccl", Bytes: res.Bytes, Tensors: res.Tensors, Seconds: took.Seconds(),
		Version: version, Initialized: initialized, Attempt: attempt(ctx),
	}
	if took > 0 {
		out.GBps = float64(res.Bytes) / took.Seconds() / 1e9
	}
	return out, nil
}

// ensurePipeline gives g a pipeline whose buffers hold need bytes,
// reusing the one it has when it is large enough.
func (t *Transfer) ensurePipeline(ctx context.Context, g *group, need int64, numBuffers int) error {
	opts := t.cfg.Staging
	if numBuffers > 0 {
		opts.Buffers = numBuffers
	}
	if opts.Buffers <= 0 {
		opts.Buffers = 2
	}
	need = max(need, 1)
	if g.pipe != nil && g.pipe.BufferBytes() >= need && g.pipeBuffers == opts.Buffers {
		return nil
	}
	g.closePipe()
	t.releaseIdlePipelines(g)
	margin := opts.DeviceMargin
	if margin <= 0 {
		margin = 256 << 20
	}
	if h := t.health(); h != nil && h.MemoryTotal > 0 {
		want := uint64(opts.Buffers)*uint64(need) + uint64(margin)
		if h.MemoryFree < want {
			return activities.StepError(ctx, activities.ErrTypeNCCL, nil,
				"gpu: GPU %d (%s) has %d bytes free of %d, the staging buffers need %d (%d x %d plus a %d margin): free device memory, use fewer weight_transfer.num_buffers or a smaller buffer_bytes",
				h.Device, h.Name, h.MemoryFree, h.MemoryTotal, want, opts.Buffers, need, margin)
		}
	}
	opts.Progress = g.setSent
	dev, err := nccl.OpenDevice(t.cfg.API, t.cfg.Device)
	if err != nil {
		return activities.StepError(ctx, activities.ErrTypeNCCL, err, "gpu: open device %d: %v", t.cfg.Device, err)
	}
	p, err := staging.New(ctx, dev, need, opts)
	if err != nil {
		dev.Close()
		return activities.StepError(ctx, activities.ErrTypeNCCL, err, "gpu: staging buffers: %v", err)
	}
	g.pipe, g.pipeDev, g.pipeBuffers = p, dev, opts.Buffers
	return nil
}
