// Package double is a TEST AND DEMO DOUBLE of a vLLM server: it speaks the
// HTTP contract of `vllm serve` with VLLM_SERVER_DEV_MODE=1 (the RLHF
// weight-transfer routes of API generations A, B, C, D and E, pause/resume,
// the checkpoint reload through /collective_rpc, /server_info, the OpenAI
// completions and chat API), with vLLM's status codes and payload
// validation, so that rlflow can be tested and demonstrated on machines
// without a GPU. It is not an inference engine: its model is a character
// bigram table (package bigram) whose samples visibly change when new
// weights arrive. Where the double and stock vLLM differ, stock vLLM is
// right (shared docs: vllm-weight-transfer.md, section 8 first).
//
// Invariants:
//   - Only the routes of the configured generation exist (others are 404,
//     a wrong method on an existing route is 405, as in FastAPI); without
//     DevMode every RLHF route, /collective_rpc and /server_info are 404.
//   - A (vLLM's early-2026 API) serves /init_weight_transfer, /update_weights
//     and /finalize_weight_update instead of /init_weight_transfer_engine,
//     and has no sessions, versions or checker routes. Its finalize may
//     come at any time; vLLM reads no body there, the double takes none or
//     {} (anything else is a 400, to catch client bugs). Its /pause
//     declares only wait_for_inflight_requests and clear_cache, so a mode
//     query is ignored there (FastAPI drops undeclared parameters): a pause
//     without wait_for_inflight_requests=true aborts.
//   - Weight-transfer bodies: bad JSON or a missing init_info/update_info
//     is a 400 on every generation. On A-D a non-object body or info is a
//     500 (Python fails on it inside the handler or the worker); E's router
//     validates shapes first, so there they are 400. An unknown key inside
//     a payload is a 500 like the TypeError vLLM's dataclasses raise, on
//     every generation (on A: packed_buffer_size_bytes and
//     packed_num_buffers too); so is every error raised in a worker.
//   - C/D/E session rules hold: update_weights needs an open session, a
//     second start while one is open fails, finish needs an open session,
//     and the disk backend takes exactly one checkpoint per session. On E
//     a failed update_weights (any 500) closes the session; on C/D the
//     session stays open. A and B have no sessions: one update_weights is
//     a whole update.
//   - E takes update_info as a list with one payload per inference worker
//     (WorldSize x DataParallel); the double has one model, so the entries
//     must be equal (a double limitation, answered 500).
//   - The ipc backend (C, D and E) takes only ipc_handles_pickled over HTTP
//     (the Ray form ipc_handles cannot arrive as JSON), and only with
//     Config.AllowInsecureSerialization, like vLLM; it reads the pickle with
//     a restricted reader (ReadIPCHandles: no code runs), finds
//     Config.GPUUUID in each tensor's handle, and is stricter than vLLM:
//     the pickle's dtype and size must match dtype_names and shapes, the
//     strides must be C-contiguous, and no two tensors may share a
//     ref-counter slot. Config.IPCOpener opens the storages (FileIPC, a
//     test double, for fake_shm snapshots); Server.IPCRefs counts the
//     producer's ref-counter slots consumed as torch's rebuild_cuda_tensor
//     would.
//   - The disk backend (the draft of vLLM pull request #52152, not stock;
//     C, D and E only) and /collective_rpc reload_weights really load the
//     checkpoint; the NCCL backend really performs a worker's TCPStore
//     rendezvous with the trainer, but has no NCCL data plane unless
//     Config.NCCLReceiver supplies one. The pickled NCCL id may name the
//     vllm.backends module only on E.
//   - NCCL metadata: a non-packed update takes only the dtypes vLLM's
//     ncclDataTypeEnum.from_torch maps (float8_e4m3fn included, as NCCL
//     type 10); a packed one carries every torch dtype the double can size
//     as bytes. The packed chunk size is update_info's or init_info's (B-E,
//     default 1 GiB) or, on A, min(2% of Config.GPUMemoryBytes, 5 GiB).
//   - reload_weights bypasses the weight-transfer session and the version;
//     while the workers' load format is dummy it redraws the dummy weights
//     instead of loading the checkpoint, and still answers 200.
//   - /weight_checker (C+, unless Config.NoWeightChecker) keys one digest
//     per worker shard (dp{dp}:pp0:pcp0:tp{tp}:bigram.logits), keeps no
//     state, answers invalid requests 400 and 409 while paused on C/D only;
//     reset really zeroes the served logits.
//   - OpenAI bodies: unknown fields are ignored, as vLLM ignores them;
//     known fields keep their types and ranges (400 naming the field).
//   - /metrics exports the weight-update duration histogram and the
//     in-flight gauge for init, start, update and finish (not reloads, not
//     A's finalize).
//   - Everything is bounded: request bodies, prompts per request, samples,
//     tokens, rendezvous time; no input makes it panic.
package double

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// Generation is the vLLM RLHF API generation the double serves.
type Generation string

const (
	// GenA is vLLM's early-2026 API: /init_weight_transfer, one
	// /update_weights per update (update_info.packed, no buffer settings:
	// the chunk size comes from GPU memory), /finalize_weight_update; no
	// sessions, versions or disk backend.
	GenA Generation = "A"
	GenB Generation = "B"
	GenC Generation = "C"
	GenD Generation = "D"
	// GenE is the newest generation (stock vLLM of December 2026): routes
	// and payloads as D, a router that validates body shapes first (400),
	// update_info as an object or a per-worker list, sessions a failed
	// update closes, the vllm.backends module layout.
	GenE Generation = "E"
)

// hasSessions: C, D and E have update sessions (start/finish), weight
// versions, abort_requests and the weight checker; A and B do not.
func (g Generation) hasSessions() bool { return g == GenC || g == GenD || g == GenE }

// HasDiskBackend reports whether the double serves the draft disk backend
// on g: from C on (it needs sessions); A and B are NCCL only.
func (g Generation) HasDiskBackend() bool { return g.hasSessions() }

// initPath is the init route: A named it /init_weight_transfer.
func (g Generation) initPath() string {
	if g == GenA {
		return "/init_weight_transfer"
	}
	return "/init_weight_transfer_engine"
}

// packedSizeFromGPU: A takes no packed buffer settings; its chunk size
// derives from the GPU's memory (packedChunkFromGPU).
func (g Generation) packedSizeFromGPU() bool { return g == GenA }

// pauseHasMode: A's /pause declares only wait_for_inflight_requests and
// clear_cache; mode came later.
func (g Generation) pauseHasMode() bool { return g != GenA }

// packedInInit: the packed settings (and nccl_unique_id_b64) are init_info
// fields from D on; before, packed settings are update_info fields.
func (g Generation) packedInInit() bool { return g == GenD || g == GenE }

// routerValidates: E's router answers 400 for a body of the wrong shape
// before the engine sees it; older routers let Python fail later (500).
func (g Generation) routerValidates() bool { return g == GenE }

// closesFailedSession: on E a worker whose update_weights failed closes
// its session itself.
func (g Generation) closesFailedSession() bool { return g == GenE }

// backendsLayout: E's source tree moved pynccl_wrapper under
// vllm.backends and resolves the legacy module through a compat shim.
func (g Generation) backendsLayout() bool { return g == GenE }

// Backends (vLLM's --weight-transfer-config backend).
const (
	BackendDisk = "disk"
	BackendNCCL = "nccl"
	// BackendIPC is vLLM's ipc backend (CUDA IPC handles of tensors on
	// the worker's own GPU; C, D and E).
	BackendIPC = "ipc"
)

// Load formats (vLLM's --load-format) the double knows.
const (
	LoadFormatAuto  = "auto"
	LoadFormatDummy = "dummy" // random weights; ModelPath is not read
)

// Defaults.
const (
	DefaultModelName         = "bigram-double"
	DefaultMaxModelLen       = 2048
	DefaultRendezvousTimeout = 300 * time.Second // vLLM's StatelessProcessGroup timeout
	DefaultMaxBodyBytes      = 64 << 20
	// DefaultGPUMemoryBytes plays an 80 GiB GPU (A100/H100 80GB) for A's
	// packed chunk size.
	DefaultGPUMemoryBytes = 80 << 30
)

// Config configures a Server. The zero value is a generation D disk-backend
// server with the RLHF routes off (DevMode false), as `vllm serve` is
// without VLLM_SERVER_DEV_MODE=1.
type Config struct {
	Generation Generation // A, B, C, D or E; "" means D
	// Backend is "disk", "nccl" or "ipc". "" means disk on C and D (the double's
	// long-standing default) and nccl on A and B (which have no disk
	// backend) and on E (stock vLLM has no disk backend: it exists only in
	// the unmerged vLLM pull request #52152; stock reloads go through
	// /collective_rpc).
	Backend string
	DevMode bool // false: every RLHF route answers 404

	// LoadFormat is vLLM's --load-format: "auto" (default) loads ModelPath;
	// "dummy" starts with random weights even when ModelPath is set, and
	// reload_weights then redraws them (vLLM's DummyModelLoader) until an
	// update_config sets the workers' load format to auto.
	LoadFormat string
	// NoWeightChecker mirrors routers without POST /weight_checker (404).
	NoWeightChecker bool

	WorldSize    int // TP×PP of the one replica; default 1
	DataParallel int // DP replicas; default 1 (get_world_size?include_dp multiplies)

	// ModelPath is a bigram safetensors file; "" writes a random model
	// (seeded by Seed) to a temporary file that Close removes.
	ModelPath   string
	ModelName   string // served model name; default DefaultModelName
	MaxModelLen int    // prompt + completion tokens per sequence; default 2048
	Version     string // GET /version; default per generation (see versionFor)

	// APIKey, if set, is required as a bearer token on /v1/* (vLLM's --api-key).
	APIKey string

	// Latency is the time each sequence (one prompt × one sample) holds one
	// of MaxConcurrent slots (0: unlimited); sequences beyond wait for a
	// slot. Latency 50ms with MaxConcurrent 256 is the benchmark setting
	// "50 ms per request and 256 concurrent slots" for one-prompt requests.
	Latency       time.Duration
	MaxConcurrent int

	Faults Faults
	Seed   uint64 // seeds the random model, unseeded sampling and faults

	// RendezvousTimeout bounds the NCCL init's TCPStore rendezvous; default
	// DefaultRendezvousTimeout, like vLLM.
	RendezvousTimeout time.Duration
	// NCCLReceiver is the data plane the double lacks: with it, NCCL
	// update_weights calls receive tensors through it; without it they are
	// validated and then refused with 500 "double: no NCCL data plane".
	NCCLReceiver NCCLReceiver
	// GPUUUID is the UUID of the GPU the ipc backend's worker plays, as
	// vLLM reads it (str(torch.cuda.get_device_properties(dev).uuid):
	// lowercase 8-4-4-4-12 hex, no "GPU-"). Required with backend ipc.
	GPUUUID string
	// IPCOpener opens the storages the ipc backend's handles name. Without
	// it a valid ipc update is refused with 500 "double: no IPC opener".
	IPCOpener IPCOpener
	// AllowInsecureSerialization plays VLLM_ALLOW_INSECURE_SERIALIZATION=1;
	// false (vLLM's default) refuses ipc_handles_pickled as vLLM does.
	AllowInsecureSerialization bool

	// GPUMemoryBytes is the total memory of the GPU each emulated worker
	// plays; default DefaultGPUMemoryBytes. Only generation A reads it:
	// its packed chunk size is min(2% of it, 5 GiB), vLLM's rule then, so
	// it matters only for packed updates that reach NCCLReceiver (the
	// NCCLUpdate.PackedBufferSizeBytes the receiver must chunk by).
	GPUMemoryBytes int64

	MaxBodyBytes int64 // request body limit; default DefaultMaxBodyBytes
}

// Faults inject failures, per route path ("/v1/completions"; "*" matches
// every route). Rates are probabilities in [0, 1], drawn from Seed.
type Faults struct {
	ErrorRate map[string]float64 // answer HTTP 500 without running the route
	DropRate  map[string]float64 // close the connection without an answer
	SlowRate  map[string]float64 // delay the route by SlowBy first
	SlowBy    time.Duration
}

// Stats are the double's counters.
type Stats struct {
	Requests    map[string]int // by "METHOD /path" of a served route; other paths under "unknown route"
	Completions int            // choices served with a final finish reason (not "abort")
	Aborted     int            // choices that finished with "abort"
	// Prompts counts, per prompt text (chat: the rendered conversation),
	// the generation requests that carried it; at most maxTrackedPrompts
	// distinct prompts are tracked, the rest are counted in PromptsUntracked.
	Prompts          map[string]int
	PromptsUntracked int
	Faults           map[string]int // by "error", "drop", "slow"
	// PeakRunning is the most sequences served at the same time (holding
	// one of MaxConcurrent slots) since the server started.
	PeakRunning int
	// Delivered counts the seeded samples (sequences with a final finish
	// reason, not "abort") whose whole response was written and flushed to
	// the client's connection; Rerequested counts the seeded sequences
	// asked for again after such a delivery: a client that lost a sample
	// it had been sent. A sample is keyed by everything that fixes its text
	// on given weights (sampleKey): the route, the prompt text (chat: the
	// rendered conversation), the seed, the sequence's index in its request
	// and the sampling parameters. Unseeded sequences are a fresh draw each
	// time and are keyed by nothing: use seeds to count. At most
	// maxTrackedPrompts samples are remembered; deliveries beyond are
	// counted in SamplesUntracked.
	Delivered        int
	Rerequested      int
	SamplesUntracked int
	// Unsent is the sequences finished (done or aborted) whose response is
	// not yet written. After a pause with mode keep returned it only falls:
	// at 0 every answer the server will give before resume is out.
	Unsent int
	// Open is the sequences of requests still being served: waiting for
	// admission (paused, or no slot), generating, or frozen by a keep
	// pause. A client that went away is noticed asynchronously; once Open
	// is 0 none of its sequences can be answered any more.
	Open int
}

const maxTrackedPrompts = 1 << 20

// Server is one emulated vLLM server.
type Server struct {
	cfg     Config
	routes  map[string]*route
	handler http.Handler
	sched   *scheduler
	tmpDir  string // holds the generated random model, removed by Close

	model atomic.Pointer[bigram.Model]

	randMu sync.Mutex
	rand   *rand.Rand // faults and unseeded sampling

	statsMu   sync.Mutex
	stats     Stats
	delivered map[string]struct{} // sampleKey of every delivered seeded sample

	// started plays the process start time: every New is a new process.
	started time.Time
	// ops are the weight-update operations' times and inFlight the calls
	// of each running now, for /metrics.
	opsMu    sync.Mutex
	ops      map[string]opStat
	inFlight map[string]int

	ids atomic.Uint64 // response ids

	xferMu sync.Mutex // serialises init/update: they block on the trainer
	mu     sync.Mutex // guards the fields below
	wstate weightState
	rdv    *rendezvous // the open TCPStore connections of the last NCCL init
}

// New validates cfg and builds a server (loading or writing its model).
func New(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, rand: rand.New(rand.NewPCG(cfg.Seed, 0x646f75626c65)), started: time.Now(),
		ops: map[string]opStat{}, inFlight: map[string]int{}}
	s.stats = Stats{Requests: map[string]int{}, Prompts: map[string]int{}, Faults: map[string]int{}}
	s.delivered = map[string]struct{}{}
	if cfg.ModelPath == "" {
		dir, err := os.MkdirTemp("", "vllm-double-*")
		if err != nil {
			return nil, fmt.Errorf("double: temp dir for the random model: %w", err)
		}
		s.tmpDir = dir
		s.cfg.ModelPath = filepath.Join(dir, "model.safetensors")
		if err := bigram.Random(cfg.Seed).Save(s.cfg.ModelPath); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("double: write the random model: %w", err)
		}
	}
	m := s.dummyWeights()
	if cfg.LoadFormat != LoadFormatDummy {
		if m, err = bigram.Load(s.cfg.ModelPath); err != nil {
			s.Close()
			return nil, fmt.Errorf("double: load model: %w", err)
		}
	}
	s.model.Store(m)
	s.wstate.loadFormat = cfg.LoadFormat
	s.sched = newScheduler(cfg.MaxConcurrent)
	s.routes = s.buildRoutes()
	s.handler = http.HandlerFunc(s.serveHTTP)
	return s, nil
}

func (c Config) withDefaults() (Config, error) {
	if c.Generation == "" {
		c.Generation = GenD
	}
	switch c.Generation {
	case GenA, GenB, GenC, GenD, GenE:
	default:
		return c, fmt.Errorf("double: generation %q, want A, B, C, D or E", c.Generation)
	}
	if c.Backend == "" {
		c.Backend = BackendDisk
		if !c.Generation.HasDiskBackend() || c.Generation == GenE {
			c.Backend = BackendNCCL
		}
	}
	switch c.Backend {
	case BackendNCCL:
	case BackendDisk:
		if !c.Generation.HasDiskBackend() {
			return c, fmt.Errorf("double: the disk backend needs generation C, D or E, not %s", c.Generation)
		}
	case BackendIPC:
		if !c.Generation.hasSessions() {
			return c, fmt.Errorf("double: the ipc backend needs generation C, D or E, not %s", c.Generation)
		}
		if !vllm.IsGPUUUID(c.GPUUUID) {
			return c, fmt.Errorf("double: the ipc backend needs GPUUUID, the GPU's UUID as torch prints it (lowercase 8-4-4-4-12 hex without \"GPU-\"), got %q", clip(c.GPUUUID))
		}
	default:
		return c, fmt.Errorf("double: backend %q, want disk, nccl or ipc", c.Backend)
	}
	switch c.LoadFormat {
	case "":
		c.LoadFormat = LoadFormatAuto
	case LoadFormatAuto, LoadFormatDummy:
	default:
		return c, fmt.Errorf("double: load format %q, want auto or dummy", c.LoadFormat)
	}
	if c.WorldSize == 0 {
		c.WorldSize = 1
	}
	if c.DataParallel == 0 {
		c.DataParallel = 1
	}
	if c.WorldSize < 1 || c.DataParallel < 1 || c.WorldSize*c.DataParallel > 4096 {
		return c, fmt.Errorf("double: world size %d x data parallel %d, want 1..4096 ranks", c.WorldSize, c.DataParallel)
	}
	if c.ModelName == "" {
		c.ModelName = DefaultModelName
	}
	if c.MaxModelLen == 0 {
		c.MaxModelLen = DefaultMaxModelLen
	}
	if c.MaxModelLen < 1 || c.MaxModelLen > 1<<20 {
		return c, fmt.Errorf("double: max model len %d, want 1..%d", c.MaxModelLen, 1<<20)
	}
	if c.Version == "" {
		c.Version = versionFor(c.Generation)
	}
	if c.Latency < 0 || c.MaxConcurrent < 0 {
		return c, errors.New("double: latency and max concurrent must not be negative")
	}
	if c.RendezvousTimeout == 0 {
		c.RendezvousTimeout = DefaultRendezvousTimeout
	}
	if c.RendezvousTimeout < 0 {
		return c, errors.New("double: rendezvous timeout must not be negative")
	}
	if c.GPUMemoryBytes == 0 {
		c.GPUMemoryBytes = DefaultGPUMemoryBytes
	}
	if c.GPUMemoryBytes < 0 {
		return c, errors.New("double: GPU memory bytes must not be negative")
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxBodyBytes < 1 {
		return c, errors.New("double: max body bytes must be positive")
	}
	for kind, m := range map[string]map[string]float64{"error": c.Faults.ErrorRate, "drop": c.Faults.DropRate, "slow": c.Faults.SlowRate} {
		for route, p := range m {
			if !(p >= 0 && p <= 1) {
				return c, fmt.Errorf("double: %s rate %v for %q, want 0..1", kind, p, route)
			}
		}
	}
	if c.Faults.SlowBy < 0 {
		return c, errors.New("double: SlowBy must not be negative")
	}
	return c, nil
}

// versionFor gives each generation a plausible vLLM version for GET
// /version, the one place the double keeps them. The D boundary is from
// the spec (D is vLLM 0.28+); E's 0.30.0 is where rlflow's client (package
// vllm, firstGenE) starts treating a server as E; A, B and C are
// illustrative (the client tells A and B by their routes, not by version).
func versionFor(g Generation) string {
	switch g {
	case GenA:
		return "0.25.0"
	case GenB:
		return "0.26.0"
	case GenC:
		return "0.27.0"
	case GenE:
		return "0.30.0"
	}
	return "0.28.0"
}

// Handler serves the double's HTTP API.
func (s *Server) Handler() http.Handler { return s.handler }

// Config returns the effective configuration (defaults filled in).
func (s *Server) Config() Config { return s.cfg }

// ListenAndServe binds exactly addr (no wildcard substitution) and serves
// until ctx is done, then shuts down (in-flight requests get 5 s).
func (s *Server) ListenAndServe(ctx context.Context, addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("double: listen on %s: %w", addr, err)
	}
	return s.Serve(ctx, ln)
}

func (s *Server) httpServer() *http.Server {
	return &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
	}
}

// Serve serves on ln until ctx is done; it closes ln.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	srv := s.httpServer()
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-done:
			return
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			srv.Close()
		}
	}()
	err := srv.Serve(ln)
	close(done)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("double: serve: %w", err)
}

// Running is a Server serving in the background (Start) until Kill.
type Running struct {
	addr string
	srv  *http.Server
	done chan struct{}
}

// Start serves s on addr ("127.0.0.1:0": a free port) in the background.
// Kill, Close, then New and Start on the same Addr play a restart of
// vLLM: a new process on the same address, with the weights it starts
// with (version reset) and a new process start time on /metrics.
func (s *Server) Start(addr string) (*Running, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("double: listen on %s: %w", addr, err)
	}
	r := &Running{addr: ln.Addr().String(), srv: s.httpServer(), done: make(chan struct{})}
	go func() {
		_ = r.srv.Serve(ln)
		close(r.done)
	}()
	return r, nil
}

// Addr is the host:port the server listens on.
func (r *Running) Addr() string { return r.addr }

// URL is the server's base URL.
func (r *Running) URL() string { return "http://" + r.addr }

// Kill stops serving at once, as a killed process stops: the listener and
// every connection close, and requests in flight get no answer. It
// returns when the address is free again.
func (r *Running) Kill() {
	r.srv.Close()
	<-r.done
}

// StartTime is when New made the server: its process start time.
func (s *Server) StartTime() time.Time { return s.started }

// Close releases what the server holds: the TCPStore connections of the
// last NCCL init and the temporary random model. Serving after Close still
// works, except that a generated model file is gone from disk.
func (s *Server) Close() error {
	s.mu.Lock()
	rdv := s.rdv
	s.rdv = nil
	s.mu.Unlock()
	rdv.close()
	if s.tmpDir != "" {
		return os.RemoveAll(s.tmpDir)
	}
	return nil
}

// Stats returns a copy of the counters.
func (s *Server) Stats() Stats {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	out := s.stats
	out.Requests = copyMap(s.stats.Requests)
	out.Prompts = copyMap(s.stats.Prompts)
	out.Faults = copyMap(s.stats.Faults)
	out.PeakRunning = s.sched.peakRunning()
	out.Unsent = s.sched.unsentCount()
	out.Open = s.sched.openCount()
	return out
}

func copyMap(m map[string]int) map[string]int {
	out := make(map[string]int, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// Model returns the model currently serving generations.
func (s *Server) Model() *bigram.Model { return s.model.Load() }

// WeightVersion returns the current weight version ("" before any).
func (s *Server) WeightVersion() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.wstate.version
}

// NCCLUniqueID returns the 128-byte NCCL unique id of the last successful
// NCCL init (from the TCPStore or nccl_unique_id_b64), nil before one.
func (s *Server) NCCLUniqueID() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.wstate.init == nil {
		return nil
	}
	return append([]byte(nil), s.wstate.init.UniqueID...)
}

// PickleModule is the module the pickled ncclUniqueId of the last NCCL
// init named (ncclid.ModulePath or ncclid.BackendsModulePath), also when
// the generation refused it; "" before any, or when the last init passed
// nccl_unique_id_b64 or failed before reading a pickle.
func (s *Server) PickleModule() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.wstate.pickleModule
}

// WorkerLoadFormat is the workers' load format now: Config.LoadFormat
// until a collective_rpc update_config changes it (GET /server_info keeps
// reporting the one the server started with).
func (s *Server) WorkerLoadFormat() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.wstate.loadFormat
}

// dummyWeights are the weights of --load-format dummy. vLLM's
// DummyModelLoader draws them with a fixed seed, so every draw is the same;
// the double's are the random bigram model of Config.Seed.
func (s *Server) dummyWeights() *bigram.Model { return bigram.Random(s.cfg.Seed) }

func (s *Server) count(f func(*Stats)) {
	s.statsMu.Lock()
	f(&s.stats)
	s.statsMu.Unlock()
}

// chance draws true with probability p.
func (s *Server) chance(p float64) bool {
	if p <= 0 {
		return false
	}
	s.randMu.Lock()
	defer s.randMu.Unlock()
	return s.rand.Float64() < p
}

func (s *Server) seed() (uint64, uint64) {
	s.randMu.Lock()
	defer s.randMu.Unlock()
	return s.rand.Uint64(), s.rand.Uint64()
}

// The benchmark setting: every sequence takes exactly BenchLatency and at
// most BenchSlots run at once, so a client can be measured against
// sequential calls and against IdealDuration.
const (
	BenchLatency = 50 * time.Millisecond
	BenchSlots   = 256
)

// BenchConfig is a dev-mode server with the benchmark latency and slots.
func BenchConfig() Config {
	return Config{DevMode: true, Latency: BenchLatency, MaxConcurrent: BenchSlots}
}

// IdealDuration is the least time sequences (prompts × n) can take on a
// server with cfg's Latency and MaxConcurrent: full rounds of Latency, one
// per MaxConcurrent sequences (one round when slots are unlimited).
func IdealDuration(cfg Config, sequences int) time.Duration {
	if sequences <= 0 {
		return 0
	}
	if cfg.MaxConcurrent <= 0 {
		return cfg.Latency
	}
	rounds := (sequences + cfg.MaxConcurrent - 1) / cfg.MaxConcurrent
	return time.Duration(rounds) * cfg.Latency
}
