package ncclengine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
)

// errServerFailed marks the communicator aborts caused by a server's
// failure, to tell them from NCCL failing on its own.
var errServerFailed = errors.New("aborted because a server failed")

// update runs one weight update on a locked, initialised group: every
// server's update session (start, the blocking update_weights, finish),
// concurrently with the staging pipeline's broadcasts, which
// update_weights waits for. Whichever side fails first stops the other: an
// HTTP failure aborts the communicator (NCCL would otherwise wait forever
// for ranks that are not receiving), an NCCL failure cancels the HTTP
// calls.
//
// fresh says the group was (re)initialised by this attempt: an update
// session a server already has open then belongs to a trainer that is
// gone (a killed GPU worker, a lost group), so it is closed and the start
// retried once instead of failing every attempt on "already open".
func (e *Engine) update(ctx context.Context, g *group, fleet vllm.Fleet, ck *safetensors.Checkpoint, u staging.Update,
	info vllm.UpdateInfo, version string, timeout time.Duration, fresh bool, progress *transfer.Progress) (staging.Result, error) {
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
	res, berr := g.pipe.Broadcast(uctx, comm, ck, u.Chunks)
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
		transfer.ServerList(fleet), progress.Sent(), u.Bytes(), aborted, note, e.healthNote())
}

// checkReceivable refuses, as BadInput and before any update session opens
// or any byte is broadcast, an update every vLLM worker would accept and
// then fail to receive: a packed layout its unpacking cannot view (a 0-dim
// tensor, an offset not a multiple of the item size), or a non-packed fp8
// broadcast the loaded NCCL has no type for. Either failure would otherwise
// come from inside the update, with every receiver waiting on NCCL.
func (e *Engine) checkReceivable(u staging.Update) error {
	if u.Packed {
		if err := plan.CheckPackedReceivable(u.Tensors, plan.Packed(u.Tensors, u.Threshold)); err != nil {
			return transfer.BadInputf("broadcast refused, nothing sent: %v", err)
		}
		return nil
	}
	bs, err := plan.NonPacked(u.Tensors)
	if err != nil {
		return transfer.BadInputf("broadcast refused, nothing sent: %v", err)
	}
	v, err := e.cfg.API.NCCLVersion()
	if err != nil {
		return transfer.Errorf(transfer.NCCLFailed, err, "broadcast: the loaded NCCL's version")
	}
	if err := plan.CheckNCCLVersion(u.Tensors, bs, v); err != nil {
		return transfer.BadInputf("broadcast refused, nothing sent: %v", err)
	}
	return nil
}
