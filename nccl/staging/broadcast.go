package staging

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// Broadcast sends the chunks in order over comm (rank 0, root 0): host
// copy of chunk k+1 while chunk k is on the wire. comm must live on the
// pipeline's device. Any failure aborts comm (the receivers could not get
// the rest of the sequence anyway) and the pipeline stays usable.
func (p *Stager) Broadcast(ctx context.Context, comm *nccl.Comm, src Source, chunks []Chunk) (Result, error) {
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
func (p *Stager) Stage(ctx context.Context, src Source, chunks []Chunk) (Result, error) {
	return p.run(ctx, p.dev, nil, src, chunks)
}

func (p *Stager) run(ctx context.Context, dev *nccl.Device, comm *nccl.Comm, src Source, chunks []Chunk) (res Result, err error) {
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
	res.Buffers, res.BufferBytes, res.Chunks = n, p.size, len(chunks)
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
	// Prefaulting runs beside the copies; finish stops it. It only spares
	// the copy workers page faults, so a source it cannot plan goes without.
	var pf *prefaulter
	if ms, mapped := src.(MappedSource); p.opts.PrefaultWorkers > 0 && mapped {
		if segs, serr := prefaultSegments(ms, prefaultSegmentBytes, chunks); serr == nil {
			pf = startPrefault(segs, p.opts.PrefaultWorkers)
		}
	}
	finished := false
	finish := func() {
		if finished {
			return
		}
		finished = true
		if pf != nil {
			res.Prefault += pf.stop()
		}
	}
	defer func() {
		if err != nil {
			p.drain(dev, comm, err)
			finish()
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
		if err := p.stageChunk(ctx, dev, query, cp, c, slot, &res); err != nil {
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
	finish()
	res.Wall = time.Since(start)
	return res, nil
}

func (p *Stager) elapsed(ctx context.Context, dev *nccl.Device, a, b nccl.Event) time.Duration {
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
func (p *Stager) drain(dev *nccl.Device, comm *nccl.Comm, cause error) {
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
