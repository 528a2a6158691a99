package staging

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/safetensors"
)

// pageTensors are large enough for several one-page segments and several
// windows per chunk, with odd sizes so that segment and window boundaries
// fall inside elements.
var pageTensors = []testTensor{
	{"a", safetensors.BF16, []int64{3001}},
	{"tiny", safetensors.U8, []int64{3}},
	{"b", safetensors.F32, []int64{2049}},
	{"scalar", safetensors.I64, nil},
	{"c", safetensors.BF16, []int64{7, 1001}},
	{"empty", safetensors.BF16, []int64{0}},
	{"d", safetensors.F16, []int64{5000}},
}

// stageAll stages chunks with one buffer per chunk, so that every chunk is
// still in its device buffer afterwards, and checks each byte for byte.
func stageAll(t *testing.T, f *nccltest.Fake, ck *safetensors.Checkpoint, src Source, chunks []Chunk, opts Options) Result {
	t.Helper()
	dev, err := nccl.OpenDevice(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	opts.Buffers = len(chunks)
	p, err := NewStager(context.Background(), dev, MaxChunk(chunks), opts)
	if err != nil {
		t.Fatal(err)
	}
	res, err := p.Stage(context.Background(), src, chunks)
	if err != nil {
		t.Fatal(err)
	}
	for k, c := range chunks {
		got, err := f.DeviceBytes(p.devb[k], int(c.Bytes))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, wireBytes(t, ck, c)) {
			t.Fatalf("chunk %d (%s): wrong bytes on the device (%v)", k, firstName(c), res)
		}
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
	t.Logf("%v", res)
	if res.Copied != res.Bytes {
		t.Errorf("copied %d of %d bytes", res.Copied, res.Bytes)
	}
	return res
}

func TestStageByteExact(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	for _, packed := range []bool{true, false} {
		for _, toBF16 := range []bool{false, true} {
			chunks := oracle(t, ck, packed, 9000, toBF16)
			for _, opts := range []Options{
				{WindowBytes: -1, CopyWorkers: 3, SplitBytes: 1000},
				{WindowBytes: 1000, CopyWorkers: 3},
				{WindowBytes: 500, PinnedBytes: 1500, CopyWorkers: 4, SplitBytes: 300},
				{WindowBytes: 777, CopyWorkers: 2, PrefaultWorkers: 2},
				{HostAllocFlags: nccl.HostAllocPortable | nccl.HostAllocWriteCombined},
				{},
			} {
				name := fmt.Sprintf("packed=%v/bf16=%v/w%d-p%d-pf%d-flags%d", packed, toBF16, opts.WindowBytes, opts.PinnedBytes, opts.PrefaultWorkers, opts.HostAllocFlags)
				t.Run(name, func(t *testing.T) {
					f := nccltest.NewFake(nccltest.Config{OpDelay: 50 * time.Microsecond})
					res := stageAll(t, f, ck, ck, chunks, opts)
					if opts.WindowBytes > 0 && opts.WindowBytes < 2000 && res.Windows <= res.Chunks {
						t.Errorf("%d windows for %d chunks with %d-byte windows", res.Windows, res.Chunks, opts.WindowBytes)
					}
					if res.H2D <= 0 {
						t.Errorf("no H2D time: %v", res)
					}
				})
			}
		}
	}
}

// Prefault segments are whole pages, disjoint, in first-use order, and
// cover every byte the chunks read from the mapping.
func TestPrefaultSegments(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	pg := int64(os.Getpagesize())
	chunks := oracle(t, ck, false, 0, false)
	for _, size := range []int64{pg, 2 * pg, prefaultSegmentBytes} {
		segs, err := prefaultSegments(ck, size, chunks)
		if err != nil {
			t.Fatal(err)
		}
		type span struct{ lo, hi uintptr }
		var spans []span
		for i, s := range segs {
			lo := unsafeAddr(s)
			if int64(lo)%pg != 0 || int64(len(s))%pg != 0 || int64(len(s)) > size || len(s) == 0 {
				t.Fatalf("size %d: segment %d at %#x is %d bytes: not whole pages of at most %d", size, i, lo, len(s), size)
			}
			for _, o := range spans {
				if lo < o.hi && o.lo < lo+uintptr(len(s)) {
					t.Fatalf("size %d: segment %d overlaps another", size, i)
				}
			}
			spans = append(spans, span{lo, lo + uintptr(len(s))})
		}
		for _, c := range chunks {
			for _, p := range c.Pieces {
				b, err := ck.Bytes(p.Src)
				if err != nil {
					t.Fatal(err)
				}
				for j := range b {
					a := unsafeAddr(b[j:])
					in := false
					for _, s := range spans {
						in = in || (s.lo <= a && a < s.hi)
					}
					if !in {
						t.Fatalf("size %d: byte %d of %q in no segment", size, j, p.Src.Name)
					}
				}
			}
		}
		if size == pg && len(segs) < 2 {
			t.Errorf("one-page segments: only %d", len(segs))
		}
	}
}

func unsafeAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// parts cut where the window wants, never inside a converted element, and
// tile the chunk from the resume offset on.
func TestCopyPartsTileWindows(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	chunks := oracle(t, ck, true, 1<<30, true)
	c := chunks[0]
	dst := make([]byte, c.Bytes)
	var mu sync.Mutex
	for _, win := range []int64{-1, 1, 100, 999, 4096} {
		h := &hostCopier{src: ck, workers: 3, partBytes: 333, window: win}
		parts, wins, err := h.parts(c, 0, c.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		off := int64(0)
		for i, w := range wins {
			if w.off != off || w.end <= w.off {
				t.Fatalf("window %d %v does not follow %d", i, w, off)
			}
			if win > 0 && w.end-w.off >= win+8 {
				t.Fatalf("window %d is %d bytes, over %d plus an element", i, w.end-w.off, win)
			}
			off = w.end
		}
		if off != c.Bytes {
			t.Fatalf("windows end at %d of %d", off, c.Bytes)
		}
		// Two slots in plain memory, handed back as soon as a window is
		// "copied" (into dst), so the workers wait for slots.
		slotBytes, _ := ringGeometry(win, c.Bytes, 1)
		ring := plainRing(slotBytes, 2)
		var order []int
		if _, err := h.fill(context.Background(), parts, wins, ring, func(ws, slots []int) (int, error) {
			for i, w := range ws {
				mu.Lock()
				order = append(order, w)
				mu.Unlock()
				copy(dst[wins[w].off:wins[w].end], ring.slot(slots[i]))
				ring.free <- slots[i]
			}
			return 0, nil
		}); err != nil {
			t.Fatal(err)
		}
		// Every window ready exactly once (in the order the copies end).
		seen := make([]bool, len(wins))
		for _, w := range order {
			if seen[w] {
				t.Fatalf("window %d ready twice: %v", w, order)
			}
			seen[w] = true
		}
		if len(order) != len(wins) {
			t.Fatalf("%d of %d windows ready", len(order), len(wins))
		}
		if !bytes.Equal(dst, wireBytes(t, ck, c)) {
			t.Fatalf("window %d: wrong bytes", win)
		}
	}
	// Resuming inside a converted tensor is refused rather than garbled.
	var conv Piece
	for _, p := range c.Pieces {
		if p.Src.DType != p.Wire {
			conv = p
			break
		}
	}
	h := &hostCopier{src: ck, workers: 1, partBytes: 1 << 20}
	if _, _, err := h.parts(c, conv.Offset+1, c.Bytes); err == nil {
		t.Fatal("resumed a conversion at an odd byte")
	}
}

// TestCopyTimeIsReported guards the host-copy time that the GPU bench's
// "host copy GB/s" and Overlap are computed from (it read 0 once).
func TestCopyTimeIsReported(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	chunks := oracle(t, ck, true, 9000, false)
	f := nccltest.NewFake(nccltest.Config{OpDelay: 50 * time.Microsecond})
	res := stageAll(t, f, ck, ck, chunks, Options{WindowBytes: 1000, CopyWorkers: 2})
	if res.Copied == 0 || res.HostCopy <= 0 {
		t.Fatalf("copied %d bytes in %v: the host copy time is lost", res.Copied, res.HostCopy)
	}
}

// plainRing is a hostRing in ordinary memory with no events, for tests that
// hand slots back themselves.
func plainRing(slotBytes int64, slots int) *hostRing {
	stride := slotBytes + ringPad
	r := &hostRing{mem: make([]byte, stride*int64(slots)), slotBytes: slotBytes, stride: stride,
		ev: make([]nccl.Event, slots), free: make(chan int, slots)}
	r.reset()
	return r
}
