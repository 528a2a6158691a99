package staging

import (
	"context"
	"fmt"

	"github.com/rlflow/rlflow/nccl"
)

// Stager owns a ring of pinned host slots, N device buffers, a copy stream and
// the events that order them, all on one device. It runs one transfer at a
// time (not safe for concurrent runs) and can be reused across updates and
// across communicators of the same device.
type Stager struct {
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
	broken        error // set when in-flight work could not be drained
}

// NewStager allocates a stager whose buffers carry chunks of up to bufferBytes
// on dev's device, after checking the device has the memory (a clear error
// instead of a failed cudaMalloc halfway).
func NewStager(ctx context.Context, dev *nccl.Device, bufferBytes int64, opts Options) (*Stager, error) {
	opts = opts.withDefaults()
	if bufferBytes <= 0 {
		bufferBytes = 1
	}
	p := &Stager{dev: dev, opts: opts, size: bufferBytes}
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
		}
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
	if err != nil {
		p.release(context.Background())
		return nil, err
	}
	return p, nil
}

// BufferBytes is the capacity of each buffer.
func (p *Stager) BufferBytes() int64 { return p.size }

// Options are the pipeline's options with the defaults filled in.
func (p *Stager) Options() Options { return p.opts }

// Err is non-nil once a failure left copies that could not be drained: the
// pipeline then refuses every run and should be closed and replaced. Call it
// between runs, not during one.
func (p *Stager) Err() error {
	if p.broken != nil {
		return fmt.Errorf("staging: pipeline unusable: %w", p.broken)
	}
	return nil
}

// Close frees every resource. After a failure whose copies could not be
// drained it frees only what cannot be in use (the device memory is then
// leaked on purpose: cudaFree would wait on the stuck work).
func (p *Stager) Close(ctx context.Context) error {
	return p.release(ctx)
}

func (p *Stager) release(ctx context.Context) error {
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
