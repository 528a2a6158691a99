package staging

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlflow/rlflow/safetensors"
)

// Source is where tensor bytes come from; *safetensors.Checkpoint is one
// (zero-copy slices of its read-only mappings).
type Source interface {
	Bytes(t safetensors.TensorInfo) ([]byte, error)
}

// MappedSource is a Source whose bytes are slices of read-only, page-aligned
// file mappings (*safetensors.Checkpoint is one): Options.PrefaultWorkers
// fault those mappings in ahead of the host copy.
type MappedSource interface {
	Source
	// Mapping returns the whole mapping holding t's bytes and the offset of
	// t's first byte in it.
	Mapping(t safetensors.TensorInfo) ([]byte, int64, error)
}

type copyPart struct {
	name string
	off  int64  // where the part's bytes go in the chunk (wire order)
	src  []byte // the checkpoint bytes it reads
	n    int64  // bytes it writes (len(src) unless converted)
	conv func(dst, src []byte) error
	win  int // the window this part belongs to
}

// span is a byte range [off, end) of a chunk.
type span struct{ off, end int64 }

// hostCopier fills pinned ring slots from a Source with a few goroutines:
// one core cannot copy from the page cache as fast as a PCIe Gen5 copy
// engine reads.
type hostCopier struct {
	src       Source
	workers   int
	partBytes int64 // most bytes (on the wire) of one job
	window    int64 // window size; <= 0: the whole chunk is one window
}

// parts cuts the chunk's bytes [from, to) into jobs of at most
// partBytes, at element boundaries (byte boundaries where nothing is
// converted), and groups consecutive jobs into windows of at least
// h.window bytes and less than h.window plus one element. Jobs are in wire
// order, so each window is a contiguous range of the chunk. from and to
// must not fall inside a converted tensor.
func (h *hostCopier) parts(c Chunk, from, to int64) ([]copyPart, []span, error) {
	var out []copyPart
	var wins []span
	win, acc := 0, int64(0)
	add := func(p copyPart) {
		if len(wins) == win {
			wins = append(wins, span{p.off, p.off})
		}
		wins[win].end = p.off + p.n
		p.win = win
		out = append(out, p)
		acc += p.n
		if h.window > 0 && acc >= h.window {
			win, acc = win+1, 0
		}
	}
	for _, p := range c.Pieces {
		if p.Offset+p.Bytes <= from || p.Offset >= to || p.Bytes == 0 {
			continue
		}
		src, err := h.src.Bytes(p.Src)
		if err != nil {
			return nil, nil, fmt.Errorf("staging: tensor %q: %w", p.Src.Name, err)
		}
		if int64(len(src)) != p.Src.Size {
			return nil, nil, fmt.Errorf("staging: tensor %q: source has %d bytes, want %d", p.Src.Name, len(src), p.Src.Size)
		}
		conv, err := converter(p.Src.DType, p.Wire)
		if err != nil {
			return nil, nil, fmt.Errorf("staging: tensor %q: %w", p.Src.Name, err)
		}
		// Unconverted bytes are copied as bytes, so a piece may be cut
		// anywhere (a window may end inside an element).
		si, di := int64(1), int64(1)
		if conv != nil {
			si, di = int64(p.Src.DType.ItemSize()), int64(p.Wire.ItemSize())
		}
		skip := max(from-p.Offset, 0)
		stop := min(to-p.Offset, p.Bytes)
		if skip%di != 0 || stop%di != 0 {
			return nil, nil, fmt.Errorf("staging: tensor %q: cannot cut a converted copy at bytes %d..%d", p.Src.Name, skip, stop)
		}
		elems := stop / di
		per := max(h.partBytes/di, 1)
		for e := skip / di; e < elems; {
			end := min(e+per, elems)
			if h.window > 0 {
				// Do not let a part run past the current window's target:
				// windows stay close to h.window and start early.
				end = min(end, e+max((h.window-acc)/di, 1))
			}
			add(copyPart{name: p.Src.Name, off: p.Offset + e*di, src: src[e*si : end*si], n: (end - e) * di, conv: conv})
			e = end
		}
	}
	return out, wins, nil
}

// fill copies parts (from parts) with the copier's workers, window by
// window, each window into a ring slot taken when its first part is handed
// out (waiting while none is free).
//
// The calling goroutine issues: it calls ready(ws, slots) with the windows
// whose parts are all copied since its last call (window ws[i] in slot
// slots[i], from the slot's first byte), in the order their copies
// finished, not in window order (a worker the scheduler holds back must not
// keep the finished windows behind it from the copy engine). ready must
// enqueue those slots' copies, hand the slots to the ring (enqueued) and
// reap the ring, all in one go, and say how many slots it reaped. While
// copies are in flight and no window is finished, the caller calls ready
// with no windows (reaping only) and yields the processor in between,
// sleeping only after a long fruitless spell (copies queued behind a slow
// broadcast): Go timers shorter than a millisecond may sleep about one on
// Linux, long enough for the copy engine to run dry.
//
// It returns the time spent waiting for slots and the first error of a
// part, ready, or ctx, after every worker stopped.
func (h *hostCopier) fill(ctx context.Context, parts []copyPart, wins []span, ring *hostRing, ready func(ws, slots []int) (int, error)) (time.Duration, error) {
	nwin := len(wins)
	if nwin == 0 {
		return 0, nil
	}
	left := make([]atomic.Int64, nwin)
	finished := make(chan int, nwin) // windows whose parts are all copied
	for _, p := range parts {
		left[p.win].Add(1)
	}
	// slotOf[w] is written by the dispatcher before window w's parts are
	// handed out and read after w came out of finished: ordered by the
	// channels.
	slotOf := make([]int, nwin)
	var once sync.Once
	var first error
	stop := make(chan struct{})
	fail := func(err error) {
		once.Do(func() { first = err; close(stop) })
	}
	type job struct {
		copyPart
		buf []byte // the window's slot from the window's first byte
		at  int64  // the window's first byte in the chunk
	}
	jobs := make(chan job)
	var wg sync.WaitGroup
	for i := 0; i < max(min(h.workers, len(parts)), 1); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				dst := j.buf[j.off-j.at : j.off-j.at+j.n]
				var err error
				if j.conv == nil {
					copy(dst, j.src)
				} else if err = j.conv(dst, j.src); err != nil {
					err = fmt.Errorf("staging: tensor %q: %w", j.name, err)
				}
				if err != nil {
					fail(err)
					continue
				}
				if left[j.win].Add(-1) == 0 {
					finished <- j.win
				}
			}
		}()
	}
	var waited time.Duration
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(jobs)
		w := -1
		var buf []byte
		for _, p := range parts {
			if p.win != w {
				w = p.win
				s, d, err := ring.take(ctx, stop)
				waited += d
				if err != nil {
					if err != errStopped {
						fail(err)
					}
					return
				}
				slotOf[w], buf = s, ring.slot(s)
			}
			select {
			case jobs <- job{copyPart: p, buf: buf, at: wins[w].off}:
			case <-stop:
				return
			case <-ctx.Done():
				fail(ctx.Err())
				return
			}
		}
	}()
	const spinMax = 4096 // fruitless rounds before sleeping between reaps
	var ws, slots []int
	idle := 0
	for issued := 0; issued < nwin; {
		ws, slots = ws[:0], slots[:0]
	drain:
		for {
			select {
			case w := <-finished:
				ws, slots = append(ws, w), append(slots, slotOf[w])
			default:
				break drain
			}
		}
		if len(ws) == 0 && !ring.inFlight() {
			// Nothing to reap: wait for a window (or the end).
			select {
			case w := <-finished:
				ws, slots = append(ws, w), append(slots, slotOf[w])
			case <-stop:
			}
		}
		select {
		case <-stop:
			issued = nwin // a part, a slot wait, ready or ctx failed
			continue
		default:
		}
		reaped, err := ready(ws, slots)
		if err != nil {
			fail(err)
			continue
		}
		issued += len(ws)
		if len(ws) > 0 || reaped > 0 {
			idle = 0
			continue
		}
		if idle++; idle < spinMax {
			runtime.Gosched()
			continue
		}
		t := time.NewTimer(200 * time.Microsecond)
		select {
		case w := <-finished:
			// Put it back for the next round's drain.
			finished <- w
		case <-stop:
		case <-ctx.Done():
			fail(ctx.Err())
		case <-t.C:
		}
		t.Stop()
	}
	wg.Wait()
	return waited, first
}
