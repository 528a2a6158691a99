// Package double is a TEST AND DEMO DOUBLE of a vLLM server: it speaks the
// HTTP contract of `vllm serve` with VLLM_SERVER_DEV_MODE=1 (the RLHF
// weight-transfer routes of API generations B, C and D, pause/resume, the
// OpenAI completions and chat API), with vLLM's status codes and strict
// payload validation, so that rlflow can be tested and demonstrated on
// machines without a GPU. It is not an inference engine: its model is a
// character bigram table (package bigram) whose samples visibly change when
// new weights arrive.
//
// Invariants:
//   - Only the routes of the configured generation exist (others are 404,
//     a wrong method on an existing route is 405, as in FastAPI); without
//     DevMode every RLHF route is 404.
//   - An unknown key anywhere in a weight-transfer body is a 500 with a
//     message like the TypeError vLLM's dataclasses raise; a missing body,
//     bad JSON or a missing init_info/update_info is a 400.
//   - C/D session rules hold: update_weights needs an open session, a second
//     start while one is open fails, finish needs an open session, and the
//     disk backend takes exactly one checkpoint per session.
//   - The disk backend really loads the checkpoint; the NCCL backend really
//     performs a worker's TCPStore rendezvous with the trainer, but has no
//     NCCL data plane unless Config.NCCLReceiver supplies one.
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

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// Generation is the vLLM RLHF API generation the double serves.
type Generation string

const (
	GenB Generation = "B"
	GenC Generation = "C"
	GenD Generation = "D"
)

// Backends (vLLM's --weight-transfer-config backend).
const (
	BackendDisk = "disk"
	BackendNCCL = "nccl"
)

// Defaults.
const (
	DefaultModelName         = "bigram-double"
	DefaultMaxModelLen       = 2048
	DefaultRendezvousTimeout = 300 * time.Second // vLLM's StatelessProcessGroup timeout
	DefaultMaxBodyBytes      = 64 << 20
)

// Config configures a Server. The zero value is a generation D disk-backend
// server with the RLHF routes off (DevMode false), as `vllm serve` is
// without VLLM_SERVER_DEV_MODE=1.
type Config struct {
	Generation Generation // B, C or D; "" means D
	Backend    string     // "disk" or "nccl"; "" means disk (B needs nccl)
	DevMode    bool       // false: every RLHF route answers 404

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
	// ops are the weight-update operations' times, for /metrics.
	opsMu sync.Mutex
	ops   map[string]opStat

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
	s := &Server{cfg: cfg, rand: rand.New(rand.NewPCG(cfg.Seed, 0x646f75626c65)), started: time.Now(), ops: map[string]opStat{}}
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
	m, err := bigram.Load(s.cfg.ModelPath)
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("double: load model: %w", err)
	}
	s.model.Store(m)
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
	case GenB, GenC, GenD:
	default:
		return c, fmt.Errorf("double: generation %q, want B, C or D", c.Generation)
	}
	if c.Backend == "" {
		c.Backend = BackendDisk
		if c.Generation == GenB {
			c.Backend = BackendNCCL
		}
	}
	switch c.Backend {
	case BackendNCCL:
	case BackendDisk:
		if c.Generation == GenB {
			return c, errors.New("double: the disk backend needs generation C or D")
		}
	default:
		return c, fmt.Errorf("double: backend %q, want disk or nccl", c.Backend)
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
// /version. Only the D boundary is from the spec (D is vLLM 0.28+); the B
// and C numbers are illustrative.
func versionFor(g Generation) string {
	switch g {
	case GenB:
		return "0.26.0"
	case GenC:
		return "0.27.0"
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
