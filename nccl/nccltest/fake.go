// Package nccltest holds Fake, the test double of nccl.API for machines
// without a GPU: rlflow's CPU tests and `rlflow worker --gpu --fake-nccl`,
// which the CPU end-to-end tests start. It is not a GPU emulator and never
// stands in for the real path in a claim.
package nccltest

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// Fake is a test double for nccl.API, for tests on machines without a GPU:
// it is not a GPU emulator and never pretends to be one outside tests.
//
// It simulates devices with host memory (fake device addresses, per-device
// memory accounting, the current device per OS thread as CUDA keeps it),
// streams as ordered queues each drained by its own goroutine, events with
// CUDA's "latest record" semantics, and NCCL groups: ranks that join the
// same UniqueID in this process form a communicator and their collectives
// really move bytes between their fake device buffers. Every NCCL call is
// recorded with its bytes (Calls) so that tests can assert the exact wire
// sequence. Faults can be injected: a peer that never joins (just do not
// start it, VirtualPeers off), a collective that stalls or fails
// asynchronously (OnCollective), and aborts, which peers observe as
// ncclRemoteError as they would on real hardware.
type Fake struct {
	cfg Config

	mu   sync.Mutex
	cond *sync.Cond // broadcast on every state change; waits re-check

	next    uintptr
	cur     map[int]int // OS thread -> current device
	used    []uint64    // bytes allocated per device
	bump    []uintptr   // next free fake address per device
	allocs  []*fakeAlloc
	hostMem map[uintptr][]byte // HostAlloc'd slices, kept alive here
	pinned  nccl.PinnedSet
	streams map[nccl.Stream]*fakeStream
	defStr  map[int]*fakeStream // legacy default stream per device
	events  map[nccl.Event]*fakeEvent
	comms   map[nccl.CommHandle]*fakeComm
	groups  map[nccl.UniqueID]*fakeGroup
	calls   []*Call // pointers: executing collectives fill in Data later
	hook    func(Call) Fault
	idSeq   uint64
}

// Config shapes a Fake.
type Config struct {
	// Devices is the number of simulated GPUs (default 1).
	Devices int
	// DeviceMemory is the memory of each simulated GPU (default 1 GiB).
	DeviceMemory uint64
	// VirtualPeers makes every rank other than 0 simulated: such a group is
	// complete as soon as rank 0 joins (after VirtualJoinDelay) and its
	// collectives complete with rank 0 alone. Use it to test the trainer
	// side without writing receivers. Leave it off to test real in-process
	// ranks or a peer that never shows up.
	VirtualPeers bool
	// VirtualJoinDelay delays the simulated peers' arrival, so that
	// non-blocking init really has to poll.
	VirtualJoinDelay time.Duration
	// OpDelay is spent before every stream operation, so that ordering
	// bugs (a pinned buffer rewritten before its copy ran, a broadcast
	// that does not wait for its copy) corrupt the bytes the test checks.
	OpDelay time.Duration
	// KeepData makes every recorded broadcast keep a copy of the bytes the
	// root sent (Call.Data), filled in when the broadcast executes.
	KeepData bool
}

// Fault is what OnCollective decides for one collective.
type Fault struct {
	// Stall: the collective never completes (until the communicator is
	// aborted), like a broadcast whose receiver died without a trace.
	Stall bool
	// Err, if non-zero, becomes the communicator's asynchronous error after
	// Delay (like NCCL noticing a closed socket); the collective stays stuck
	// until abort, as real NCCL kernels do.
	Err   nccl.Result
	Delay time.Duration
}

// Call is one recorded NCCL call.
type Call struct {
	Op     string // "CommInitRank", "AllReduce", "Broadcast", "CommAbort", "CommFinalize", "CommDestroy"
	Comm   nccl.CommHandle
	Rank   int
	World  int
	Device int
	Thread int // OS thread that made the call
	// Collectives only:
	Index int // 0-based collective index on this communicator (0 is the warm-up)
	Count int
	DType nccl.DataType
	Bytes int
	Root  int
	Send  nccl.DevPtr
	Recv  nccl.DevPtr
	Data  []byte // root's bytes (KeepData, broadcasts, once executed)
}

// NewFake returns a Fake with cfg's defaults filled in.
func NewFake(cfg Config) *Fake {
	if cfg.Devices <= 0 {
		cfg.Devices = 1
	}
	if cfg.DeviceMemory == 0 {
		cfg.DeviceMemory = 1 << 30
	}
	f := &Fake{
		cfg:     cfg,
		next:    0x1000,
		cur:     map[int]int{},
		used:    make([]uint64, cfg.Devices),
		bump:    make([]uintptr, cfg.Devices),
		hostMem: map[uintptr][]byte{},
		streams: map[nccl.Stream]*fakeStream{},
		defStr:  map[int]*fakeStream{},
		events:  map[nccl.Event]*fakeEvent{},
		comms:   map[nccl.CommHandle]*fakeComm{},
		groups:  map[nccl.UniqueID]*fakeGroup{},
	}
	f.cond = sync.NewCond(&f.mu)
	return f
}

var _ nccl.API = (*Fake)(nil)

// OnCollective installs a hook consulted as each collective starts
// executing on its stream (nil removes it).
func (f *Fake) OnCollective(hook func(Call) Fault) {
	f.mu.Lock()
	f.hook = hook
	f.mu.Unlock()
}

// Calls returns a copy of every recorded NCCL call, in call order.
func (f *Fake) Calls() []Call {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]Call, len(f.calls))
	for i, c := range f.calls {
		out[i] = *c
	}
	return out
}

// Collectives returns the recorded AllReduce and Broadcast calls of rank.
func (f *Fake) Collectives(rank int) []Call {
	var out []Call
	for _, c := range f.Calls() {
		if c.Rank == rank && (c.Op == "AllReduce" || c.Op == "Broadcast") {
			out = append(out, c)
		}
	}
	return out
}

// Hold enqueues on s an operation that blocks the stream until release is
// called, so that tests can order work deterministically (for instance keep
// a copy from running to prove that a broadcast waits for it). Stream 0 is
// the default stream of the calling thread's current device.
func (f *Fake) Hold(s nccl.Stream) (release func(), err error) {
	ch := make(chan struct{})
	var once sync.Once
	err = f.enqueue(s, "hold", func() error { <-ch; return nil })
	return func() { once.Do(func() { close(ch) }) }, err
}

// DeviceBytes copies n bytes of fake device memory at p.
func (f *Fake) DeviceBytes(p nccl.DevPtr, n int) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, _, err := f.devSlice(p, n)
	if err != nil {
		return nil, err
	}
	return append([]byte(nil), b...), nil
}

// Leaks describes every device allocation, IPC mapping, pinned host
// allocation, stream, event and communicator still alive, or returns ""
// when there are none.
func (f *Fake) Leaks() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var parts []string
	mappings := 0
	for _, a := range f.allocs {
		if a.ipc != nil {
			mappings++
		}
	}
	if n := len(f.allocs) - mappings; n > 0 {
		parts = append(parts, fmt.Sprintf("%d device allocations", n))
	}
	if mappings > 0 {
		parts = append(parts, fmt.Sprintf("%d IPC mappings", mappings))
	}
	if n := len(f.hostMem); n > 0 {
		parts = append(parts, fmt.Sprintf("%d pinned host allocations", n))
	}
	if n := f.pinned.Registered(); n > 0 {
		parts = append(parts, fmt.Sprintf("%d host registrations", n))
	}
	if n := len(f.streams); n > 0 {
		parts = append(parts, fmt.Sprintf("%d streams", n))
	}
	if n := len(f.events); n > 0 {
		parts = append(parts, fmt.Sprintf("%d events", n))
	}
	if n := len(f.comms); n > 0 {
		parts = append(parts, fmt.Sprintf("%d communicators", n))
	}
	return strings.Join(parts, ", ")
}

func (f *Fake) handle() uintptr {
	f.next += 0x10
	return f.next
}

func (f *Fake) device() int { return f.cur[nccl.ThreadID()] }
