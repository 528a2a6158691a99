package staging

import (
	"context"
	"fmt"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// xfer is one host-to-device copy: src into the chunk at dst.
type xfer struct {
	dst int64
	src []byte
}

// timeEvery: h2d times one window of a chunk in timeEvery. Events between
// copies cost the copy engine: timing every window measurably slowed the
// host copy path (nccl/GPU-RESULTS.md, fourth session).
const timeEvery = 16

// h2d enqueues one window of host-to-device copies into slot's device
// buffer on the copy stream, with after recorded behind them if it is not
// 0. One window in timeEvery is timed (an event before and after the
// copies).
func (p *Stager) h2d(ctx context.Context, dev *nccl.Device, slot int, xs []xfer, after nccl.Event) error {
	return dev.Do(ctx, func(api nccl.API) error {
		timed := p.used[slot]%timeEvery == 0
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
		}
		if after != 0 {
			if err := api.EventRecord(after, p.copyS); err != nil {
				return err
			}
		}
		p.used[slot]++
		return nil
	})
}

// h2dTime estimates the GPU time of the host-to-device copies of slot's
// last chunk, of chunkBytes bytes (every one of them went through h2d),
// from its timed windows (all complete: the caller waited for the slot's
// h2dDone).
func (p *Stager) h2dTime(ctx context.Context, dev *nccl.Device, slot int, chunkBytes int64) time.Duration {
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
func (p *Stager) copyRange(ctx context.Context, dev *nccl.Device, query eventDone, cp *hostCopier, c Chunk, slot int, from, to int64) (out copyOut) {
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
				if err := p.h2d(ctx, dev, slot, []xfer{x}, p.ring.ev[s]); err != nil {
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

// stageChunk issues chunk c's host-to-device copies into slot, through the
// pinned ring. It returns once every copy is enqueued.
func (p *Stager) stageChunk(ctx context.Context, dev *nccl.Device, query eventDone, cp *hostCopier, c Chunk, slot int, res *Result) error {
	o := p.copyRange(ctx, dev, query, cp, c, slot, 0, c.Bytes)
	res.Windows += o.windows
	res.Copied += o.copied
	res.HostCopy += o.hostCopy
	res.HostWait += o.slotWait
	return o.err
}
