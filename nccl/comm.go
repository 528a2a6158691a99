package nccl

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

var errAbortRequested = errors.New("abort requested")

// Comm is one NCCL communicator run as an actor: the ncclComm_t, its stream
// and every call on them belong to the one locked goroutine of its Device.
// Public methods may be called from any goroutine; they take a context and
// stay cancellable because nothing on the actor waits without polling
// cudaStreamQuery/cudaEventQuery and ncclCommGetAsyncError.
//
// Failure is final: when a wait's context ends, Abort is called or NCCL
// reports an asynchronous error, the actor calls ncclCommAbort (NCCL kernels
// exit, so the device is usable again) and the Comm is poisoned: that call
// and every later one return an error matching ErrAborted and wrapping the
// first cause. Build a new Comm (with a fresh unique id) to continue.
type Comm struct {
	dev   *Device
	rank  int
	world int
	poll  pollPolicy

	// Owned by the actor goroutine.
	handle  CommHandle
	stream  Stream
	scratch DevPtr

	abortCh   chan struct{} // closed by Abort: running waits give up
	abortOnce sync.Once

	mu       sync.Mutex
	poisoned error // set on the actor, read anywhere
	abortErr error // the cause given to Abort
	closed   bool
}

// CommOption adjusts NewComm.
type CommOption func(*Comm)

// WithPollInterval sets how waits poll: starting at min and doubling up to
// max. The default is 10µs to 500µs.
func WithPollInterval(min, max time.Duration) CommOption {
	return func(c *Comm) {
		if min > 0 && max >= min {
			c.poll = pollPolicy{min: min, max: max}
		}
	}
}

// NewComm joins rank of a worldSize-rank communicator identified by id on
// CUDA device device, then runs vLLM's warm-up (spec 3.3): a one-element
// float32 SUM all-reduce and a wait for the stream, which every rank must do
// before the first broadcast. It returns once every rank joined and the
// warm-up completed, or with an error when ctx ends first (the half-built
// communicator is aborted, so NCCL's threads stop waiting for the missing
// peers).
//
// The communicator is non-blocking (ncclCommInitRankConfig, blocking=0);
// with an NCCL older than 2.14 it falls back to the blocking
// ncclCommInitRank, which cannot be interrupted.
func NewComm(ctx context.Context, api API, device, worldSize, rank int, id UniqueID, opts ...CommOption) (*Comm, error) {
	if worldSize < 1 || rank < 0 || rank >= worldSize {
		return nil, fmt.Errorf("nccl: invalid rank %d for world size %d", rank, worldSize)
	}
	dev, err := OpenDevice(api, device)
	if err != nil {
		return nil, err
	}
	c := &Comm{dev: dev, rank: rank, world: worldSize, poll: defaultPoll, abortCh: make(chan struct{})}
	for _, o := range opts {
		o(c)
	}
	dev.poll = c.poll
	err = dev.Do(ctx, func(api API) error { return c.init(ctx, api, id) })
	if err != nil {
		dev.Close()
		return nil, fmt.Errorf("nccl: rank %d of %d on device %d: %w", rank, worldSize, device, err)
	}
	return c, nil
}

// init runs on the actor.
func (c *Comm) init(ctx context.Context, api API, id UniqueID) error {
	s, err := api.StreamCreate(StreamNonBlocking)
	if err != nil {
		return err
	}
	c.stream = s
	undo := func() {
		if c.scratch != 0 {
			_ = api.Free(c.scratch)
			c.scratch = 0
		}
		_ = api.StreamDestroy(c.stream)
		c.stream = 0
	}

	h, err := api.CommInitRankConfig(c.world, id, c.rank, CommConfig{Blocking: false})
	if errors.Is(err, ErrNotSupported) {
		h, err = api.CommInitRank(c.world, id, c.rank)
	}
	if h != 0 {
		c.handle = h
	}
	if err != nil && !IsInProgress(err) {
		if c.handle != 0 {
			_ = api.CommAbort(c.handle)
			c.handle = 0
		}
		undo()
		return fmt.Errorf("init: %w", err)
	}
	if c.handle == 0 {
		undo()
		return errors.New("init: ncclCommInitRankConfig returned no communicator")
	}
	// Init completes when every rank called it: until then the async error
	// is InProgress. Waiting here is where a peer that never comes shows up.
	err = c.poll.wait(ctx, c.abortCh, func() (bool, error) {
		e := api.CommGetAsyncError(c.handle)
		if IsInProgress(e) {
			return false, nil
		}
		return e == nil, e
	})
	if err != nil {
		_ = api.CommAbort(c.handle)
		c.handle = 0
		undo()
		return fmt.Errorf("waiting for all %d ranks to join: %w", c.world, err)
	}

	c.scratch, err = api.Malloc(4)
	if err == nil {
		err = api.MemsetAsync(c.scratch, 0, 4, c.stream)
	}
	if err == nil {
		err = c.enqueue(ctx, api, "warm-up all-reduce", func() error {
			return api.AllReduce(c.scratch, c.scratch, 1, Float32, Sum, c.handle, c.stream)
		})
	}
	if err == nil {
		err = c.await(ctx, api, "warm-up all-reduce", func() (bool, error) { return api.StreamQuery(c.stream) })
	}
	if err != nil {
		if c.handle != 0 {
			err = c.fail(api, "warm-up", err)
		}
		undo()
		return err
	}
	return nil
}

// Rank and WorldSize are the communicator's coordinates.
func (c *Comm) Rank() int      { return c.rank }
func (c *Comm) WorldSize() int { return c.world }

// Stream is the communicator's stream (non-blocking). Work that must follow
// or precede a broadcast is ordered against it with events.
func (c *Comm) Stream() Stream { return c.stream }

// Device is the actor that owns the communicator's thread. Run CUDA work
// that belongs with this communicator (allocations, copies, events) through
// it; it keeps working after the communicator was aborted, for cleanup.
func (c *Comm) Device() *Device { return c.dev }

// Err is the poison: nil while the communicator is healthy.
func (c *Comm) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.poisoned != nil {
		return c.poisoned
	}
	if c.closed {
		return ErrClosed
	}
	return nil
}

// fail aborts the communicator (on the actor) and poisons it, returning the
// poison. A second failure keeps the first cause.
func (c *Comm) fail(api API, what string, cause error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.poisoned != nil {
		return c.poisoned
	}
	if errors.Is(cause, errAbortRequested) && c.abortErr != nil {
		cause = c.abortErr
	}
	if c.handle != 0 {
		// A non-blocking communicator may answer InProgress: the abort then
		// completes in the background and the handle is dead either way.
		if aerr := api.CommAbort(c.handle); aerr != nil && !IsInProgress(aerr) {
			cause = fmt.Errorf("%w (and ncclCommAbort failed: %v)", cause, aerr)
		}
		c.handle = 0
	}
	c.poisoned = fmt.Errorf("%w: rank %d of %d: %s: %w", ErrAborted, c.rank, c.world, what, cause)
	return c.poisoned
}

// await polls ready (a stream or event query) on the actor, checking the
// communicator's asynchronous error each round. Any failure, the end of ctx
// or Abort aborts and poisons the communicator.
func (c *Comm) await(ctx context.Context, api API, what string, ready func() (bool, error)) error {
	err := c.poll.wait(ctx, c.abortCh, func() (bool, error) {
		done, err := ready()
		if err != nil {
			return false, err
		}
		// Checked after ready, not before: an error raised just before the
		// stream drained (NCCL kernels exit on failure) must not be missed.
		if e := api.CommGetAsyncError(c.handle); e != nil && !IsInProgress(e) {
			return false, e
		}
		return done, nil
	})
	if err != nil {
		return c.fail(api, what, err)
	}
	return nil
}

// enqueue issues one NCCL call. A non-blocking communicator may answer
// InProgress: the call is then still being enqueued and NCCL requires
// waiting for ncclCommGetAsyncError to leave InProgress before the next
// call. A synchronous failure also aborts: the peers would otherwise wait
// forever for a collective this rank never issued.
func (c *Comm) enqueue(ctx context.Context, api API, what string, call func() error) error {
	err := call()
	if err == nil {
		return nil
	}
	if !IsInProgress(err) {
		return c.fail(api, what, err)
	}
	return c.await(ctx, api, what, func() (bool, error) {
		e := api.CommGetAsyncError(c.handle)
		if IsInProgress(e) {
			return false, nil
		}
		return e == nil, e
	})
}

// do runs fn on the actor after the fast-fail checks.
func (c *Comm) do(ctx context.Context, fn func(api API) error) error {
	if err := c.Err(); err != nil {
		return err
	}
	return c.dev.Do(ctx, func(api API) error {
		if err := c.Err(); err != nil {
			return err
		}
		return fn(api)
	})
}

// Broadcast is ncclBroadcast of count elements of dt at buf from root 0
// (send == recv, so on rank 0 the buffer is the source and elsewhere the
// destination), and waits for it to complete on the communicator's stream.
func (c *Comm) Broadcast(ctx context.Context, buf DevPtr, count int, dt DataType) error {
	what := fmt.Sprintf("broadcast of %d x %v", count, dt)
	return c.do(ctx, func(api API) error {
		if err := c.enqueue(ctx, api, what, func() error {
			return api.Broadcast(buf, buf, count, dt, 0, c.handle, c.stream)
		}); err != nil {
			return err
		}
		return c.await(ctx, api, what, func() (bool, error) { return api.StreamQuery(c.stream) })
	})
}

// Order places a BroadcastAsync among other work with events; zero fields
// are skipped.
type Order struct {
	// After: the communicator's stream waits for After's latest record
	// (cudaStreamWaitEvent) before the broadcast, e.g. the copy that filled
	// the buffer.
	After Event
	// Start is recorded just before the broadcast (once After was reached),
	// Done just after it: with timing events, their elapsed time is the
	// broadcast's own duration. Done also tells when the buffer may be
	// reused.
	Start, Done Event
}

// BroadcastAsync enqueues the same broadcast as Broadcast without waiting
// for it, ordered by o, and returns once NCCL accepted it. Completion is
// observed with WaitEvent(o.Done) or Synchronize, which also surface
// asynchronous NCCL errors.
func (c *Comm) BroadcastAsync(ctx context.Context, buf DevPtr, count int, dt DataType, o Order) error {
	what := fmt.Sprintf("broadcast of %d x %v", count, dt)
	return c.do(ctx, func(api API) error {
		if o.After != 0 {
			if err := api.StreamWaitEvent(c.stream, o.After); err != nil {
				return c.fail(api, what, err)
			}
		}
		if o.Start != 0 {
			if err := api.EventRecord(o.Start, c.stream); err != nil {
				return c.fail(api, what, err)
			}
		}
		if err := c.enqueue(ctx, api, what, func() error {
			return api.Broadcast(buf, buf, count, dt, 0, c.handle, c.stream)
		}); err != nil {
			return err
		}
		if o.Done != 0 {
			if err := api.EventRecord(o.Done, c.stream); err != nil {
				return c.fail(api, what, err)
			}
		}
		return nil
	})
}

// RecordEvent records e on the communicator's stream (for timing, or to
// order other streams after the broadcasts enqueued so far).
func (c *Comm) RecordEvent(ctx context.Context, e Event) error {
	return c.do(ctx, func(api API) error { return api.EventRecord(e, c.stream) })
}

// WaitEvent waits until e's most recent record completed, watching the
// communicator: a broadcast that cannot finish (a peer died) surfaces as the
// asynchronous error or as ctx's end, and both abort the communicator.
func (c *Comm) WaitEvent(ctx context.Context, e Event) error {
	return c.do(ctx, func(api API) error {
		return c.await(ctx, api, "waiting for an event", func() (bool, error) { return api.EventQuery(e) })
	})
}

// EventDone is one non-blocking poll of e's most recent record that watches
// the communicator like WaitEvent: an asynchronous NCCL error fails it (and
// aborts the communicator), so a caller polling work queued behind a
// broadcast learns that a peer died instead of waiting for its deadline.
// It does not hold the actor between polls, unlike WaitEvent.
func (c *Comm) EventDone(ctx context.Context, e Event) (done bool, err error) {
	err = c.do(ctx, func(api API) error {
		d, qerr := api.EventQuery(e)
		if qerr != nil {
			return c.fail(api, "querying an event", qerr)
		}
		// After the query, as in await: an error raised just before the
		// work drained must not be missed.
		if aerr := api.CommGetAsyncError(c.handle); aerr != nil && !IsInProgress(aerr) {
			return c.fail(api, "querying an event", aerr)
		}
		done = d
		return nil
	})
	return done && err == nil, err
}

// Synchronize waits until everything enqueued on the communicator's stream
// completed, like WaitEvent.
func (c *Comm) Synchronize(ctx context.Context) error {
	return c.do(ctx, func(api API) error {
		return c.await(ctx, api, "waiting for the stream", func() (bool, error) { return api.StreamQuery(c.stream) })
	})
}

// Abort aborts the communicator from any goroutine: a wait in progress
// gives up at its next poll, and the communicator is poisoned with cause
// (or a generic cause if nil). Abort waits until ncclCommAbort returned.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("aborted by the caller")
	}
	c.mu.Lock()
	if c.abortErr == nil {
		c.abortErr = cause
	}
	c.mu.Unlock()
	c.abortOnce.Do(func() { close(c.abortCh) })
	_ = c.dev.Do(context.Background(), func(api API) error {
		c.fail(api, "abort", cause)
		return nil
	})
}

// Close finalizes and destroys a healthy communicator, or just releases the
// resources of an aborted one, then stops the actor. If ctx ends while an
// operation still occupies the actor or while NCCL flushes, the
// communicator is aborted instead. Close is idempotent; other methods fail
// with ErrClosed afterwards.
func (c *Comm) Close(ctx context.Context) error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	var err error
	cleanup := func(api API) error {
		if c.handle != 0 {
			c.mu.Lock()
			healthy := c.poisoned == nil
			c.mu.Unlock()
			if healthy {
				err = c.finalize(ctx, api)
			}
		}
		if c.scratch != 0 {
			if e := api.Free(c.scratch); e != nil && err == nil {
				err = e
			}
			c.scratch = 0
		}
		if e := api.StreamDestroy(c.stream); e != nil && err == nil {
			err = e
		}
		return nil
	}
	if e := c.dev.Do(ctx, cleanup); e != nil {
		// The actor is still busy with a wait (ctx ended first): make it
		// give up, then clean up once it is free.
		c.Abort(fmt.Errorf("closing: %w", e))
		_ = c.dev.Do(context.Background(), cleanup)
	}
	c.abortOnce.Do(func() { close(c.abortCh) })
	c.dev.Close()
	if err != nil {
		return fmt.Errorf("nccl: close rank %d of %d: %w", c.rank, c.world, err)
	}
	return nil
}

func (c *Comm) finalize(ctx context.Context, api API) error {
	err := api.CommFinalize(c.handle)
	switch {
	case errors.Is(err, ErrNotSupported):
		err = nil
	case IsInProgress(err):
		err = c.poll.wait(ctx, nil, func() (bool, error) {
			e := api.CommGetAsyncError(c.handle)
			if IsInProgress(e) {
				return false, nil
			}
			return e == nil, e
		})
	}
	if err != nil {
		return c.fail(api, "finalize", err)
	}
	h := c.handle
	c.handle = 0
	if err := api.CommDestroy(h); err != nil && !IsInProgress(err) {
		return err
	}
	return nil
}
