package staging

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/rlflow/rlflow/nccl/safetensors"
)

// Source is where tensor bytes come from; *safetensors.Checkpoint is one
// (zero-copy slices of its read-only mappings).
type Source interface {
	Bytes(t safetensors.TensorInfo) ([]byte, error)
}

// MappedSource is a Source whose bytes are slices of read-only, page-aligned
// file mappings (*safetensors.Checkpoint is one): ModeRegister page-locks
// those mappings in place instead of copying them.
type MappedSource interface {
	Source
	// Mapping returns the whole mapping holding t's bytes and the offset of
	// t's first byte in it.
	Mapping(t safetensors.TensorInfo) ([]byte, int64, error)
}

type copyPart struct {
	name     string
	dst, src []byte
	conv     func(dst, src []byte) error
	win      int // the window this part belongs to
}

// span is a byte range [off, end) of a chunk.
type span struct{ off, end int64 }

// hostCopier fills pinned buffers from a Source with a few goroutines:
// memcpy from a page-cache mmap is bound by page faults and memory
// bandwidth per core, so one core cannot keep up with a PCIe Gen5 copy.
type hostCopier struct {
	src       Source
	workers   int
	partBytes int64 // most bytes (on the wire) of one job
	window    int64 // window size; <= 0: the whole chunk is one window
}

// parts cuts the chunk's bytes [from, to) into jobs of at most
// partBytes, at element boundaries (byte boundaries where nothing is
// converted), and groups consecutive jobs into windows of at least
// h.window bytes. Jobs are in wire order, so each window is a contiguous
// range of the chunk. from and to must not fall inside a converted tensor.
func (h *hostCopier) parts(c Chunk, dst []byte, from, to int64) ([]copyPart, []span, error) {
	var out []copyPart
	var wins []span
	win, acc := 0, int64(0)
	add := func(p copyPart, off int64) {
		if len(wins) == win {
			wins = append(wins, span{off, off})
		}
		wins[win].end = off + int64(len(p.dst))
		p.win = win
		out = append(out, p)
		acc += int64(len(p.dst))
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
		d := dst[p.Offset : p.Offset+p.Bytes]
		// Unconverted bytes are copied as bytes, so a piece may be cut
		// anywhere (a registered segment ends at a page, not an element).
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
			add(copyPart{name: p.Src.Name, dst: d[e*di : end*di], src: src[e*si : end*si], conv: conv}, p.Offset+e*di)
			e = end
		}
	}
	return out, wins, nil
}

// fill copies parts (from parts, into a pinned buffer) with the copier's
// workers and calls ready(w) on the calling goroutine, in window order, as
// soon as every part of window w is in place, while the workers go on with
// the next windows. It returns the first error of a part, of ready, or of
// ctx, after every worker stopped.
func (h *hostCopier) fill(ctx context.Context, parts []copyPart, nwin int, ready func(w int) error) error {
	if nwin == 0 {
		return nil
	}
	left := make([]atomic.Int64, nwin)
	done := make([]chan struct{}, nwin)
	for i := range done {
		done[i] = make(chan struct{})
	}
	for _, p := range parts {
		left[p.win].Add(1)
	}
	var once sync.Once
	var first error
	stop := make(chan struct{})
	fail := func(err error) {
		once.Do(func() { first = err; close(stop) })
	}
	run := func(p copyPart) error {
		if p.conv == nil {
			copy(p.dst, p.src)
			return nil
		}
		if err := p.conv(p.dst, p.src); err != nil {
			return fmt.Errorf("staging: tensor %q: %w", p.name, err)
		}
		return nil
	}
	jobs := make(chan copyPart)
	var wg sync.WaitGroup
	for i := 0; i < max(min(h.workers, len(parts)), 1); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range jobs {
				if err := run(p); err != nil {
					fail(err)
					continue
				}
				if left[p.win].Add(-1) == 0 {
					close(done[p.win])
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(jobs)
		for _, p := range parts {
			select {
			case jobs <- p:
			case <-stop:
				return
			case <-ctx.Done():
				fail(ctx.Err())
				return
			}
		}
	}()
	for w := 0; w < nwin; w++ {
		select {
		case <-done[w]:
			if err := ready(w); err != nil {
				fail(err)
			}
		case <-stop:
		}
		select {
		case <-stop:
			w = nwin // a part, ready or ctx failed: stop issuing
		default:
		}
	}
	wg.Wait()
	return first
}
