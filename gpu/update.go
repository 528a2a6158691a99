package gpu

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/nccl/staging"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/vllm"
)

// errServerFailed marks the communicator aborts caused by a server's
// failure, to tell them from NCCL failing on its own.
var errServerFailed = errors.New("aborted because a server failed")

// update runs one weight update on a locked, initialised group: for every
// server start_weight_update, update_weights and finish_weight_update (the
// blocking update_weights needs the broadcasts to run at the same time),
// concurrently with the staging pipeline's broadcasts. Whichever side
// fails first stops the other: an HTTP failure aborts the communicator
// (NCCL would otherwise wait forever for ranks that are not receiving), an
// NCCL failure cancels the HTTP calls.
//
// fresh says the group was (re)initialised by this attempt: an update
// session a server already has open then belongs to a trainer that is
// gone (a killed GPU worker, a lost group), so it is closed and the start
// retried once instead of failing every attempt on "already open".
func (t *Transfer) update(ctx context.Context, g *group, fleet vllm.Fleet, ck *safetensors.Checkpoint, u staging.Update,
	info vllm.UpdateInfo, version string, timeout time.Duration, fresh bool) (staging.Result, error) {
	uctx, cancel := context.WithTimeoutCause(ctx, timeout, fmt.Errorf("the update did not complete within %v (update_timeout)", timeout))
	defer cancel()
	hctx, hcancel := context.WithCancelCause(uctx)
	defer hcancel(nil)

	comm := g.comm
	var (
		mu        sync.Mutex
		first     error // the failure that came first, HTTP or NCCL
		bcastDone bool
	)
	opened := make([]bool, len(fleet))
	closed := make([]bool, len(fleet))
	httpErrs := make([]error, len(fleet))
	var wg sync.WaitGroup
	for i, c := range fleet {
		wg.Go(func() {
			err := c.StartWeightUpdate(hctx)
			var ve *vllm.Error
			if err != nil && fresh && errors.As(err, &ve) && ve.Status >= 500 {
				if c.FinishWeightUpdate(hctx, "") == nil {
					err = c.StartWeightUpdate(hctx)
				}
			}
			if err == nil {
				opened[i] = true
				err = c.UpdateWeights(hctx, info)
			}
			if err == nil {
				if err = c.FinishWeightUpdate(hctx, version); err == nil {
					closed[i] = true
					return
				}
			}
			httpErrs[i] = err
			mu.Lock()
			if first == nil && hctx.Err() == nil {
				first = err // not a call we cancelled ourselves
			}
			running := !bcastDone
			mu.Unlock()
			if running {
				comm.Abort(fmt.Errorf("gpu: %w: %w", errServerFailed, err))
			}
			hcancel(err)
		})
	}
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
		first = errors.Join(httpErrs...)
	}
	if first == nil {
		return res, nil
	}

	note := closeSessions(ctx, fleet, opened, closed)
	if ctx.Err() == nil && uctx.Err() != nil {
		first = fmt.Errorf("%w: %w", context.Cause(uctx), first)
	}
	aborted := ""
	if comm.Err() != nil {
		aborted = "; the communicator was aborted, the next attempt re-initialises the group"
	}
	return res, transportError(ctx, first, "gpu: broadcast to %s (%d of %d bytes sent%s%s)%s",
		strings.Join(g.servers, ", "), g.bytesSent(), u.Bytes(), aborted, note, t.healthNote())
}

// closeSessions asks every server whose update session this attempt opened
// and did not finish to close it, so that none is left mid-update (the
// next start_weight_update would fail). Best effort and bounded; it
// returns a note naming the servers where it failed.
func closeSessions(ctx context.Context, fleet vllm.Fleet, opened, closed []bool) string {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	errs := make([]error, len(fleet))
	var wg sync.WaitGroup
	for i, c := range fleet {
		if opened[i] && !closed[i] {
			wg.Go(func() { errs[i] = c.FinishWeightUpdate(cctx, "") })
		}
	}
	wg.Wait()
	var left []string
	for i, err := range errs {
		if err != nil {
			left = append(left, fmt.Sprintf("%s (%v)", fleet[i].URL(), err))
		}
	}
	if len(left) == 0 {
		return ""
	}
	return "; could not close the update session on " + strings.Join(left, ", ")
}

// verify checks that every server with weight versions (C, D) reports
// version.
func verify(ctx context.Context, fleet vllm.Fleet, gens []vllm.Generation, version string) error {
	for i, c := range fleet {
		if i < len(gens) && gens[i] != vllm.GenC && gens[i] != vllm.GenD {
			continue
		}
		got, err := c.WeightInfo(ctx)
		if err != nil {
			return transportError(ctx, err, "gpu: verify weight version")
		}
		if got != version {
			return activities.StepError(ctx, activities.ErrTypeServerError, nil,
				"gpu: verify: server %s reports weight version %q after the update, want %q", c.URL(), got, version)
		}
	}
	return nil
}
