package ncclengine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
)

// errServerFailed marks the communicator aborts caused by a server's
// failure, to tell them from NCCL failing on its own.
var errServerFailed = errors.New("aborted because a server failed")

// sent is what a data plane put on the wire.
type sent struct {
	bytes   int64
	tensors int
}

// dataPlane broadcasts one update's bytes over comm (rank 0, root 0), in
// the order update_info announced them, and returns once the last
// broadcast completed. On failure it aborts comm: the receivers cannot get
// the rest of the sequence anyway. The checkpoint path stages through
// pinned memory (staging.Stager.Broadcast), the snapshot path sends
// straight from the trainer's memory (broadcastSnapshot); everything else
// about an update is runUpdate's.
type dataPlane func(ctx context.Context, comm *nccl.Comm) (sent, error)

// runUpdate is one update of a locked group that ensureGroup initialised
// (fresh: by this attempt): meta's update_info to every server with send's
// broadcasts under the update's deadline (req.Timeout, or scaled with
// total), a poisoned communicator dropped so the next attempt
// re-initialises, and the result.
func (e *Engine) runUpdate(ctx context.Context, g *group, req transfer.UpdateRequest, meta plan.TensorMetadata, pk packing, total int64,
	fresh bool, send dataPlane) (transfer.UpdateResult, error) {
	timeout := req.Timeout
	if timeout <= 0 {
		timeout = vllm.UpdateTimeoutFor(total)
	}
	info := vllm.UpdateInfo{
		Names: meta.Names, DTypeNames: meta.DTypeNames, Shapes: meta.Shapes,
		Packed: pk.packed, PackedBufferSizeBytes: pk.threshold, PackedNumBuffers: pk.buffers,
		CheckpointBytes: total,
	}
	g.setPhase("broadcast")
	start := time.Now()
	s, err := e.update(ctx, g, req.Fleet, info, req.Version, timeout, fresh, req.Progress, total, send)
	if err != nil {
		if g.comm != nil && g.comm.Err() != nil {
			g.dropComm(nil) // the next attempt re-initialises
		}
		return transfer.UpdateResult{}, err
	}
	return transfer.UpdateResult{Bytes: s.bytes, Tensors: s.tensors, Group: g.name(), Initialized: fresh,
		Methods: g.methods, Elapsed: time.Since(start)}, nil
}

// update runs one weight update on a locked, initialised group: every
// server's update session (start, the blocking update_weights, finish),
// concurrently with send's broadcasts, which update_weights waits for.
// Whichever side fails first stops the other: an HTTP failure aborts the
// communicator (NCCL would otherwise wait forever for ranks that are not
// receiving), an NCCL failure cancels the HTTP calls.
//
// fresh says the group was (re)initialised by this attempt: an update
// session a server already has open then belongs to a trainer that is
// gone (a killed GPU worker, a lost group), so it is closed and the start
// retried once instead of failing every attempt on "already open".
func (e *Engine) update(ctx context.Context, g *group, fleet vllm.Fleet, info vllm.UpdateInfo, version string, timeout time.Duration,
	fresh bool, progress *transfer.Progress, total int64, send dataPlane) (sent, error) {
	uctx, cancel := withTimeoutCause(ctx, timeout, fmt.Errorf("the update did not complete within %v (update_timeout)", timeout))
	defer cancel()
	hctx, hcancel := context.WithCancelCause(uctx)
	defer hcancel(nil)

	comm := g.comm
	var (
		mu        sync.Mutex
		first     error // the failure that came first, HTTP or NCCL
		bcastDone bool
	)
	sessions := transfer.NewSessions(fleet, fresh)
	var httpErr error
	var wg sync.WaitGroup
	wg.Go(func() {
		httpErr = fleet.Each("update weights", func(i int, _ *vllm.Client) error {
			err := sessions.Run(hctx, i, func(ctx context.Context, c *vllm.Client) error { return c.UpdateWeights(ctx, info) }, version)
			if err == nil {
				return nil
			}
			mu.Lock()
			if first == nil && hctx.Err() == nil {
				first = err // not a call we cancelled ourselves
			}
			running := !bcastDone
			mu.Unlock()
			if running {
				comm.Abort(fmt.Errorf("ncclengine: %w: %w", errServerFailed, err))
			}
			hcancel(err)
			return err
		})
	})
	res, berr := send(uctx, comm)
	mu.Lock()
	bcastDone = true
	if berr != nil && first == nil {
		first = berr
	}
	mu.Unlock()
	if berr != nil {
		hcancel(berr)
	}
	wg.Wait()
	if berr != nil && !errors.Is(comm.Err(), errServerFailed) && ctx.Err() == nil {
		// NCCL failed on its own (its poison is not our abort): the
		// servers' failures, however early they were reported, follow
		// from it.
		first = berr
	}
	if first == nil {
		first = httpErr
	}
	if first == nil {
		return res, nil
	}

	note := sessions.CloseLeftOpen(ctx, version)
	if note != "" {
		note = "; " + note
	}
	if ctx.Err() == nil && uctx.Err() != nil {
		first = fmt.Errorf("%w: %w", context.Cause(uctx), first)
	}
	aborted := ""
	if comm.Err() != nil {
		aborted = "; the communicator was aborted, the next attempt re-initialises the group"
	}
	return res, transfer.TransportErrorf(ctx, first, "broadcast to %s (%d of %d bytes sent%s%s)%s",
		transfer.ServerList(fleet), progress.Sent(), total, aborted, note, e.healthNote())
}

// checkReceivable refuses, as BadInput and before any update session opens
// or any byte is broadcast, an update every vLLM worker would accept and
// then fail to receive: a packed layout its unpacking cannot view (a 0-dim
// tensor, an offset not a multiple of the item size), or a non-packed fp8
// broadcast the loaded NCCL has no type for. Either failure would otherwise
// come from inside the update, with every receiver waiting on NCCL.
//
// tensors are the update's wire tensors, in order, after plan.Validate.
func (e *Engine) checkReceivable(tensors []plan.Tensor, pk packing) error {
	if pk.packed {
		if err := plan.CheckPackedReceivable(tensors, plan.Packed(tensors, pk.threshold)); err != nil {
			return transfer.BadInputf("broadcast refused, nothing sent: %v", err)
		}
		return nil
	}
	bs, err := plan.NonPacked(tensors)
	if err != nil {
		return transfer.BadInputf("broadcast refused, nothing sent: %v", err)
	}
	v, err := e.cfg.API.NCCLVersion()
	if err != nil {
		return transfer.Errorf(transfer.NCCLFailed, err, "broadcast: the loaded NCCL's version")
	}
	if err := plan.CheckNCCLVersion(tensors, bs, v); err != nil {
		return transfer.BadInputf("broadcast refused, nothing sent: %v", err)
	}
	return nil
}
