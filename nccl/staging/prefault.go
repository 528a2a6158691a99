package staging

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// madvPopulateRead is MADV_POPULATE_READ (Linux 5.14): fault the range's
// page tables in without copying anything. Not in package syscall.
const madvPopulateRead = 22

// prefaultSegmentBytes is the unit of prefaulting, a multiple of every page
// size: one goroutine populates one segment at a time.
const prefaultSegmentBytes = 64 << 20

type segKey struct {
	base uintptr
	i    int64
}

// prefaultSegments cuts the mappings holding chunks' bytes into
// page-aligned, non-overlapping segments of size bytes (the last one of a
// mapping ends at its last page), in the order the chunks first touch them;
// tensors that share a segment share it.
func prefaultSegments(src MappedSource, size int64, chunks []Chunk) ([][]byte, error) {
	var list [][]byte
	seen := map[segKey]bool{}
	for _, c := range chunks {
		for _, p := range c.Pieces {
			n := min(p.Src.Size, c.Bytes-p.Offset)
			if n <= 0 {
				continue
			}
			m, off, err := src.Mapping(p.Src)
			if err != nil {
				return nil, fmt.Errorf("staging: tensor %q: mapping: %w", p.Src.Name, err)
			}
			if off < 0 || off+p.Src.Size > int64(len(m)) {
				return nil, fmt.Errorf("staging: tensor %q: bytes %d..%d outside its %d-byte mapping", p.Src.Name, off, off+p.Src.Size, len(m))
			}
			mp := unsafe.Pointer(unsafe.SliceData(m))
			base := uintptr(mp)
			// The mapping extends to the end of its last page; whole pages
			// keep every segment page aligned at both ends.
			pg := int64(os.Getpagesize())
			mlen := (int64(len(m)) + pg - 1) / pg * pg
			for pos, end := off, off+n; pos < end; {
				i := pos / size
				k := segKey{base, i}
				if !seen[k] {
					seen[k] = true
					lo, hi := i*size, min((i+1)*size, mlen)
					list = append(list, unsafe.Slice((*byte)(unsafe.Add(mp, lo)), hi-lo))
				}
				pos = min((i+1)*size, end)
			}
		}
	}
	return list, nil
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

// prefaulter populates segments in first-use order with a few goroutines,
// ahead of the host copy, so that the copy workers find the page tables
// filled instead of taking the faults themselves. Nobody waits for it: a
// copy that overtakes it faults as it would have anyway.
type prefaulter struct {
	segs  [][]byte
	next  atomic.Int64
	stopc chan struct{}
	wg    sync.WaitGroup
	total atomic.Int64 // nanoseconds
}

func startPrefault(segs [][]byte, workers int) *prefaulter {
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
				populate(p.segs[j])
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
