package staging

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rlflow/rlflow/nccl"
)

// RegisterFlags are the cudaHostRegister flags of ModeRegister: ReadOnly
// because a PROT_READ file mapping cannot be pinned for writing, Portable so
// the registration holds for every context (the registration workers are
// other threads than the copy stream's).
const RegisterFlags = nccl.HostRegisterReadOnly | nccl.HostRegisterPortable

// madvPopulateRead is MADV_POPULATE_READ (Linux 5.14): fault the range's
// page tables in without copying anything. Not in package syscall.
const madvPopulateRead = 22

// segment is one page-aligned, non-overlapping range of one mapping: the
// unit of registration and of prefaulting. CUDA refuses overlapping
// registrations, so tensors that share a page share a segment.
type segment struct {
	b     []byte
	ready chan struct{} // closed once registered, or once that failed
	err   error         // set before ready is closed
	reg   bool          // registered, not yet unregistered
	// left is the bytes of the segment that copies still have to read:
	// at zero every copy from it is enqueued, and once the last one
	// completed the segment can be unregistered (UnregisterEarly). Only
	// the run's goroutine touches it.
	left int64
}

type segKey struct {
	base uintptr
	i    int64
}

// segments indexes the mappings of a MappedSource in segments of a fixed
// size, in the order the chunks first touch them.
type segments struct {
	src   MappedSource
	size  int64
	list  []*segment
	index map[segKey]*segment
}

// xfer is one host-to-device copy: src into the chunk at dst.
type xfer struct {
	dst int64
	src []byte
	seg *segment
}

// newSegments plans the segments of chunks' bytes. With limit nil every
// byte counts (prefaulting); otherwise only the unconverted chunks' bytes
// before limit(c) (what ModeRegister sends directly).
func newSegments(src MappedSource, size int64, chunks []Chunk, limit func(Chunk) int64) (*segments, error) {
	s := &segments{src: src, size: size, index: map[segKey]*segment{}}
	for _, c := range chunks {
		end := c.Bytes
		if limit != nil {
			if hasConversion(c) {
				continue
			}
			end = limit(c)
		}
		for _, p := range c.Pieces {
			if _, err := s.split(p, end, true); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

// split cuts the part of piece p before chunk offset limit into
// per-segment transfers (creating the segments when add is set). Bytes are
// taken as they are in the file: p must not be converted, unless limit
// covers it whole (prefaulting only reads the source).
func (s *segments) split(p Piece, limit int64, add bool) ([]xfer, error) {
	size := min(p.Src.Size, limit-p.Offset)
	if size <= 0 {
		return nil, nil
	}
	m, off, err := s.src.Mapping(p.Src)
	if err != nil {
		return nil, fmt.Errorf("staging: tensor %q: mapping: %w", p.Src.Name, err)
	}
	if off < 0 || off+p.Src.Size > int64(len(m)) {
		return nil, fmt.Errorf("staging: tensor %q: bytes %d..%d outside its %d-byte mapping", p.Src.Name, off, off+p.Src.Size, len(m))
	}
	mp := unsafe.Pointer(unsafe.SliceData(m))
	base := uintptr(mp)
	// The mapping extends to the end of its last page; registering whole
	// pages keeps every segment page aligned at both ends.
	pg := int64(os.Getpagesize())
	mlen := (int64(len(m)) + pg - 1) / pg * pg
	var out []xfer
	for pos, end := off, off+size; pos < end; {
		i := pos / s.size
		segEnd := min((i+1)*s.size, end)
		k := segKey{base, i}
		seg := s.index[k]
		if seg == nil {
			if !add {
				return nil, fmt.Errorf("staging: tensor %q: segment %d of its mapping was not planned", p.Src.Name, i)
			}
			lo, hi := i*s.size, min((i+1)*s.size, mlen)
			seg = &segment{b: unsafe.Slice((*byte)(unsafe.Add(mp, lo)), hi-lo), ready: make(chan struct{})}
			s.index[k] = seg
			s.list = append(s.list, seg)
		}
		if add {
			seg.left += segEnd - pos
		}
		out = append(out, xfer{dst: p.Offset + (pos - off), src: m[pos:segEnd:segEnd], seg: seg})
		pos = segEnd
	}
	return out, nil
}

// plan returns the transfers of chunk c's bytes before limit straight from
// the mapping, adjacent ones of one segment merged (a packed chunk of
// file-ordered tensors becomes one copy per segment).
func (s *segments) plan(c Chunk, limit int64) ([]xfer, error) {
	var out []xfer
	for _, p := range c.Pieces {
		xs, err := s.split(p, limit, false)
		if err != nil {
			return nil, err
		}
		for _, x := range xs {
			if n := len(out); n > 0 {
				last := &out[n-1]
				if last.seg == x.seg && last.dst+int64(len(last.src)) == x.dst &&
					unsafe.Add(unsafe.Pointer(unsafe.SliceData(last.src)), len(last.src)) == unsafe.Pointer(unsafe.SliceData(x.src)) {
					last.src = unsafe.Slice(unsafe.SliceData(last.src), len(last.src)+len(x.src))
					continue
				}
			}
			out = append(out, x)
		}
	}
	return out, nil
}

func hasConversion(c Chunk) bool {
	for _, p := range c.Pieces {
		if p.Src.DType != p.Wire {
			return true
		}
	}
	return false
}

// populate faults b's page tables in (MADV_POPULATE_READ), or, on kernels
// without it, by reading one byte per page.
func populate(b []byte) {
	if len(b) == 0 {
		return
	}
	if err := syscall.Madvise(b, madvPopulateRead); err == nil || !errors.Is(err, syscall.EINVAL) {
		// EINVAL is an old kernel; other errors (EFAULT past the end of
		// the file) leave the pages to fault on first use, as without it.
		return
	}
	pg := os.Getpagesize()
	var sink byte
	for i := 0; i < len(b); i += pg {
		sink += b[i]
	}
	_ = sink
}

// registrar page-locks segments in first-use order with one goroutine per
// helper device (its own OS thread, current device set), ahead of the
// copies that wait for them.
type registrar struct {
	segs     *segments
	helpers  []*nccl.Device
	prefault bool

	// Early unregistration: segments whose copies are all enqueued arrive
	// on rel with the event that follows their last copy; one goroutine
	// (on its own thread, unreg) waits for the event and unregisters them
	// beside the remaining copies.
	unreg   *nccl.Device
	rel     chan released
	relDone chan struct{}
	quit    chan struct{}
	unregT  time.Duration // summed cudaHostUnregister time, under mu
	early   int           // segments unregistered early, under mu
	unregE  error         // first unregistration failure, under mu

	next  atomic.Int64
	stopc chan struct{}
	wg    sync.WaitGroup

	mu         sync.Mutex
	failed     error // first registration failure: stop registering
	register   time.Duration
	prefaulted time.Duration
	registered int64
	count      int
}

type released struct {
	s     *segment
	after nccl.Event
}

// newRegistrar registers with helpers; unreg, if not nil, unregisters
// segments early (release).
func newRegistrar(segs *segments, helpers []*nccl.Device, unreg *nccl.Device, prefault bool) *registrar {
	return &registrar{segs: segs, helpers: helpers, unreg: unreg, prefault: prefault, stopc: make(chan struct{}),
		rel: make(chan released, len(segs.list)), relDone: make(chan struct{}), quit: make(chan struct{})}
}

func (r *registrar) start(ctx context.Context) {
	for _, h := range r.helpers {
		r.wg.Add(1)
		go r.work(ctx, h)
	}
	if r.unreg == nil {
		close(r.relDone)
		return
	}
	go r.unregisterEarly()
}

// issued records that copies enqueued before event after read n more bytes
// of s; once all of s is enqueued, it is handed to the early unregistration.
func (r *registrar) issued(s *segment, n int64, after nccl.Event) {
	s.left -= n
	if s.left == 0 && r.unreg != nil {
		r.rel <- released{s, after} // buffered for every segment: never blocks
	}
}

// unregisterEarly unregisters released segments once the copies reading
// them completed. An event recorded again later (its slot reused) answers
// for the later record, which completes after the earlier one on the same
// stream, so waiting on it is late but never early.
func (r *registrar) unregisterEarly() {
	defer close(r.relDone)
	for x := range r.rel {
		interval := 20 * time.Microsecond
		for {
			var done bool
			err := r.unreg.Do(context.Background(), func(api nccl.API) error {
				var err error
				done, err = api.EventQuery(x.after)
				return err
			})
			if err != nil {
				r.mu.Lock()
				if r.unregE == nil {
					r.unregE = fmt.Errorf("staging: waiting to unregister a segment: %w", err)
				}
				r.mu.Unlock()
				break
			}
			if done {
				t := time.Now()
				err := r.unreg.Do(context.Background(), func(api nccl.API) error { return api.HostUnregister(x.s.b) })
				d := time.Since(t)
				r.mu.Lock()
				r.unregT += d
				if err == nil {
					x.s.reg = false
					r.early++
				} else if r.unregE == nil {
					r.unregE = fmt.Errorf("staging: cudaHostUnregister of %d bytes at %p: %w", len(x.s.b), unsafe.SliceData(x.s.b), err)
				}
				r.mu.Unlock()
				break
			}
			select {
			case <-r.quit:
				return // the copy stream is stuck: leave the rest registered
			case <-time.After(interval):
			}
			interval = min(2*interval, 500*time.Microsecond)
		}
	}
}

// usable is false once a registration failed: later chunks go straight to
// the host copy instead of waiting for segments that will not come.
func (r *registrar) usable() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed == nil
}

func (r *registrar) work(ctx context.Context, h *nccl.Device) {
	defer r.wg.Done()
	for {
		i := r.next.Add(1) - 1
		if i >= int64(len(r.segs.list)) {
			return
		}
		s := r.segs.list[i]
		r.mu.Lock()
		cause := r.failed
		r.mu.Unlock()
		if cause == nil {
			select {
			case <-r.stopc:
				cause = errors.New("registration stopped")
			default:
			}
		}
		if cause != nil {
			s.err = fmt.Errorf("segment not registered: %w", cause)
			close(s.ready)
			continue
		}
		if r.prefault {
			t := time.Now()
			populate(s.b)
			d := time.Since(t)
			r.mu.Lock()
			r.prefaulted += d
			r.mu.Unlock()
		}
		t := time.Now()
		err := h.Do(ctx, func(api nccl.API) error { return api.HostRegister(s.b, RegisterFlags) })
		d := time.Since(t)
		r.mu.Lock()
		r.register += d
		if err == nil {
			s.reg = true
			r.registered += int64(len(s.b))
			r.count++
		} else {
			s.err = fmt.Errorf("cudaHostRegister of %d bytes at %p (flags %#x): %w", len(s.b), unsafe.SliceData(s.b), RegisterFlags, err)
			if r.failed == nil && ctx.Err() == nil {
				r.failed = s.err
			}
		}
		r.mu.Unlock()
		close(s.ready)
	}
}

// wait returns once s is registered, with its registration error, or ctx's.
func (r *registrar) wait(ctx context.Context, s *segment) error {
	select {
	case <-s.ready:
		return s.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// stop ends registration after the segments in progress and waits for the
// workers.
func (r *registrar) stop() {
	close(r.stopc)
	r.wg.Wait()
}

// unregister waits for the early unregistration to finish its queue, then
// releases every segment still registered, spread over the helpers. Call
// it only once no copy can still read the segments (after stop).
func (r *registrar) unregister() error {
	close(r.rel)
	<-r.relDone
	var regs []*segment
	for _, s := range r.segs.list {
		if s.reg {
			regs = append(regs, s)
		}
	}
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	var next atomic.Int64
	for _, h := range r.helpers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(regs)) {
					return
				}
				s := regs[i]
				t := time.Now()
				err := h.Do(context.Background(), func(api nccl.API) error { return api.HostUnregister(s.b) })
				d := time.Since(t)
				mu.Lock()
				r.mu.Lock()
				r.unregT += d
				r.mu.Unlock()
				if err != nil && first == nil {
					first = fmt.Errorf("staging: cudaHostUnregister of %d bytes at %p: %w", len(s.b), unsafe.SliceData(s.b), err)
				}
				if err == nil {
					s.reg = false
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if first == nil {
		first = r.unregE
	}
	return first
}

// unregistered is the number of segments unregistered early so far.
func (r *registrar) unregistered() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.early
}

// abandon stops the early unregistration without waiting for more events:
// the copy stream did not drain, so what is registered stays registered.
func (r *registrar) abandon() {
	close(r.quit)
	close(r.rel)
	<-r.relDone
}

// prefaulter populates segments in first-use order with a few goroutines,
// ahead of the host copy, so that the copy workers find the page tables
// filled instead of taking the faults themselves. Nobody waits for it: a
// copy that overtakes it faults as it would have anyway.
type prefaulter struct {
	segs  []*segment
	next  atomic.Int64
	stopc chan struct{}
	wg    sync.WaitGroup
	total atomic.Int64 // nanoseconds
}

func startPrefault(segs []*segment, workers int) *prefaulter {
	p := &prefaulter{segs: segs, stopc: make(chan struct{})}
	for i := 0; i < workers; i++ {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			for {
				j := p.next.Add(1) - 1
				if j >= int64(len(p.segs)) {
					return
				}
				select {
				case <-p.stopc:
					return
				default:
				}
				t := time.Now()
				populate(p.segs[j].b)
				p.total.Add(int64(time.Since(t)))
			}
		}()
	}
	return p
}

// stop waits for the segments in progress and returns the time spent.
func (p *prefaulter) stop() time.Duration {
	close(p.stopc)
	p.wg.Wait()
	return time.Duration(p.total.Load())
}
