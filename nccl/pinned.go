package nccl

import (
	"sort"
	"sync"
	"unsafe"
)

// PinnedSet remembers which host ranges are page-locked, so that an
// asynchronous copy from anything else (Go memory above all: C must not
// keep Go pointers past the call) is refused instead of racing the GC.
type PinnedSet struct {
	mu    sync.Mutex
	spans []pinnedSpan // sorted by start, non-overlapping
}

type pinnedSpan struct {
	start, end uintptr
	alloc      bool // from HostAlloc (else HostRegister)
}

func spanOf(b []byte) (uintptr, uintptr) {
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return p, p + uintptr(len(b))
}

func (p *PinnedSet) Add(b []byte, alloc bool) {
	s, e := spanOf(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	i := sort.Search(len(p.spans), func(i int) bool { return p.spans[i].start >= s })
	p.spans = append(p.spans, pinnedSpan{})
	copy(p.spans[i+1:], p.spans[i:])
	p.spans[i] = pinnedSpan{s, e, alloc}
}

func (p *PinnedSet) Remove(b []byte, alloc bool) bool {
	s, _ := spanOf(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	i := sort.Search(len(p.spans), func(i int) bool { return p.spans[i].start >= s })
	if i == len(p.spans) || p.spans[i].start != s || p.spans[i].alloc != alloc {
		return false
	}
	p.spans = append(p.spans[:i], p.spans[i+1:]...)
	return true
}

// Overlaps reports whether any byte of b is already pinned: CUDA refuses to
// register a range that shares a page with an earlier registration.
func (p *PinnedSet) Overlaps(b []byte) bool {
	s, e := spanOf(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, sp := range p.spans {
		if sp.start < e && s < sp.end {
			return true
		}
	}
	return false
}

// Registered counts the HostRegister spans.
func (p *PinnedSet) Registered() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, sp := range p.spans {
		if !sp.alloc {
			n++
		}
	}
	return n
}

func (p *PinnedSet) Contains(b []byte) bool {
	s, e := spanOf(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	i := sort.Search(len(p.spans), func(i int) bool { return p.spans[i].start > s }) - 1
	return i >= 0 && p.spans[i].start <= s && e <= p.spans[i].end
}
