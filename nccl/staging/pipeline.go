package staging

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// Options tune a Pipeline. Zero values take the defaults.
type Options struct {
	// Buffers is the number of pinned host and device buffers N (default
	// 2: chunk k is broadcast while chunk k+1 is copied; 3 also overlaps
	// the host copy of k+2 with the host-to-device copy of k+1).
	Buffers int
	// CopyWorkers is the number of goroutines per host copy (default
	// GOMAXPROCS, at most 16).
	CopyWorkers int
	// SplitBytes: a tensor larger than this is copied by several workers
	// (default 8 MiB).
	SplitBytes int64
	// HostAllocFlags for cudaHostAlloc (default nccl.HostAllocPortable).
	HostAllocFlags uint
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
	if o.Buffers <= 0 {
		o.Buffers = 2
	}
	if o.CopyWorkers <= 0 {
		o.CopyWorkers = min(runtime.GOMAXPROCS(0), 16)
	}
	if o.SplitBytes <= 0 {
		o.SplitBytes = 8 << 20
	}
	if o.HostAllocFlags == 0 {
		o.HostAllocFlags = nccl.HostAllocPortable
	}
	if o.DeviceMargin <= 0 {
		o.DeviceMargin = 256 << 20
	}
	if o.CleanupTimeout <= 0 {
		o.CleanupTimeout = 30 * time.Second
	}
	return o
}

// Result describes one run.
type Result struct {
	Bytes   int64 // bytes on the wire (or staged)
	Tensors int
	Chunks  int // broadcasts (or staged chunks)
	Buffers int
	// BufferBytes is the size of each pinned and device buffer.
	BufferBytes int64
	// Wall is the run from the first host copy to the completion of the
	// last broadcast (or host-to-device copy); buffer allocation excluded.
	Wall time.Duration
	// HostCopy is the wall time spent copying (and converting) from the
	// checkpoint into pinned buffers, summed over chunks.
	HostCopy time.Duration
	// HostWait is the time the host waited for a buffer to come free.
	HostWait time.Duration
	// H2D and Broadcast are GPU times (CUDA events) summed over chunks:
	// host-to-device copies, and broadcasts from the moment their copy was
	// done.
	H2D, Broadcast time.Duration
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

func (r Result) String() string {
	s := fmt.Sprintf("%d bytes, %d tensors, %d chunks, %d x %d-byte buffers: wall %v (%.2f GB/s), host copy %v (%.2f GB/s), host wait %v, H2D %v (%.2f GB/s)",
		r.Bytes, r.Tensors, r.Chunks, r.Buffers, r.BufferBytes, r.Wall, gbps(r.Bytes, r.Wall),
		r.HostCopy, gbps(r.Bytes, r.HostCopy), r.HostWait, r.H2D, gbps(r.Bytes, r.H2D))
	if r.Broadcast > 0 {
		s += fmt.Sprintf(", broadcast %v (%.2f GB/s)", r.Broadcast, gbps(r.Bytes, r.Broadcast))
	}
	return s
}

// Pipeline owns N pinned host buffers, N device buffers, a copy stream and
// the events that order them, all on one device. It runs one transfer at a
// time (not safe for concurrent runs) and can be reused across updates and
// across communicators of the same device.
type Pipeline struct {
	dev   *nccl.Device // the actor that allocated, and frees, the resources
	opts  Options
	size  int64
	host  [][]byte
	devb  []nccl.DevPtr
	copyS nccl.Stream
	// Per slot: the host-to-device copy's start and end, the broadcast's
	// start and end. All timing-capable: they order and they measure.
	h2dStart, h2dDone, bStart, bDone []nccl.Event
	broken                           error // set when in-flight work could not be drained
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
	err := dev.Do(ctx, func(api nccl.API) error {
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
			h, err := api.HostAlloc(int(bufferBytes), opts.HostAllocFlags)
			if err != nil {
				return fmt.Errorf("staging: pinned host buffer %d of %d (%d bytes; check the memlock limit and free RAM): %w", i+1, n, bufferBytes, err)
			}
			p.host = append(p.host, h)
		}
		if p.copyS, err = api.StreamCreate(nccl.StreamNonBlocking); err != nil {
			return err
		}
		for _, evs := range []*[]nccl.Event{&p.h2dStart, &p.h2dDone, &p.bStart, &p.bDone} {
			for i := 0; i < n; i++ {
				e, err := api.EventCreate(nccl.EventDefault)
				if err != nil {
					return err
				}
				*evs = append(*evs, e)
			}
		}
		return nil
	})
	if err != nil {
		p.release(context.Background())
		return nil, err
	}
	return p, nil
}

// BufferBytes is the capacity of each buffer.
func (p *Pipeline) BufferBytes() int64 { return p.size }

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
			for _, h := range p.host {
				keep(api.FreeHost(h))
			}
			if p.copyS != 0 {
				keep(api.StreamDestroy(p.copyS))
			}
		}
		for _, evs := range [][]nccl.Event{p.h2dStart, p.h2dDone, p.bStart, p.bDone} {
			for _, e := range evs {
				keep(api.EventDestroy(e))
			}
		}
		p.devb, p.host, p.copyS = nil, nil, 0
		p.h2dStart, p.h2dDone, p.bStart, p.bDone = nil, nil, nil, nil
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
	n := len(p.host)
	res.Buffers, res.BufferBytes, res.Chunks = n, p.size, len(chunks)
	for _, c := range chunks {
		res.Bytes += c.Bytes
		res.Tensors += len(c.Pieces)
	}
	cp := &hostCopier{src: src, workers: p.opts.CopyWorkers, minSplit: p.opts.SplitBytes}

	wait := func(e nccl.Event) error {
		t := time.Now()
		defer func() { res.HostWait += time.Since(t) }()
		if comm != nil {
			return comm.WaitEvent(ctx, e)
		}
		return dev.WaitEvent(ctx, e)
	}
	elapsed := func(a, b nccl.Event) time.Duration {
		var d time.Duration
		_ = dev.Do(ctx, func(api nccl.API) error {
			var err error
			d, err = api.EventElapsedTime(a, b)
			return err
		})
		return d
	}
	defer func() {
		if err != nil {
			p.drain(dev, comm, err)
		}
	}()
	var sent int64
	progress := func(k int) {
		sent += chunks[k].Bytes
		if p.opts.Progress != nil {
			p.opts.Progress(sent)
		}
	}

	start := time.Now()
	for k, c := range chunks {
		slot := k % n
		fail := func(what string, err error) error {
			return fmt.Errorf("staging: chunk %d of %d (%d bytes%s): %s: %w", k+1, len(chunks), c.Bytes, firstName(c), what, err)
		}
		if k >= n {
			// The host buffer is free once the copy of chunk k-n left it.
			if err := wait(p.h2dDone[slot]); err != nil {
				return res, fail("waiting for a free pinned buffer", err)
			}
			res.H2D += elapsed(p.h2dStart[slot], p.h2dDone[slot])
		}
		t := time.Now()
		if err := cp.fill(ctx, c, p.host[slot]); err != nil {
			return res, fail("host copy", err)
		}
		res.HostCopy += time.Since(t)
		err := dev.Do(ctx, func(api nccl.API) error {
			if comm != nil && k >= n {
				// The device buffer is free once chunk k-n was broadcast;
				// the GPU waits, the host goes on.
				if err := api.StreamWaitEvent(p.copyS, p.bDone[slot]); err != nil {
					return err
				}
			}
			if err := api.EventRecord(p.h2dStart[slot], p.copyS); err != nil {
				return err
			}
			if err := api.MemcpyHtoDAsync(p.devb[slot], p.host[slot][:c.Bytes], p.copyS); err != nil {
				return err
			}
			return api.EventRecord(p.h2dDone[slot], p.copyS)
		})
		if err != nil {
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
			res.Broadcast += elapsed(p.bStart[slot], p.bDone[slot])
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
		res.H2D += elapsed(p.h2dStart[slot], p.h2dDone[slot])
		if comm != nil {
			if err := wait(p.bDone[slot]); err != nil {
				return res, fmt.Errorf("staging: chunk %d of %d: broadcast: %w", k+1, len(chunks), err)
			}
			res.Broadcast += elapsed(p.bStart[slot], p.bDone[slot])
			progress(k)
		}
	}
	res.Wall = time.Since(start)
	return res, nil
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
