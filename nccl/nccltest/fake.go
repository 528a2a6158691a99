// Package nccltest holds Fake, the test double of nccl.API for machines
// without a GPU: rlflow's CPU tests and `rlflow worker --gpu --fake-nccl`,
// which the CPU end-to-end tests start. It is not a GPU emulator and never
// stands in for the real path in a claim.
package nccltest

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"time"
	"unsafe"

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
	regHook func(b []byte, flags uint) error
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

// OnHostRegister installs a hook consulted by every HostRegister before it
// registers anything: a non-nil error is returned as the call's failure
// (like cudaHostRegister refusing a read-only file mapping), so tests can
// exercise the fallbacks. nil removes the hook.
func (f *Fake) OnHostRegister(hook func(b []byte, flags uint) error) {
	f.mu.Lock()
	f.regHook = hook
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

// Leaks describes every device allocation, pinned host allocation, stream,
// event and communicator still alive, or returns "" when there are none.
func (f *Fake) Leaks() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var parts []string
	if n := len(f.allocs); n > 0 {
		parts = append(parts, fmt.Sprintf("%d device allocations", n))
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

// ---- device memory ----

type fakeAlloc struct {
	dev  int
	base uintptr
	mem  []byte
}

// Fake device addresses: device d's allocations live at (d+1)<<40 + offset,
// so a pointer says which device it belongs to, as with CUDA's UVA.
func devBase(d int) uintptr { return uintptr(d+1) << 40 }

func (f *Fake) devSlice(p nccl.DevPtr, n int) ([]byte, int, error) {
	i := sort.Search(len(f.allocs), func(i int) bool { return f.allocs[i].base > uintptr(p) }) - 1
	if i >= 0 {
		a := f.allocs[i]
		off := uintptr(p) - a.base
		if off+uintptr(n) <= uintptr(len(a.mem)) {
			return a.mem[off : off+uintptr(n)], a.dev, nil
		}
	}
	return nil, 0, &nccl.Error{Func: "fake", Code: nccl.CudaErrorIllegalAddress, Detail: fmt.Sprintf("%d bytes at %#x are not inside one device allocation", n, uintptr(p))}
}

func (f *Fake) CUDARuntimeVersion() (int, error) { return 13000, nil }

func (f *Fake) GetDeviceCount() (int, error) { return f.cfg.Devices, nil }

func (f *Fake) SetDevice(d int) error {
	if d < 0 || d >= f.cfg.Devices {
		return &nccl.Error{Func: "cudaSetDevice", Code: nccl.CudaErrorInvalidDevice}
	}
	f.mu.Lock()
	f.cur[nccl.ThreadID()] = d
	f.mu.Unlock()
	return nil
}

func (f *Fake) MemGetInfo() (uint64, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.device()
	return f.cfg.DeviceMemory - f.used[d], f.cfg.DeviceMemory, nil
}

func (f *Fake) Malloc(n int) (nccl.DevPtr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.device()
	if n <= 0 || f.used[d]+uint64(n) > f.cfg.DeviceMemory {
		return 0, &nccl.Error{Func: "cudaMalloc", Code: nccl.CudaErrorMemoryAllocation, Detail: fmt.Sprintf("%d bytes on fake device %d (%d of %d in use)", n, d, f.used[d], f.cfg.DeviceMemory)}
	}
	// Bump allocation, 256-byte aligned like cudaMalloc; addresses are
	// never reused, so a use after free is an illegal address.
	base := max(devBase(d), f.bump[d])
	base = (base + 255) &^ 255
	f.bump[d] = base + uintptr(n)
	a := &fakeAlloc{dev: d, base: base, mem: make([]byte, n)}
	i := sort.Search(len(f.allocs), func(i int) bool { return f.allocs[i].base > base })
	f.allocs = append(f.allocs, nil)
	copy(f.allocs[i+1:], f.allocs[i:])
	f.allocs[i] = a
	f.used[d] += uint64(n)
	return nccl.DevPtr(base), nil
}

func (f *Fake) Free(p nccl.DevPtr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, a := range f.allocs {
		if a.base == uintptr(p) {
			f.used[a.dev] -= uint64(len(a.mem))
			f.allocs = append(f.allocs[:i], f.allocs[i+1:]...)
			return nil
		}
	}
	return &nccl.Error{Func: "cudaFree", Code: nccl.CudaErrorInvalidValue, Detail: fmt.Sprintf("%#x is not an allocation", uintptr(p))}
}

func (f *Fake) Memset(p nccl.DevPtr, v byte, n int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, _, err := f.devSlice(p, n)
	if err != nil {
		return err
	}
	for i := range b {
		b[i] = v
	}
	return nil
}

func (f *Fake) MemsetAsync(p nccl.DevPtr, v byte, n int, s nccl.Stream) error {
	return f.enqueue(s, "cudaMemsetAsync", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		b, _, err := f.devSlice(p, n)
		if err != nil {
			return err
		}
		for i := range b {
			b[i] = v
		}
		return nil
	})
}

// ---- host memory ----

func (f *Fake) HostAlloc(n int, flags uint) ([]byte, error) {
	if n <= 0 {
		return nil, &nccl.Error{Func: "cudaHostAlloc", Code: nccl.CudaErrorInvalidValue}
	}
	b := make([]byte, n)
	f.mu.Lock()
	f.hostMem[uintptr(unsafe.Pointer(&b[0]))] = b
	f.mu.Unlock()
	f.pinned.Add(b, true)
	return b, nil
}

func (f *Fake) FreeHost(b []byte) error {
	if !f.pinned.Remove(b, true) {
		return &nccl.Error{Func: "cudaFreeHost", Code: nccl.CudaErrorInvalidValue, Detail: "not a HostAlloc allocation"}
	}
	f.mu.Lock()
	delete(f.hostMem, uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	f.mu.Unlock()
	return nil
}

func (f *Fake) HostRegister(b []byte, flags uint) error {
	if len(b) == 0 {
		return nil
	}
	f.mu.Lock()
	hook := f.regHook
	f.mu.Unlock()
	if hook != nil {
		if err := hook(b, flags); err != nil {
			return err
		}
	}
	// Like CUDA, any overlap with pinned memory is refused, so that callers
	// that register a mapping piecewise must keep the pieces disjoint.
	if f.pinned.Overlaps(b) {
		return &nccl.Error{Func: "cudaHostRegister", Code: nccl.CudaErrorHostMemAlreadyReg}
	}
	f.pinned.Add(b, false)
	return nil
}

func (f *Fake) HostUnregister(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if !f.pinned.Remove(b, false) {
		return &nccl.Error{Func: "cudaHostUnregister", Code: nccl.CudaErrorHostMemNotReg}
	}
	return nil
}

func (f *Fake) MemcpyHtoDAsync(dst nccl.DevPtr, src []byte, s nccl.Stream) error {
	if len(src) == 0 {
		return nil
	}
	if !f.pinned.Contains(src) {
		return fmt.Errorf("cudaMemcpyAsync HtoD: %w", nccl.ErrNotPinned)
	}
	f.mu.Lock()
	_, _, err := f.devSlice(dst, len(src))
	f.mu.Unlock()
	if err != nil {
		return err
	}
	// Like the GPU, read the host bytes when the copy executes, not now.
	return f.enqueue(s, "cudaMemcpyAsync HtoD", func() error {
		// Memory unregistered (or freed) before its copy ran is a bug the
		// GPU would not report: the fake does.
		if !f.pinned.Contains(src) {
			return &nccl.Error{Func: "fake", Code: nccl.CudaErrorIllegalAddress, Detail: "host memory of a pending HtoD copy was unregistered or freed before the copy ran"}
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		d, _, err := f.devSlice(dst, len(src))
		if err != nil {
			return err
		}
		copy(d, src)
		return nil
	})
}

func (f *Fake) MemcpyDtoHAsync(dst []byte, src nccl.DevPtr, s nccl.Stream) error {
	if len(dst) == 0 {
		return nil
	}
	if !f.pinned.Contains(dst) {
		return fmt.Errorf("cudaMemcpyAsync DtoH: %w", nccl.ErrNotPinned)
	}
	return f.enqueue(s, "cudaMemcpyAsync DtoH", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		d, _, err := f.devSlice(src, len(dst))
		if err != nil {
			return err
		}
		copy(dst, d)
		return nil
	})
}

func (f *Fake) MemcpyDtoDAsync(dst, src nccl.DevPtr, n int, s nccl.Stream) error {
	if n == 0 {
		return nil
	}
	return f.enqueue(s, "cudaMemcpyAsync DtoD", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		d, _, err := f.devSlice(dst, n)
		if err != nil {
			return err
		}
		sb, _, err := f.devSlice(src, n)
		if err != nil {
			return err
		}
		copy(d, sb)
		return nil
	})
}

// ---- streams ----

type fakeStream struct {
	dev     int
	q       []func() error
	pending int // queued + running
	err     error
	closing bool
}

func (f *Fake) newStream(dev int) *fakeStream {
	s := &fakeStream{dev: dev}
	go f.drain(s)
	return s
}

// drain executes s's operations in order, one at a time.
func (f *Fake) drain(s *fakeStream) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for {
		for len(s.q) == 0 && !s.closing {
			f.cond.Wait()
		}
		if len(s.q) == 0 {
			return
		}
		op := s.q[0]
		s.q = s.q[1:]
		f.mu.Unlock()
		if f.cfg.OpDelay > 0 {
			time.Sleep(f.cfg.OpDelay)
		}
		err := op()
		f.mu.Lock()
		if err != nil && s.err == nil {
			s.err = err // sticky, like a failed kernel
		}
		s.pending--
		f.cond.Broadcast()
	}
}

func (f *Fake) stream(s nccl.Stream) (*fakeStream, error) {
	if s == 0 {
		d := f.device()
		st := f.defStr[d]
		if st == nil {
			st = f.newStream(d)
			f.defStr[d] = st
		}
		return st, nil
	}
	st := f.streams[s]
	if st == nil {
		return nil, &nccl.Error{Func: "fake", Code: nccl.CudaErrorInvalidHandle, Detail: fmt.Sprintf("no stream %#x", uintptr(s))}
	}
	return st, nil
}

func (f *Fake) enqueue(s nccl.Stream, fn string, op func() error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.stream(s)
	if err != nil {
		return fmt.Errorf("%s: %w", fn, err)
	}
	st.q = append(st.q, op)
	st.pending++
	f.cond.Broadcast()
	return nil
}

func (f *Fake) StreamCreate(flags uint) (nccl.Stream, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h := nccl.Stream(f.handle())
	f.streams[h] = f.newStream(f.device())
	return h, nil
}

func (f *Fake) StreamDestroy(s nccl.Stream) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.streams[s]
	if st == nil {
		return &nccl.Error{Func: "cudaStreamDestroy", Code: nccl.CudaErrorInvalidHandle}
	}
	// CUDA lets pending work finish after destroy; so does the drainer.
	st.closing = true
	delete(f.streams, s)
	f.cond.Broadcast()
	return nil
}

func (f *Fake) StreamSynchronize(s nccl.Stream) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.stream(s)
	if err != nil {
		return err
	}
	for st.pending > 0 {
		f.cond.Wait()
	}
	return st.err
}

func (f *Fake) StreamQuery(s nccl.Stream) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.stream(s)
	if err != nil {
		return false, err
	}
	if st.err != nil {
		return false, st.err
	}
	return st.pending == 0, nil
}

func (f *Fake) DeviceSynchronize() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.device()
	for {
		busy := false
		for _, st := range f.streams {
			if st.dev == d && st.pending > 0 {
				busy = true
			}
		}
		if st := f.defStr[d]; st != nil && st.pending > 0 {
			busy = true
		}
		if !busy {
			return nil
		}
		f.cond.Wait()
	}
}

// ---- events ----

type fakeEvent struct {
	flags     uint
	recorded  int // records enqueued
	completed int // records executed
	at        time.Time
}

func (f *Fake) EventCreate(flags uint) (nccl.Event, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h := nccl.Event(f.handle())
	f.events[h] = &fakeEvent{flags: flags}
	return h, nil
}

func (f *Fake) event(e nccl.Event) (*fakeEvent, error) {
	ev := f.events[e]
	if ev == nil {
		return nil, &nccl.Error{Func: "fake", Code: nccl.CudaErrorInvalidHandle, Detail: fmt.Sprintf("no event %#x", uintptr(e))}
	}
	return ev, nil
}

func (f *Fake) EventRecord(e nccl.Event, s nccl.Stream) error {
	f.mu.Lock()
	ev, err := f.event(e)
	if err != nil {
		f.mu.Unlock()
		return err
	}
	ev.recorded++
	target := ev.recorded
	f.mu.Unlock()
	return f.enqueue(s, "cudaEventRecord", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		if target > ev.completed {
			ev.completed = target
			ev.at = time.Now()
		}
		return nil
	})
}

func (f *Fake) StreamWaitEvent(s nccl.Stream, e nccl.Event) error {
	f.mu.Lock()
	ev, err := f.event(e)
	if err != nil {
		f.mu.Unlock()
		return err
	}
	target := ev.recorded // the most recent record at the time of the call
	f.mu.Unlock()
	return f.enqueue(s, "cudaStreamWaitEvent", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		for ev.completed < target {
			f.cond.Wait()
		}
		return nil
	})
}

func (f *Fake) EventSynchronize(e nccl.Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev, err := f.event(e)
	if err != nil {
		return err
	}
	for ev.completed < ev.recorded {
		f.cond.Wait()
	}
	return nil
}

func (f *Fake) EventQuery(e nccl.Event) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev, err := f.event(e)
	if err != nil {
		return false, err
	}
	return ev.completed >= ev.recorded, nil
}

func (f *Fake) EventElapsedTime(start, end nccl.Event) (time.Duration, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a, err := f.event(start)
	if err != nil {
		return 0, err
	}
	b, err := f.event(end)
	if err != nil {
		return 0, err
	}
	if a.flags&nccl.EventDisableTiming != 0 || b.flags&nccl.EventDisableTiming != 0 || a.recorded == 0 || b.recorded == 0 {
		return 0, &nccl.Error{Func: "cudaEventElapsedTime", Code: nccl.CudaErrorInvalidHandle}
	}
	if a.completed < a.recorded || b.completed < b.recorded {
		return 0, &nccl.Error{Func: "cudaEventElapsedTime", Code: nccl.CudaErrorNotReady}
	}
	return b.at.Sub(a.at), nil
}

func (f *Fake) EventDestroy(e nccl.Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.events[e]; !ok {
		return &nccl.Error{Func: "cudaEventDestroy", Code: nccl.CudaErrorInvalidHandle}
	}
	delete(f.events, e)
	return nil
}

// ---- NCCL ----

type fakeGroup struct {
	world   int
	members map[int]*fakeComm
	ready   bool // every rank joined (or is virtual)
	slots   map[int]*fakeSlot
}

type fakeSlot struct {
	posts map[int]*fakePost
	done  bool
}

type fakePost struct {
	call *Call
	comm *fakeComm
}

type fakeComm struct {
	h          nccl.CommHandle
	g          *fakeGroup
	rank, dev  int
	blocking   bool
	asyncErr   nccl.Result
	detail     string
	aborted    bool
	finalizing bool
	next       int // next collective index
}

func (f *Fake) NCCLVersion() (int, error) { return 22803, nil }

func (f *Fake) GetUniqueID() (nccl.UniqueID, error) {
	f.mu.Lock()
	f.idSeq++
	seq := f.idSeq
	f.mu.Unlock()
	var id nccl.UniqueID
	copy(id[:], "rlflow-fake-nccl")
	binary.LittleEndian.PutUint64(id[16:], seq)
	binary.LittleEndian.PutUint64(id[24:], uint64(time.Now().UnixNano()))
	return id, nil
}

func (f *Fake) record(c Call) *Call {
	c.Thread = nccl.ThreadID()
	f.calls = append(f.calls, &c)
	return &c
}

func (f *Fake) groupReady(g *fakeGroup) bool {
	if f.cfg.VirtualPeers {
		return g.members[0] != nil
	}
	return len(g.members) == g.world
}

func (f *Fake) CommInitRank(nranks int, id nccl.UniqueID, rank int) (nccl.CommHandle, error) {
	h, err := f.CommInitRankConfig(nranks, id, rank, nccl.CommConfig{Blocking: true})
	return h, err
}

func (f *Fake) CommInitRankConfig(nranks int, id nccl.UniqueID, rank int, cfg nccl.CommConfig) (nccl.CommHandle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if nranks < 1 || rank < 0 || rank >= nranks {
		return 0, &nccl.Error{Func: "ncclCommInitRankConfig", Code: nccl.InvalidArgument, Detail: fmt.Sprintf("rank %d of %d", rank, nranks)}
	}
	g := f.groups[id]
	if g == nil {
		g = &fakeGroup{world: nranks, members: map[int]*fakeComm{}, slots: map[int]*fakeSlot{}}
		f.groups[id] = g
	}
	if g.world != nranks || g.members[rank] != nil {
		return 0, &nccl.Error{Func: "ncclCommInitRankConfig", Code: nccl.InvalidUsage, Detail: fmt.Sprintf("rank %d of %d does not fit the group (world %d)", rank, nranks, g.world)}
	}
	c := &fakeComm{h: nccl.CommHandle(f.handle()), g: g, rank: rank, dev: f.device(), blocking: cfg.Blocking}
	f.comms[c.h] = c
	g.members[rank] = c
	f.record(Call{Op: "CommInitRank", Comm: c.h, Rank: rank, World: nranks, Device: c.dev})
	if f.groupReady(g) && !g.ready {
		if f.cfg.VirtualPeers && f.cfg.VirtualJoinDelay > 0 {
			time.AfterFunc(f.cfg.VirtualJoinDelay, func() {
				f.mu.Lock()
				g.ready = true
				f.cond.Broadcast()
				f.mu.Unlock()
			})
		} else {
			g.ready = true
		}
	}
	f.cond.Broadcast()
	if !cfg.Blocking {
		if g.ready {
			return c.h, nil
		}
		return c.h, &nccl.Error{Func: "ncclCommInitRankConfig", Code: nccl.InProgress}
	}
	for !g.ready && !c.aborted && c.asyncErr == 0 {
		f.cond.Wait()
	}
	if c.asyncErr != 0 {
		return c.h, &nccl.Error{Func: "ncclCommInitRank", Code: c.asyncErr, Detail: c.detail}
	}
	return c.h, nil
}

func (f *Fake) comm(h nccl.CommHandle, fn string) (*fakeComm, error) {
	c := f.comms[h]
	if c == nil {
		return nil, &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: fmt.Sprintf("no communicator %#x (destroyed or aborted?)", uintptr(h))}
	}
	return c, nil
}

func (f *Fake) CommGetAsyncError(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommGetAsyncError")
	if err != nil {
		return err
	}
	switch {
	case c.asyncErr != 0:
		return &nccl.Error{Func: "ncclCommGetAsyncError (async)", Code: c.asyncErr, Detail: c.detail}
	case !c.g.ready:
		return &nccl.Error{Func: "ncclCommGetAsyncError (async)", Code: nccl.InProgress}
	case c.finalizing:
		c.finalizing = false // answer InProgress once, like a real flush
		return &nccl.Error{Func: "ncclCommGetAsyncError (async)", Code: nccl.InProgress}
	}
	return nil
}

func (f *Fake) AllReduce(send, recv nccl.DevPtr, count int, dt nccl.DataType, op nccl.RedOp, h nccl.CommHandle, s nccl.Stream) error {
	if dt != nccl.Float32 || op != nccl.Sum {
		return &nccl.Error{Func: "ncclAllReduce", Code: nccl.InvalidArgument, Detail: "the fake implements float32 sum only"}
	}
	return f.collective(Call{Op: "AllReduce", Count: count, DType: dt, Bytes: count * dt.Size(), Send: send, Recv: recv}, h, s)
}

func (f *Fake) Broadcast(send, recv nccl.DevPtr, count int, dt nccl.DataType, root int, h nccl.CommHandle, s nccl.Stream) error {
	if !dt.Valid() {
		return &nccl.Error{Func: "ncclBroadcast", Code: nccl.InvalidArgument, Detail: dt.String()}
	}
	return f.collective(Call{Op: "Broadcast", Count: count, DType: dt, Bytes: count * dt.Size(), Root: root, Send: send, Recv: recv}, h, s)
}

func (f *Fake) collective(call Call, h nccl.CommHandle, s nccl.Stream) error {
	fn := "nccl" + call.Op
	f.mu.Lock()
	c, err := f.comm(h, fn)
	if err != nil {
		f.mu.Unlock()
		return err
	}
	if !c.g.ready {
		f.mu.Unlock()
		return &nccl.Error{Func: fn, Code: nccl.InvalidUsage, Detail: "communicator initialisation not complete"}
	}
	if call.Root < 0 || call.Root >= c.g.world {
		f.mu.Unlock()
		return &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: fmt.Sprintf("root %d", call.Root)}
	}
	for _, p := range []nccl.DevPtr{call.Send, call.Recv} {
		_, dev, err := f.devSlice(p, call.Bytes)
		if err != nil {
			f.mu.Unlock()
			return &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: err.Error()}
		}
		if dev != c.dev {
			f.mu.Unlock()
			return &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: fmt.Sprintf("buffer %#x is on device %d, the communicator on %d", uintptr(p), dev, c.dev)}
		}
	}
	call.Comm, call.Rank, call.World, call.Device = h, c.rank, c.g.world, c.dev
	call.Index = c.next
	c.next++
	rec := f.record(call)
	f.mu.Unlock()
	return f.enqueue(s, fn, func() error { return f.execute(c, rec) })
}

// execute runs on the stream's drainer: post this rank's part and wait for
// the other ranks, a fault, or abort.
func (f *Fake) execute(c *fakeComm, call *Call) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	fault := Fault{}
	if f.hook != nil {
		hook, snapshot := f.hook, *call
		f.mu.Unlock()
		fault = hook(snapshot)
		f.mu.Lock()
	}
	if fault.Stall || fault.Err != 0 {
		if fault.Err != 0 {
			time.AfterFunc(fault.Delay, func() {
				f.mu.Lock()
				if !c.aborted && c.asyncErr == 0 {
					c.asyncErr, c.detail = fault.Err, "injected by the fake"
				}
				f.cond.Broadcast()
				f.mu.Unlock()
			})
		}
		for !c.aborted {
			f.cond.Wait()
		}
		return nil
	}
	g := c.g
	slot := g.slots[call.Index]
	if slot == nil {
		slot = &fakeSlot{posts: map[int]*fakePost{}}
		g.slots[call.Index] = slot
	}
	slot.posts[c.rank] = &fakePost{call: call, comm: c}
	need := g.world
	if f.cfg.VirtualPeers {
		need = 1
	}
	if len(slot.posts) == need && !slot.done {
		f.complete(g, slot)
	}
	for !slot.done && !c.aborted && c.asyncErr == 0 {
		f.cond.Wait()
	}
	return nil
}

// complete moves the bytes of one collective once every real rank posted
// it. Ranks that disagree about the collective get ncclInvalidUsage: real
// NCCL would hang or corrupt memory, the fake says what went wrong.
func (f *Fake) complete(g *fakeGroup, slot *fakeSlot) {
	defer f.cond.Broadcast()
	slot.done = true
	var first *Call
	for _, p := range slot.posts {
		if first == nil {
			first = p.call
			continue
		}
		c := p.call
		if c.Op != first.Op || c.Count != first.Count || c.DType != first.DType || c.Root != first.Root {
			for _, q := range slot.posts {
				q.comm.asyncErr = nccl.InvalidUsage
				q.comm.detail = fmt.Sprintf("collective %d mismatch: rank %d %s %d x %v root %d, rank %d %s %d x %v root %d",
					c.Index, first.Rank, first.Op, first.Count, first.DType, first.Root, c.Rank, c.Op, c.Count, c.DType, c.Root)
			}
			return
		}
	}
	switch first.Op {
	case "Broadcast":
		root := slot.posts[first.Root]
		if root == nil { // only with virtual peers: the root is simulated
			return
		}
		src, _, err := f.devSlice(root.call.Send, root.call.Bytes)
		if err != nil {
			root.comm.asyncErr, root.comm.detail = nccl.UnhandledCudaError, err.Error()
			return
		}
		if f.cfg.KeepData {
			root.call.Data = append([]byte(nil), src...)
		}
		for _, p := range slot.posts {
			dst, _, err := f.devSlice(p.call.Recv, p.call.Bytes)
			if err != nil {
				p.comm.asyncErr, p.comm.detail = nccl.UnhandledCudaError, err.Error()
				continue
			}
			copy(dst, src)
		}
	case "AllReduce":
		sum := make([]float32, first.Count)
		for _, p := range slot.posts {
			b, _, _ := f.devSlice(p.call.Send, p.call.Bytes)
			for i := range sum {
				sum[i] += math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
			}
		}
		for _, p := range slot.posts {
			b, _, _ := f.devSlice(p.call.Recv, p.call.Bytes)
			for i, v := range sum {
				binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
			}
		}
	}
}

func (f *Fake) CommAbort(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommAbort")
	if err != nil {
		return err
	}
	f.record(Call{Op: "CommAbort", Comm: h, Rank: c.rank, World: c.g.world, Device: c.dev})
	c.aborted = true
	f.leave(c)
	// The other ranks' sockets close: they see a remote error, as with NCCL.
	for _, m := range c.g.members {
		if m.asyncErr == 0 {
			m.asyncErr, m.detail = nccl.RemoteError, fmt.Sprintf("rank %d aborted its communicator", c.rank)
		}
	}
	f.cond.Broadcast()
	return nil
}

func (f *Fake) leave(c *fakeComm) {
	delete(f.comms, c.h)
	if c.g.members[c.rank] == c {
		delete(c.g.members, c.rank)
	}
}

func (f *Fake) CommFinalize(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommFinalize")
	if err != nil {
		return err
	}
	f.record(Call{Op: "CommFinalize", Comm: h, Rank: c.rank, World: c.g.world, Device: c.dev})
	if !c.blocking {
		c.finalizing = true
		return &nccl.Error{Func: "ncclCommFinalize", Code: nccl.InProgress}
	}
	return nil
}

func (f *Fake) CommDestroy(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommDestroy")
	if err != nil {
		return err
	}
	f.record(Call{Op: "CommDestroy", Comm: h, Rank: c.rank, World: c.g.world, Device: c.dev})
	f.leave(c)
	f.cond.Broadcast()
	return nil
}
