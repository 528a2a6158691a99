package staging

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// Mode says how checkpoint bytes reach the device buffers.
type Mode int

const (
	// ModeCopy copies (and converts) the mapped checkpoint into pinned
	// staging buffers with parallel goroutines, then copies those to the
	// device: two passes over host memory, but no page-locking of the file.
	ModeCopy Mode = iota + 1
	// ModeRegister page-locks the checkpoint's read-only mapping in place
	// (cudaHostRegister with ReadOnly|Portable, segment by segment, by
	// RegisterWorkers threads running ahead of the copies) and copies to the
	// device straight from it: no host copy. Registration and the final
	// unregistration are part of the run and of its wall time. Chunks that
	// convert dtypes, sources that are not mapped files, and everything
	// after a failed registration take the ModeCopy path (Result.Fallback
	// says why).
	ModeRegister
)

func (m Mode) String() string {
	switch m {
	case ModeCopy:
		return "copy"
	case ModeRegister:
		return "register"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// UnregisterPolicy says when ModeRegister unpins the checkpoint.
type UnregisterPolicy int

const (
	// UnregisterAtEnd unregisters every segment after the last copy, in
	// parallel on the registration threads: all of it is a tail of the run.
	UnregisterAtEnd UnregisterPolicy = iota + 1
	// UnregisterEarly unregisters each segment on a thread of its own as
	// soon as the copies reading it completed, beside the later copies;
	// only the last segments are left for the end.
	UnregisterEarly
)

func (u UnregisterPolicy) String() string {
	switch u {
	case UnregisterAtEnd:
		return "at-end"
	case UnregisterEarly:
		return "early"
	}
	return fmt.Sprintf("UnregisterPolicy(%d)", int(u))
}

// DefaultOptions supplies every zero field of Options. It is the one place
// to change the staging strategy: TestGPUBenchStage sweeps the candidates on
// the GPU host and prints the best one (GPU-FIGURE stage BEST ...).
var DefaultOptions = Options{
	Mode:    ModeCopy,
	Buffers: 2,
	// CopyWorkers 0: GOMAXPROCS, at most 16 (see withDefaults).
	// A 64 MiB ring of 4 MiB slots, each filled by four workers in 1 MiB
	// parts: the best and steadiest candidate on the H200 host, 88-93% of
	// the pinned ceiling in a quiet run where 2 MiB slots filled by one
	// worker each did 81-88% (a 2 MiB copy by itself runs at 92% of the
	// ceiling, a 4 MiB one at 96%). Rings of 128 MiB did as well there and
	// far worse on another host. When other tenants load the host's
	// memory, every candidate falls alike. See nccl/GPU-RESULTS.md.
	SplitBytes:           1 << 20,
	WindowBytes:          4 << 20,
	PinnedBytes:          64 << 20,
	HostAllocFlags:       nccl.HostAllocPortable,
	RegisterSegmentBytes: 64 << 20,
	RegisterWorkers:      4,
	PrefaultWorkers:      0, // none
	CopyFraction:         0, // all direct
	Unregister:           UnregisterEarly,
	DeviceMargin:         256 << 20,
	CleanupTimeout:       30 * time.Second,
}

// Options tune a Pipeline. Zero values take DefaultOptions' values.
type Options struct {
	// Mode is the staging strategy (default ModeCopy, see DefaultOptions).
	Mode Mode
	// Buffers is the number of device buffers N, each as large as the
	// largest chunk (default 2: chunk k is broadcast while chunk k+1 is
	// staged).
	Buffers int
	// CopyWorkers is the number of goroutines per host copy (default
	// GOMAXPROCS, at most 16; on the 16-core H200 host 16 and 14 measured
	// alike, 12 less).
	CopyWorkers int
	// SplitBytes bounds one host-copy job: tensors are cut at element
	// boundaries into parts of at most min(SplitBytes, WindowBytes) bytes
	// (default 1 MiB: four workers fill a default window together, so a
	// window is ready sooner after its slot is taken).
	SplitBytes int64
	// WindowBytes is the granularity of the host-to-device copies inside a
	// chunk (default 4 MiB): the host copy fills pinned slots of this size
	// and each is copied to the device as soon as it is filled (in
	// ModeRegister, direct copies are issued in windows of this size as
	// their segments are registered). Negative: one copy per chunk.
	WindowBytes int64
	// PinnedBytes is the pinned host memory of the host copy (default 64
	// MiB): a ring of max(PinnedBytes / WindowBytes, 2) slots of
	// WindowBytes (of the largest chunk for whole-chunk windows), each
	// reused once its host-to-device copy completed. Slots small enough to
	// still be in the CPU's cache when the copy engine reads them are what
	// makes the host copy fast: the bytes cross DRAM once, not three times.
	PinnedBytes int64
	// HostAllocFlags for cudaHostAlloc (default nccl.HostAllocPortable;
	// adding nccl.HostAllocWriteCombined is a candidate of the sweep).
	HostAllocFlags uint
	// RegisterSegmentBytes (ModeRegister) is the unit of cudaHostRegister,
	// rounded up to the page size (default 64 MiB).
	RegisterSegmentBytes int64
	// RegisterWorkers (ModeRegister) is the number of threads registering
	// segments ahead of the copies (default 4).
	RegisterWorkers int
	// PrefaultWorkers > 0 populates the mapping's page tables ahead of use
	// with madvise(MADV_POPULATE_READ): in ModeCopy that many goroutines run
	// ahead of the copy workers, in ModeRegister every registration worker
	// populates its segment before registering it. Default 0, negative:
	// none.
	PrefaultWorkers int
	// CopyFraction (ModeRegister) sends the last fraction of every
	// unconverted chunk through the host copy while the rest goes straight
	// from the registered checkpoint, so that both feed the copy engine
	// (default 0: everything direct).
	CopyFraction float64
	// Unregister (ModeRegister) says when segments are unpinned (default
	// UnregisterEarly).
	Unregister UnregisterPolicy
	// DeviceMargin is device memory left free besides the buffers (default
	// 256 MiB): CUDA and NCCL allocate lazily too.
	DeviceMargin int64
	// CleanupTimeout bounds the wait for in-flight copies before buffers
	// are freed after a failure (default 30s).
	CleanupTimeout time.Duration
	// Progress, if set, is called on Broadcast's goroutine each time a
	// broadcast is known to have completed, with the bytes of this run's
	// chunks completed so far: what a caller heartbeats while a long
	// transfer runs. It must not block.
	Progress func(sent int64)
}

func (o Options) withDefaults() Options {
	d := DefaultOptions
	if o.Mode == 0 {
		o.Mode = d.Mode
	}
	if o.Buffers <= 0 {
		o.Buffers = max(d.Buffers, 1)
	}
	if o.CopyWorkers <= 0 {
		o.CopyWorkers = d.CopyWorkers
	}
	if o.CopyWorkers <= 0 {
		o.CopyWorkers = min(runtime.GOMAXPROCS(0), 16)
	}
	if o.SplitBytes <= 0 {
		o.SplitBytes = max(d.SplitBytes, 1)
	}
	if o.WindowBytes == 0 {
		o.WindowBytes = d.WindowBytes
	}
	if o.PinnedBytes <= 0 {
		o.PinnedBytes = max(d.PinnedBytes, 1)
	}
	if o.HostAllocFlags == 0 {
		o.HostAllocFlags = d.HostAllocFlags
	}
	if o.RegisterSegmentBytes <= 0 {
		o.RegisterSegmentBytes = max(d.RegisterSegmentBytes, 1)
	}
	pg := int64(os.Getpagesize())
	o.RegisterSegmentBytes = (o.RegisterSegmentBytes + pg - 1) / pg * pg
	if o.RegisterWorkers <= 0 {
		o.RegisterWorkers = max(d.RegisterWorkers, 1)
	}
	if o.PrefaultWorkers == 0 {
		o.PrefaultWorkers = d.PrefaultWorkers
	}
	if o.Unregister == 0 {
		o.Unregister = d.Unregister
	}
	if o.CopyFraction == 0 {
		o.CopyFraction = d.CopyFraction
	}
	if o.Unregister == 0 {
		o.Unregister = UnregisterAtEnd
	}
	if o.DeviceMargin <= 0 {
		o.DeviceMargin = d.DeviceMargin
	}
	if o.CleanupTimeout <= 0 {
		o.CleanupTimeout = d.CleanupTimeout
	}
	return o
}

// Result describes one run.
type Result struct {
	Mode    Mode
	Bytes   int64 // bytes on the wire (or staged)
	Tensors int
	Chunks  int // broadcasts (or staged chunks)
	Buffers int
	// BufferBytes is the size of each device buffer.
	BufferBytes int64
	// Slots and SlotBytes describe the host copy's pinned ring.
	Slots     int
	SlotBytes int64
	// Windows is the number of host-to-device copy windows (see
	// Options.WindowBytes).
	Windows int
	// Wall is the run from the first host copy (or registration) to the
	// completion of the last broadcast (or host-to-device copy) and, in
	// ModeRegister, the unregistration of the checkpoint; buffer allocation
	// excluded.
	Wall time.Duration
	// Copied is the bytes that went through the host copy into pinned
	// buffers; Direct the bytes copied to the device straight from the
	// registered checkpoint (ModeRegister). Copied + Direct = Bytes.
	Copied, Direct int64
	// HostCopy is the wall time spent copying (and converting) from the
	// checkpoint into pinned buffers, summed over chunks.
	HostCopy time.Duration
	// HostWait is the time the host waited for a device buffer or a
	// pinned slot to come free (slot waits summed over windows).
	HostWait time.Duration
	// H2D and Broadcast are GPU times (CUDA events) summed over chunks:
	// host-to-device copies (estimated per chunk from one window in
	// timeEvery, scaled to the chunk's bytes), and broadcasts from the
	// moment their copy was done.
	H2D, Broadcast time.Duration
	// Registered is the bytes page-locked in place in Segments
	// cudaHostRegister calls taking Register in all (summed over the
	// RegisterWorkers threads, which run in parallel with each other and
	// with the copies). Unregister is the time of all cudaHostUnregister
	// calls (summed); UnregisterTail the wall time of the unregistration
	// left after the last copy, which Wall includes.
	Registered      int64
	Segments        int
	RegisterWorkers int
	Register        time.Duration
	Unregister      time.Duration
	UnregisterTail  time.Duration
	// EarlyUnregistered is the segments unregistered before the last copy
	// completed (UnregisterEarly).
	EarlyUnregistered int
	// Prefault is the time spent in madvise(MADV_POPULATE_READ), summed
	// over the goroutines doing it.
	Prefault time.Duration
	// Fallback says why bytes that ModeRegister would have sent directly
	// went through the host copy ("" when none did).
	Fallback string
}

func gbps(b int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(b) / d.Seconds() / 1e9
}

// Throughput is Bytes over Wall, in bytes per second.
func (r Result) Throughput() float64 {
	if r.Wall <= 0 {
		return 0
	}
	return float64(r.Bytes) / r.Wall.Seconds()
}

// Overlap says how much of the host-side work (host copy, or registration
// when nothing was copied) ran concurrently with the host-to-device copies:
// (host + H2D - Wall) / min(host, H2D), clamped to [0, 1]. 1 means the
// shorter of the two was entirely hidden, 0 that they ran one after the
// other.
func (r Result) Overlap() float64 {
	host := r.HostCopy
	if r.Copied == 0 {
		host = r.Register / time.Duration(max(r.RegisterWorkers, 1))
	}
	m := min(host, r.H2D)
	if m <= 0 {
		return 0
	}
	return max(0, min(1, float64(host+r.H2D-r.Wall)/float64(m)))
}

func (r Result) String() string {
	s := fmt.Sprintf("%s: %d bytes, %d tensors, %d chunks, %d windows, %d x %d-byte device buffers, %d x %d-byte pinned slots: wall %v (%.2f GB/s), host copy %d bytes in %v (%.2f GB/s), host wait %v, H2D %v (%.2f GB/s), overlap %.2f",
		r.Mode, r.Bytes, r.Tensors, r.Chunks, r.Windows, r.Buffers, r.BufferBytes, r.Slots, r.SlotBytes, r.Wall, gbps(r.Bytes, r.Wall),
		r.Copied, r.HostCopy, gbps(r.Copied, r.HostCopy), r.HostWait, r.H2D, gbps(r.Bytes, r.H2D), r.Overlap())
	if r.Mode == ModeRegister {
		s += fmt.Sprintf(", direct %d bytes, registered %d bytes in %d segments: register %v summed over %d workers (%.2f GB/s per worker), unregister %v (%d segments early, tail %v)",
			r.Direct, r.Registered, r.Segments, r.Register, r.RegisterWorkers, gbps(r.Registered, r.Register), r.Unregister, r.EarlyUnregistered, r.UnregisterTail)
	}
	if r.Prefault > 0 {
		s += fmt.Sprintf(", prefault %v", r.Prefault)
	}
	if r.Fallback != "" {
		s += ", fallback: " + r.Fallback
	}
	if r.Broadcast > 0 {
		s += fmt.Sprintf(", broadcast %v (%.2f GB/s)", r.Broadcast, gbps(r.Bytes, r.Broadcast))
	}
	return s
}

// Pipeline owns a ring of pinned host slots, N device buffers, a copy stream and
// the events that order them, all on one device (and, in ModeRegister, the
// registration workers' threads). It runs one transfer at a time (not safe
// for concurrent runs) and can be reused across updates and across
// communicators of the same device.
type Pipeline struct {
	dev   *nccl.Device // the actor that allocated, and frees, the resources
	opts  Options
	size  int64
	ring  *hostRing
	devb  []nccl.DevPtr
	copyS nccl.Stream
	// Per slot: the end of the chunk's host-to-device copies, the
	// broadcast's start and end. All timing-capable: they order and they
	// measure.
	h2dDone, bStart, bDone []nccl.Event
	// Per slot: the start and end of each timed host-to-device copy window
	// (one in timeEvery, see h2d; created as first needed), and for the
	// slot's current chunk the windows issued, the windows timed, and the
	// bytes of the timed ones.
	wStart, wDone [][]nccl.Event
	used, timed   []int
	timedBytes    []int64
	// helpers are ModeRegister's registration threads: cudaHostRegister
	// takes milliseconds per segment and must not hold up the actor that
	// issues the copies.
	helpers []*nccl.Device
	broken  error // set when in-flight work could not be drained
}

// New allocates a pipeline whose buffers carry chunks of up to bufferBytes
// on dev's device, after checking the device has the memory (a clear error
// instead of a failed cudaMalloc halfway).
func New(ctx context.Context, dev *nccl.Device, bufferBytes int64, opts Options) (*Pipeline, error) {
	opts = opts.withDefaults()
	if bufferBytes <= 0 {
		bufferBytes = 1
	}
	p := &Pipeline{dev: dev, opts: opts, size: bufferBytes}
	n := opts.Buffers
	var lib nccl.API
	err := dev.Do(ctx, func(api nccl.API) error {
		lib = api
		free, total, err := api.MemGetInfo()
		if err != nil {
			return err
		}
		need := int64(n)*bufferBytes + opts.DeviceMargin
		if uint64(need) > free {
			return fmt.Errorf("staging: %d device buffers of %d bytes (plus a %d-byte margin) need %d bytes, but device %d has %d free of %d: use fewer buffers or, packed, a smaller packed_buffer_size_bytes",
				n, bufferBytes, opts.DeviceMargin, need, dev.Ordinal(), free, total)
		}
		for i := 0; i < n; i++ {
			d, err := api.Malloc(int(bufferBytes))
			if err != nil {
				return fmt.Errorf("staging: device buffer %d of %d: %w", i+1, n, err)
			}
			p.devb = append(p.devb, d)
		}
		// The ring exists in ModeRegister too: converted chunks and
		// fallbacks go through it.
		slotBytes, slots := ringGeometry(opts.WindowBytes, bufferBytes, opts.PinnedBytes)
		if p.ring, err = newHostRing(api, slotBytes, slots, opts.HostAllocFlags); err != nil {
			return err
		}
		if p.copyS, err = api.StreamCreate(nccl.StreamNonBlocking); err != nil {
			return err
		}
		for _, evs := range []*[]nccl.Event{&p.h2dDone, &p.bStart, &p.bDone} {
			for i := 0; i < n; i++ {
				e, err := api.EventCreate(nccl.EventDefault)
				if err != nil {
					return err
				}
				*evs = append(*evs, e)
			}
		}
		p.wStart, p.wDone = make([][]nccl.Event, n), make([][]nccl.Event, n)
		p.used, p.timed, p.timedBytes = make([]int, n), make([]int, n), make([]int64, n)
		// The window events a chunk of bufferBytes needs, created now
		// rather than during the first transfer (h2d still adds more if a
		// layout needs them): a few microseconds each.
		perSlot := int(min((bufferBytes+slotBytes-1)/slotBytes/timeEvery+2, 4096))
		for i := 0; i < n; i++ {
			for j := 0; j < perSlot; j++ {
				for _, evs := range []*[]nccl.Event{&p.wStart[i], &p.wDone[i]} {
					e, err := api.EventCreate(nccl.EventDefault)
					if err != nil {
						return err
					}
					*evs = append(*evs, e)
				}
			}
		}
		return nil
	})
	if err == nil && opts.Mode == ModeRegister {
		threads := opts.RegisterWorkers
		if opts.Unregister == UnregisterEarly {
			threads++ // the last one unregisters
		}
		for i := 0; i < threads; i++ {
			h, herr := nccl.OpenDevice(lib, dev.Ordinal())
			if herr != nil {
				err = fmt.Errorf("staging: registration thread %d of %d: %w", i+1, threads, herr)
				break
			}
			p.helpers = append(p.helpers, h)
		}
	}
	if err != nil {
		p.release(context.Background())
		return nil, err
	}
	return p, nil
}

// BufferBytes is the capacity of each buffer.
func (p *Pipeline) BufferBytes() int64 { return p.size }

// Options are the pipeline's options with the defaults filled in.
func (p *Pipeline) Options() Options { return p.opts }

// Err is non-nil once a failure left copies that could not be drained: the
// pipeline then refuses every run and should be closed and replaced. Call it
// between runs, not during one.
func (p *Pipeline) Err() error {
	if p.broken != nil {
		return fmt.Errorf("staging: pipeline unusable: %w", p.broken)
	}
	return nil
}

// Close frees every resource. After a failure whose copies could not be
// drained it frees only what cannot be in use (the device memory is then
// leaked on purpose: cudaFree would wait on the stuck work).
func (p *Pipeline) Close(ctx context.Context) error {
	return p.release(ctx)
}

func (p *Pipeline) release(ctx context.Context) error {
	for _, h := range p.helpers {
		h.Close()
	}
	p.helpers = nil
	return p.dev.Do(ctx, func(api nccl.API) error {
		var first error
		keep := func(err error) {
			if err != nil && first == nil {
				first = err
			}
		}
		if p.broken == nil {
			for _, d := range p.devb {
				keep(api.Free(d))
			}
			if p.ring != nil {
				keep(p.ring.release(api))
			}
			if p.copyS != 0 {
				keep(api.StreamDestroy(p.copyS))
			}
		}
		all := [][]nccl.Event{p.h2dDone, p.bStart, p.bDone}
		all = append(all, p.wStart...)
		all = append(all, p.wDone...)
		for _, evs := range all {
			for _, e := range evs {
				keep(api.EventDestroy(e))
			}
		}
		p.devb, p.ring, p.copyS = nil, nil, 0
		p.h2dDone, p.bStart, p.bDone, p.wStart, p.wDone = nil, nil, nil, nil, nil
		if p.broken != nil {
			return fmt.Errorf("staging: buffers left allocated after %v", p.broken)
		}
		return first
	})
}

// Broadcast sends the chunks in order over comm (rank 0, root 0): host
// copy of chunk k+1 while chunk k is on the wire. comm must live on the
// pipeline's device. Any failure aborts comm (the receivers could not get
// the rest of the sequence anyway) and the pipeline stays usable.
func (p *Pipeline) Broadcast(ctx context.Context, comm *nccl.Comm, src Source, chunks []Chunk) (Result, error) {
	if comm.Device().Ordinal() != p.dev.Ordinal() {
		return Result{}, fmt.Errorf("staging: communicator on device %d, pipeline on device %d", comm.Device().Ordinal(), p.dev.Ordinal())
	}
	if comm.Rank() != 0 {
		return Result{}, fmt.Errorf("staging: only the root (rank 0) sends, this communicator is rank %d", comm.Rank())
	}
	res, err := p.run(ctx, comm.Device(), comm, src, chunks)
	if err != nil {
		comm.Abort(err)
	}
	return res, err
}

// Stage copies the chunks from src to the device buffers and nothing else:
// the checkpoint -> device throughput, without NCCL.
func (p *Pipeline) Stage(ctx context.Context, src Source, chunks []Chunk) (Result, error) {
	return p.run(ctx, p.dev, nil, src, chunks)
}

// timeEvery: h2d times one window of a chunk in timeEvery (and every
// window nobody else records an event after). Events between copies cost
// the copy engine: on the H200 hosts, two timing events around every 2 MiB
// window took the host copy path from 84% to 79% of the pinned ceiling.
const timeEvery = 16

// h2d enqueues one window of host-to-device copies into slot's device
// buffer on the copy stream. If after is not 0 it is recorded after the
// copies; if need is set and after is 0, the window is timed (an event
// before and after the copies) and the second event is returned. One window
// in timeEvery is timed anyway. The returned event is 0 when none follows
// the copies.
func (p *Pipeline) h2d(ctx context.Context, dev *nccl.Device, slot int, xs []xfer, after nccl.Event, need bool) (nccl.Event, error) {
	done := after
	err := dev.Do(ctx, func(api nccl.API) error {
		timed := (need && after == 0) || p.used[slot]%timeEvery == 0
		t := p.timed[slot]
		if timed {
			if t == len(p.wStart[slot]) {
				for _, evs := range []*[]nccl.Event{&p.wStart[slot], &p.wDone[slot]} {
					e, err := api.EventCreate(nccl.EventDefault)
					if err != nil {
						return err
					}
					*evs = append(*evs, e)
				}
			}
			if err := api.EventRecord(p.wStart[slot][t], p.copyS); err != nil {
				return err
			}
		}
		var n int64
		for _, x := range xs {
			if err := api.MemcpyHtoDAsync(p.devb[slot]+nccl.DevPtr(x.dst), x.src, p.copyS); err != nil {
				return fmt.Errorf("%d bytes at chunk offset %d: %w", len(x.src), x.dst, err)
			}
			n += int64(len(x.src))
		}
		if timed {
			if err := api.EventRecord(p.wDone[slot][t], p.copyS); err != nil {
				return err
			}
			p.timed[slot]++
			p.timedBytes[slot] += n
			if done == 0 {
				done = p.wDone[slot][t]
			}
		}
		if after != 0 {
			if err := api.EventRecord(after, p.copyS); err != nil {
				return err
			}
		}
		p.used[slot]++
		return nil
	})
	return done, err
}

// h2dTime estimates the GPU time of the host-to-device copies of slot's
// last chunk, of chunkBytes bytes (every one of them went through h2d),
// from its timed windows (all complete: the caller waited for the slot's
// h2dDone).
func (p *Pipeline) h2dTime(ctx context.Context, dev *nccl.Device, slot int, chunkBytes int64) time.Duration {
	var sum time.Duration
	_ = dev.Do(ctx, func(api nccl.API) error {
		for w := 0; w < p.timed[slot]; w++ {
			if d, err := api.EventElapsedTime(p.wStart[slot][w], p.wDone[slot][w]); err == nil {
				sum += d
			}
		}
		return nil
	})
	if p.timedBytes[slot] <= 0 {
		return sum
	}
	return time.Duration(float64(sum) * float64(chunkBytes) / float64(p.timedBytes[slot]))
}

// copyOut is what one host-copy range adds to the Result.
type copyOut struct {
	windows  int
	copied   int64
	hostCopy time.Duration
	slotWait time.Duration
	err      error
}

// copyRange stages bytes [from, to) of chunk c through the pinned ring into
// slot's device buffer, each window copied to the device as soon as its
// ring slot is filled.
func (p *Pipeline) copyRange(ctx context.Context, dev *nccl.Device, query eventDone, cp *hostCopier, c Chunk, slot int, from, to int64) (out copyOut) {
	t := time.Now()
	// A named result: the deferred assignment must reach the caller.
	defer func() { out.hostCopy = time.Since(t) }()
	parts, wins, err := cp.parts(c, from, to)
	if err != nil {
		out.err = err
		return out
	}
	out.slotWait, out.err = cp.fill(ctx, parts, wins, p.ring, func(ws, slots []int) (reaped int, err error) {
		// One trip to the actor for the lot: the copies, then the reap.
		err = dev.Do(ctx, func(nccl.API) error {
			for i, w := range ws {
				s := slots[i]
				x := xfer{dst: wins[w].off, src: p.ring.slot(s)[:wins[w].end-wins[w].off]}
				if _, err := p.h2d(ctx, dev, slot, []xfer{x}, p.ring.ev[s], false); err != nil {
					return fmt.Errorf("host-to-device copy: %w", err)
				}
				p.ring.enqueued(s)
				out.windows++
			}
			var err error
			reaped, err = p.ring.reap(ctx, query)
			return err
		})
		return reaped, err
	})
	out.copied = to - from
	return out
}

// splitPoint is where ModeRegister's direct part of an unconverted chunk
// ends: the last CopyFraction of it goes through the host copy at the same
// time, so that the copy workers and the registration feed the copy engine
// together.
func (p *Pipeline) splitPoint(c Chunk) int64 {
	if p.opts.CopyFraction <= 0 {
		return c.Bytes
	}
	return c.Bytes - int64(float64(c.Bytes)*min(p.opts.CopyFraction, 1))
}

// stageChunk issues chunk c's host-to-device copies into slot: straight
// from registered segments where it can (reg != nil), through the pinned
// buffer for the rest (the CopyFraction tail concurrently, a failed
// registration's remainder after). It returns once every copy is enqueued.
func (p *Pipeline) stageChunk(ctx context.Context, dev *nccl.Device, query eventDone, cp *hostCopier, reg *registrar, c Chunk, slot int, res *Result) error {
	merge := func(o copyOut) error {
		res.Windows += o.windows
		res.Copied += o.copied
		res.HostCopy += o.hostCopy
		res.HostWait += o.slotWait
		return o.err
	}
	if reg == nil || hasConversion(c) || !reg.usable() {
		return merge(p.copyRange(ctx, dev, query, cp, c, slot, 0, c.Bytes))
	}
	split := p.splitPoint(c)
	var tail chan copyOut
	if split < c.Bytes {
		tail = make(chan copyOut, 1)
		go func() { tail <- p.copyRange(ctx, dev, query, cp, c, slot, split, c.Bytes) }()
	}
	from, err := p.directRange(ctx, dev, reg, c, slot, split, res)
	if err == nil && from < split {
		err = merge(p.copyRange(ctx, dev, query, cp, c, slot, from, split))
	}
	if tail != nil {
		// Always joined: the tail uses the pinned ring and the actor.
		if terr := merge(<-tail); err == nil {
			err = terr
		}
	}
	return err
}

// directRange issues bytes [0, split) of chunk c straight from the
// registered checkpoint, in windows, each once its segments are
// registered, so the copy engine follows the registration closely. It
// returns how far it got: short of split when a registration failed (the
// caller copies the rest; Result.Fallback says why).
func (p *Pipeline) directRange(ctx context.Context, dev *nccl.Device, reg *registrar, c Chunk, slot int, split int64, res *Result) (int64, error) {
	xs, err := reg.segs.plan(c, split)
	if err != nil {
		return 0, err
	}
	if len(xs) == 0 {
		return split, nil // only empty tensors
	}
	from := int64(0)
	for i := 0; i < len(xs); {
		j, n := i, int64(0)
		for j < len(xs) && (n == 0 || p.opts.WindowBytes <= 0 || n < p.opts.WindowBytes) {
			n += int64(len(xs[j].src))
			j++
		}
		for _, x := range xs[i:j] {
			if err := reg.wait(ctx, x.seg); err != nil {
				if ctx.Err() != nil {
					return from, ctx.Err()
				}
				// Registration failed: the rest of the chunk (and every
				// later one) goes through the host copy.
				if res.Fallback == "" {
					res.Fallback = err.Error()
				}
				return from, nil
			}
		}
		done, err := p.h2d(ctx, dev, slot, xs[i:j], 0, true)
		if err != nil {
			return from, fmt.Errorf("host-to-device copy from the registered checkpoint: %w", err)
		}
		for _, x := range xs[i:j] {
			reg.issued(x.seg, int64(len(x.src)), done)
		}
		res.Windows++
		res.Direct += n
		from = xs[j-1].dst + int64(len(xs[j-1].src))
		i = j
	}
	return split, nil
}

func (p *Pipeline) run(ctx context.Context, dev *nccl.Device, comm *nccl.Comm, src Source, chunks []Chunk) (res Result, err error) {
	if p.broken != nil {
		return res, fmt.Errorf("staging: pipeline unusable: %w", p.broken)
	}
	if err := check(chunks); err != nil {
		return res, err
	}
	if m := MaxChunk(chunks); m > p.size {
		return res, fmt.Errorf("staging: largest chunk is %d bytes, buffers hold %d: a broadcast cannot be split (the receiver takes each in one call)", m, p.size)
	}
	n := len(p.devb)
	res.Mode, res.Buffers, res.BufferBytes, res.Chunks = p.opts.Mode, n, p.size, len(chunks)
	res.Slots, res.SlotBytes = p.ring.slots(), p.ring.slotBytes
	for _, c := range chunks {
		res.Bytes += c.Bytes
		res.Tensors += len(c.Pieces)
	}
	partBytes := min(p.opts.SplitBytes, p.ring.slotBytes)
	cp := &hostCopier{src: src, workers: p.opts.CopyWorkers, partBytes: partBytes, window: p.ring.slotBytes}
	// Every slot is free: the previous run waited for its copies, or was
	// drained (else the pipeline is broken and refused above).
	p.ring.reset()
	query := func(ctx context.Context, e nccl.Event) (bool, error) {
		if comm != nil {
			return comm.EventDone(ctx, e)
		}
		var done bool
		err := dev.Do(ctx, func(api nccl.API) error {
			var err error
			done, err = api.EventQuery(e)
			return err
		})
		return done, err
	}

	wait := func(e nccl.Event) error {
		t := time.Now()
		defer func() { res.HostWait += time.Since(t) }()
		if comm != nil {
			return comm.WaitEvent(ctx, e)
		}
		return dev.WaitEvent(ctx, e)
	}

	start := time.Now()
	// Registration and prefaulting run beside the copies; finish stops
	// them and, once no copy can read the checkpoint any more, unregisters
	// it (on failure only after drain emptied the copy stream).
	var reg *registrar
	var pf *prefaulter
	ms, mapped := src.(MappedSource)
	if p.opts.Mode == ModeRegister {
		if !mapped {
			res.Fallback = fmt.Sprintf("the source (%T) is not a mapped checkpoint", src)
		} else if segs, serr := newSegments(ms, p.opts.RegisterSegmentBytes, chunks, p.splitPoint); serr != nil {
			res.Fallback = serr.Error()
		} else {
			helpers, unreg := p.helpers, (*nccl.Device)(nil)
			if p.opts.Unregister == UnregisterEarly {
				helpers, unreg = p.helpers[:len(p.helpers)-1], p.helpers[len(p.helpers)-1]
			}
			reg = newRegistrar(segs, helpers, unreg, p.opts.PrefaultWorkers > 0)
			reg.start(ctx)
		}
	} else if p.opts.PrefaultWorkers > 0 && mapped {
		if segs, serr := newSegments(ms, p.opts.RegisterSegmentBytes, chunks, nil); serr == nil {
			pf = startPrefault(segs.list, p.opts.PrefaultWorkers)
		}
	}
	finished := false
	finish := func() error {
		if finished {
			return nil
		}
		finished = true
		if pf != nil {
			res.Prefault += pf.stop()
		}
		if reg == nil {
			return nil
		}
		reg.stop()
		res.Register, res.Registered, res.Segments, res.Prefault = reg.register, reg.registered, reg.count, res.Prefault+reg.prefaulted
		res.RegisterWorkers = len(reg.helpers)
		if p.broken != nil {
			// DMA may still read the pages: leave them locked, like the
			// device memory.
			reg.abandon()
			return fmt.Errorf("staging: checkpoint left registered: %w", p.broken)
		}
		res.EarlyUnregistered = reg.unregistered()
		t := time.Now()
		uerr := reg.unregister()
		res.UnregisterTail = time.Since(t)
		res.Unregister = reg.unregT
		return uerr
	}
	defer func() {
		if err != nil {
			p.drain(dev, comm, err)
			if ferr := finish(); ferr != nil {
				err = errors.Join(err, ferr)
			}
		}
	}()
	var sent int64
	progress := func(k int) {
		sent += chunks[k].Bytes
		if p.opts.Progress != nil {
			p.opts.Progress(sent)
		}
	}

	for k, c := range chunks {
		slot := k % n
		fail := func(what string, err error) error {
			return fmt.Errorf("staging: chunk %d of %d (%d bytes%s): %s: %w", k+1, len(chunks), c.Bytes, firstName(c), what, err)
		}
		if k >= n {
			// Chunk k-n's copies are done before their window events are
			// read and recorded again (long done: the ring holds far less
			// than a chunk).
			if err := wait(p.h2dDone[slot]); err != nil {
				return res, fail("waiting for the host-to-device copy of chunk "+fmt.Sprint(k-n+1), err)
			}
			res.H2D += p.h2dTime(ctx, dev, slot, chunks[k-n].Bytes)
			if comm != nil {
				// The device buffer is free once chunk k-n was broadcast;
				// the GPU waits, the host goes on.
				if err := dev.Do(ctx, func(api nccl.API) error { return api.StreamWaitEvent(p.copyS, p.bDone[slot]) }); err != nil {
					return res, fail("ordering after the broadcast of chunk "+fmt.Sprint(k-n+1), err)
				}
			}
		}
		p.used[slot], p.timed[slot], p.timedBytes[slot] = 0, 0, 0
		if err := p.stageChunk(ctx, dev, query, cp, reg, c, slot, &res); err != nil {
			return res, fail("staging", err)
		}
		if err := dev.Do(ctx, func(api nccl.API) error { return api.EventRecord(p.h2dDone[slot], p.copyS) }); err != nil {
			return res, fail("host-to-device copy", err)
		}
		if comm == nil {
			continue
		}
		if k >= n {
			// bStart/bDone of this slot are about to be recorded again:
			// chunk k-n's broadcast must be over (it is also where a
			// receiver that died shows up, as an NCCL error or the deadline).
			if err := wait(p.bDone[slot]); err != nil {
				return res, fail("waiting for the broadcast of chunk "+fmt.Sprint(k-n+1), err)
			}
			res.Broadcast += p.elapsed(ctx, dev, p.bStart[slot], p.bDone[slot])
			progress(k - n)
		}
		o := nccl.Order{After: p.h2dDone[slot], Start: p.bStart[slot], Done: p.bDone[slot]}
		if err := comm.BroadcastAsync(ctx, p.devb[slot], c.Count, c.DType, o); err != nil {
			return res, fail("broadcast", err)
		}
	}
	// The last min(n, len) chunks are still in flight.
	for k := max(len(chunks)-n, 0); k < len(chunks); k++ {
		slot := k % n
		if err := wait(p.h2dDone[slot]); err != nil {
			return res, fmt.Errorf("staging: chunk %d of %d: host-to-device copy: %w", k+1, len(chunks), err)
		}
		res.H2D += p.h2dTime(ctx, dev, slot, chunks[k].Bytes)
		if comm != nil {
			if err := wait(p.bDone[slot]); err != nil {
				return res, fmt.Errorf("staging: chunk %d of %d: broadcast: %w", k+1, len(chunks), err)
			}
			res.Broadcast += p.elapsed(ctx, dev, p.bStart[slot], p.bDone[slot])
			progress(k)
		}
	}
	if err := finish(); err != nil {
		return res, err
	}
	res.Wall = time.Since(start)
	return res, nil
}

func (p *Pipeline) elapsed(ctx context.Context, dev *nccl.Device, a, b nccl.Event) time.Duration {
	var d time.Duration
	_ = dev.Do(ctx, func(api nccl.API) error {
		var err error
		d, err = api.EventElapsedTime(a, b)
		return err
	})
	return d
}

// drain waits (bounded) for the copy stream after a failure, so that the
// buffers can be reused or freed. In broadcast mode the communicator is
// aborted first: its kernels exit, which releases copies waiting on them.
func (p *Pipeline) drain(dev *nccl.Device, comm *nccl.Comm, cause error) {
	if comm != nil {
		comm.Abort(cause)
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.opts.CleanupTimeout)
	defer cancel()
	if err := dev.WaitStream(ctx, p.copyS); err != nil {
		p.broken = errors.Join(fmt.Errorf("copy stream did not drain: %w", err), cause)
	}
}

func firstName(c Chunk) string {
	switch len(c.Pieces) {
	case 0:
		return ""
	case 1:
		return fmt.Sprintf(", tensor %q", c.Pieces[0].Src.Name)
	}
	return fmt.Sprintf(", tensors %q..%q", c.Pieces[0].Src.Name, c.Pieces[len(c.Pieces)-1].Src.Name)
}
