package staging

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// hostRing is the host copy's pinned memory: slots of slotBytes that the
// copy workers fill and the copy engine drains, each reused once the
// host-to-device copy that read it has completed.
//
// Why slots and not a chunk-sized buffer: on the GPU hosts that took the
// page cache -> device path from well below to near the pinned
// host-to-device ceiling, pinning 64 MiB instead of N chunks (the figures
// are in nccl/GPU-RESULTS.md). The working explanation, not established: a
// slot of a few MiB is still in the CPU's cache when the copy engine reads
// it, so a staged byte crosses DRAM once (the page-cache read) instead of
// three times (read, write of the pinned buffer, DMA read of it). It fits
// the ring sizes measured: a 128 MiB ring did as well as a 64 MiB one on
// one host and far worse on another.
//
// Invariant: a slot is in free, held by the one fill that took it, or in
// busy (its copy enqueued on the copy stream, in stream order), never two
// of these at once.
type hostRing struct {
	mem       []byte // one cudaHostAlloc, slots at stride
	slotBytes int64  // the window size: usable bytes of one slot
	stride    int64
	ev        []nccl.Event // per slot: recorded after the copy that reads it
	free      chan int

	mu   sync.Mutex
	busy []int // slots whose copy is enqueued, oldest first
}

// ringPad is room past slotBytes: a window may pass its target by less than
// one converted element (parts never cut an element).
const ringPad = 64

// ringGeometry is the slot size and count for windows of window bytes
// (<= 0: whole chunks of up to chunk bytes) in about pinned bytes, with at
// least two slots so that filling and draining overlap.
func ringGeometry(window, chunk, pinned int64) (slotBytes int64, slots int) {
	slotBytes = chunk
	if window > 0 {
		slotBytes = min(window, chunk)
	}
	slotBytes = max(slotBytes, 1)
	return slotBytes, int(max(pinned/slotBytes, 2))
}

// newHostRing allocates the ring on the device's actor (api is that actor's).
func newHostRing(api nccl.API, slotBytes int64, slots int, flags uint) (*hostRing, error) {
	pg := int64(os.Getpagesize())
	stride := (slotBytes + ringPad + pg - 1) / pg * pg
	r := &hostRing{slotBytes: slotBytes, stride: stride, free: make(chan int, slots)}
	mem, err := api.HostAlloc(int(stride*int64(slots)), flags)
	if err != nil {
		return nil, fmt.Errorf("staging: %d pinned host slots of %d bytes (%d in all; check the memlock limit and free RAM): %w", slots, slotBytes, stride*int64(slots), err)
	}
	r.mem = mem
	for i := 0; i < slots; i++ {
		e, err := api.EventCreate(nccl.EventDisableTiming)
		if err != nil {
			r.release(api)
			return nil, err
		}
		r.ev = append(r.ev, e)
	}
	r.reset()
	return r, nil
}

// release frees the ring's memory and events (on the device's actor).
func (r *hostRing) release(api nccl.API) error {
	var first error
	for _, e := range r.ev {
		if err := api.EventDestroy(e); err != nil && first == nil {
			first = err
		}
	}
	r.ev = nil
	if r.mem != nil {
		if err := api.FreeHost(r.mem); err != nil && first == nil {
			first = err
		}
		r.mem = nil
	}
	return first
}

func (r *hostRing) slots() int { return len(r.ev) }

// slot is slot i's memory (slotBytes plus the pad).
func (r *hostRing) slot(i int) []byte {
	return r.mem[int64(i)*r.stride : int64(i)*r.stride+r.slotBytes+ringPad]
}

// reset marks every slot free: only when the copy stream is idle (a run
// starts after the previous one waited for its copies or was drained).
func (r *hostRing) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.busy = r.busy[:0]
	for len(r.free) > 0 {
		<-r.free
	}
	for i := 0; i < r.slots(); i++ {
		r.free <- i
	}
}

// enqueued records that slot s's copy (followed by ev[s]) is on the copy
// stream.
func (r *hostRing) enqueued(s int) {
	r.mu.Lock()
	r.busy = append(r.busy, s)
	r.mu.Unlock()
}

// eventDone is one non-blocking poll of an event: the device's
// cudaEventQuery, or in broadcast mode nccl.Comm.EventDone, which also fails
// once the communicator failed (the ring's copies may be queued behind a
// broadcast whose peer died).
type eventDone func(ctx context.Context, e nccl.Event) (bool, error)

// reap frees the slots whose copies completed, oldest first (one stream:
// they complete in order), and says how many it freed.
func (r *hostRing) reap(ctx context.Context, query eventDone) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	var err error
	for n < len(r.busy) {
		var done bool
		if done, err = query(ctx, r.ev[r.busy[n]]); err != nil || !done {
			break
		}
		n++
	}
	for _, s := range r.busy[:n] {
		r.free <- s
	}
	r.busy = r.busy[n:]
	return n, err
}

// take returns a free slot and the time it waited for one; it gives up
// when stop closes or ctx ends. The filling goroutine reaps (see fill).
func (r *hostRing) take(ctx context.Context, stop <-chan struct{}) (int, time.Duration, error) {
	select {
	case s := <-r.free:
		return s, 0, nil
	default:
	}
	t := time.Now()
	select {
	case s := <-r.free:
		return s, time.Since(t), nil
	case <-stop:
		return 0, time.Since(t), errStopped
	case <-ctx.Done():
		return 0, time.Since(t), ctx.Err()
	}
}

// inFlight says whether a slot's copy is enqueued and not yet reaped.
func (r *hostRing) inFlight() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.busy) > 0
}

// errStopped ends a slot wait because the fill already failed.
var errStopped = fmt.Errorf("staging: fill stopped")
