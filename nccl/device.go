package nccl

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Device is an actor that owns one OS thread bound to one CUDA device: a
// goroutine locked with runtime.LockOSThread, on which SetDevice(ordinal)
// ran before anything else. Every request (Do) runs on that thread, one at
// a time, in the order received. That is the only way rlflow calls the API,
// so the per-thread CUDA current device is always right and a
// communicator's calls never migrate between threads.
//
// A request runs to completion once it started: functions passed to Do must
// not block without bound; wait with WaitEvent/WaitStream (which poll and
// watch the context) instead of EventSynchronize/StreamSynchronize.
type Device struct {
	api     API
	ordinal int
	tid     atomic.Int64 // the actor's OS thread while it runs (0 after), for re-entrant Do

	reqs    chan request
	stop    chan struct{}
	stopped chan struct{}
	once    sync.Once
	poll    pollPolicy
}

type request struct {
	fn   func(API) error
	done chan error
}

// OpenDevice starts the actor for CUDA device ordinal and runs SetDevice on
// its thread. Close stops it.
//
// A device that cannot be selected is a *DeviceError: the GPU is missing
// or unusable, which no retry on this process can mend.
func OpenDevice(api API, ordinal int) (*Device, error) {
	d := &Device{
		api:     api,
		ordinal: ordinal,
		reqs:    make(chan request),
		stop:    make(chan struct{}),
		stopped: make(chan struct{}),
		poll:    defaultPoll,
	}
	ready := make(chan error, 1)
	go d.loop(ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return d, nil
}

func (d *Device) loop(ready chan<- error) {
	// The thread stays locked until the goroutine exits; the runtime then
	// terminates it, so its CUDA state never leaks into another goroutine.
	runtime.LockOSThread()
	defer close(d.stopped)
	// Forget the thread id before the thread dies: the kernel may give it
	// to a new thread, which must not be mistaken for the actor.
	defer d.tid.Store(0)
	d.tid.Store(int64(ThreadID()))
	if err := d.api.SetDevice(d.ordinal); err != nil {
		ready <- &DeviceError{Ordinal: d.ordinal, Err: err}
		return
	}
	ready <- nil
	for {
		select {
		case <-d.stop:
			return
		case r := <-d.reqs:
			r.done <- d.run(r.fn)
		}
	}
}

func (d *Device) run(fn func(API) error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("nccl: panic on the thread of device %d: %v", d.ordinal, p)
		}
	}()
	return fn(d.api)
}

// Ordinal is the CUDA device index.
func (d *Device) Ordinal() int { return d.ordinal }

// Do runs fn on the device's thread and returns its error. It gives up with
// ctx's error only while fn is still waiting for its turn; once fn started
// it runs to the end. Called from inside another Do function (on the actor
// itself) it runs fn inline instead of deadlocking.
func (d *Device) Do(ctx context.Context, fn func(API) error) error {
	if tid := d.tid.Load(); tid != 0 && int64(ThreadID()) == tid {
		return d.run(fn)
	}
	select {
	case <-d.stopped:
		return fmt.Errorf("nccl: device %d: %w", d.ordinal, ErrClosed)
	default:
	}
	r := request{fn: fn, done: make(chan error, 1)}
	select {
	case d.reqs <- r:
	case <-ctx.Done():
		return fmt.Errorf("nccl: device %d busy: %w", d.ordinal, ctx.Err())
	case <-d.stopped:
		return fmt.Errorf("nccl: device %d: %w", d.ordinal, ErrClosed)
	}
	return <-r.done
}

// WaitEvent polls cudaEventQuery until the work before e's latest record
// completed, ctx ends (the GPU work is not stopped then), or the query fails.
func (d *Device) WaitEvent(ctx context.Context, e Event) error {
	return d.Do(ctx, func(api API) error {
		return d.poll.wait(ctx, nil, func() (bool, error) { return api.EventQuery(e) })
	})
}

// WaitStream polls cudaStreamQuery until s is idle, like WaitEvent.
func (d *Device) WaitStream(ctx context.Context, s Stream) error {
	return d.Do(ctx, func(api API) error {
		return d.poll.wait(ctx, nil, func() (bool, error) { return api.StreamQuery(s) })
	})
}

// Close stops the actor after the request in progress, if any. Requests
// not yet started fail with ErrClosed. Close does not free CUDA resources:
// release them with Do first.
func (d *Device) Close() {
	d.once.Do(func() { close(d.stop) })
	<-d.stopped
}

// pollPolicy is how waits poll: a short interval first (a finished copy is
// noticed within microseconds), doubling up to max so that a long wait does
// not burn the actor's CPU.
type pollPolicy struct{ min, max time.Duration }

var defaultPoll = pollPolicy{min: 10 * time.Microsecond, max: 500 * time.Microsecond}

// wait calls ready until it reports done or fails, returning early when ctx
// ends or cancel is closed. Errors are returned as they are: callers add
// context and decide about aborting.
func (p pollPolicy) wait(ctx context.Context, cancel <-chan struct{}, ready func() (bool, error)) error {
	interval := p.min
	var t *time.Timer
	for {
		done, err := ready()
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		if t == nil {
			t = time.NewTimer(interval)
			defer t.Stop()
		} else {
			t.Reset(interval)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-cancel:
			return errAbortRequested
		case <-t.C:
		}
		if interval *= 2; interval > p.max {
			interval = p.max
		}
	}
}

// DeviceError is OpenDevice's failure to select its device (cudaSetDevice):
// the GPU is gone, hidden or broken, as opposed to one operation failing.
type DeviceError struct {
	Ordinal int
	Err     error
}

func (e *DeviceError) Error() string {
	return fmt.Sprintf("nccl: select device %d: %v", e.Ordinal, e.Err)
}

func (e *DeviceError) Unwrap() error { return e.Err }
