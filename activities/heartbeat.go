package activities

import (
	"context"
	"sync"
	"time"

	"go.temporal.io/sdk/activity"
)

// defaultHeartbeatEvery is the longest gap between heartbeats when the
// worker sets none (Deps.HeartbeatEvery).
const defaultHeartbeatEvery = 5 * time.Second

// minHeartbeatEvery keeps a tiny heartbeat timeout from turning the
// heartbeat into a busy loop.
const minHeartbeatEvery = 10 * time.Millisecond

// attemptOf is the activity's attempt (1 for the first); a plain call
// outside an activity, in a unit test, is a first attempt.
func attemptOf(ctx context.Context) int {
	if activity.IsActivity(ctx) {
		return int(activity.GetInfo(ctx).Attempt)
	}
	return 1
}

// heartbeatEvery is the gap between heartbeats: Deps.HeartbeatEvery, or
// a third of the step's heartbeat timeout when that is shorter, so two
// heartbeats can be lost before Temporal gives the attempt up.
func (a *Activities) heartbeatEvery(ctx context.Context) time.Duration {
	every := a.HeartbeatEvery
	if every <= 0 {
		every = defaultHeartbeatEvery
	}
	if activity.IsActivity(ctx) {
		if hb := activity.GetInfo(ctx).HeartbeatTimeout; hb > 0 && hb/3 < every {
			every = hb / 3
		}
	}
	return max(every, minHeartbeatEvery)
}

// heartbeatLoop calls beat every heartbeatEvery until the returned stop (or
// ctx's end); stop waits for a beat in progress. Outside an activity it does
// nothing, so the activities run in plain tests too.
func (a *Activities) heartbeatLoop(ctx context.Context, beat func()) (stop func()) {
	if !activity.IsActivity(ctx) {
		return func() {}
	}
	return a.everyHeartbeat(ctx, beat)
}

// everyHeartbeat calls fn every heartbeatEvery until the returned stop (or
// ctx's end); stop waits for a call in progress. It runs outside an
// activity too (generate's weight checks).
func (a *Activities) everyHeartbeat(ctx context.Context, fn func()) (stop func()) {
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(a.heartbeatEvery(ctx))
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				fn()
			}
		}
	})
	return func() { close(quit); wg.Wait() }
}

// keepHeartbeating heartbeats without details until stop, for steps that
// wait on one long call (pause with mode wait).
func (a *Activities) keepHeartbeating(ctx context.Context) (stop func()) {
	return a.heartbeatLoop(ctx, func() { activity.RecordHeartbeat(ctx) })
}
