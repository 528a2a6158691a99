package staging

import (
	"context"
	"fmt"
	"sync"

	"github.com/rlflow/rlflow/nccl/safetensors"
)

// Source is where tensor bytes come from; *safetensors.Checkpoint is one
// (zero-copy slices of its read-only mappings).
type Source interface {
	Bytes(t safetensors.TensorInfo) ([]byte, error)
}

type copyPart struct {
	name     string
	dst, src []byte
	conv     func(dst, src []byte) error
}

// hostCopier fills pinned buffers from a Source with a few goroutines:
// memcpy from a page-cache mmap is bound by page faults and memory
// bandwidth per core, so one core cannot keep up with a PCIe Gen5 copy.
type hostCopier struct {
	src      Source
	workers  int
	minSplit int64 // copies larger than this are split across workers
}

// parts cuts the chunk's pieces into jobs: small tensors whole, large ones
// split at element boundaries into about one part per worker.
func (h *hostCopier) parts(c Chunk, dst []byte) ([]copyPart, error) {
	var out []copyPart
	for _, p := range c.Pieces {
		src, err := h.src.Bytes(p.Src)
		if err != nil {
			return nil, err
		}
		if int64(len(src)) != p.Src.Size {
			return nil, fmt.Errorf("staging: tensor %q: source has %d bytes, want %d", p.Src.Name, len(src), p.Src.Size)
		}
		conv, err := converter(p.Src.DType, p.Wire)
		if err != nil {
			return nil, fmt.Errorf("staging: tensor %q: %w", p.Src.Name, err)
		}
		d := dst[p.Offset : p.Offset+p.Bytes]
		si, di := int64(p.Src.DType.ItemSize()), int64(p.Wire.ItemSize())
		elems := p.Src.Size / si
		n := int64(1)
		if h.workers > 1 && p.Src.Size > h.minSplit {
			n = min(int64(h.workers), p.Src.Size/max(h.minSplit/2, 1))
		}
		per := (elems + n - 1) / n
		for e := int64(0); e < elems; e += per {
			end := min(e+per, elems)
			out = append(out, copyPart{name: p.Src.Name, dst: d[e*di : end*di], src: src[e*si : end*si], conv: conv})
		}
	}
	return out, nil
}

// fill copies chunk c into dst (at least c.Bytes long).
func (h *hostCopier) fill(ctx context.Context, c Chunk, dst []byte) error {
	parts, err := h.parts(c, dst)
	if err != nil {
		return err
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
	workers := min(h.workers, len(parts))
	if workers <= 1 {
		for _, p := range parts {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := run(p); err != nil {
				return err
			}
		}
		return nil
	}
	jobs := make(chan copyPart)
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	stop := make(chan struct{})
	fail := func(err error) {
		once.Do(func() { first = err; close(stop) })
	}
	for i := 0; i < workers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range jobs {
				if err := run(p); err != nil {
					fail(err)
				}
			}
		}()
	}
feed:
	for _, p := range parts {
		select {
		case jobs <- p:
		case <-stop:
			break feed
		case <-ctx.Done():
			fail(ctx.Err())
			break feed
		}
	}
	close(jobs)
	wg.Wait()
	return first
}
