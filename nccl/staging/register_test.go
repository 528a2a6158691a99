package staging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/safetensors"
)

// pageTensors are large enough for several one-page registration segments
// and several windows per chunk, with odd sizes so that segment and window
// boundaries fall inside elements.
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
	p, err := New(context.Background(), dev, MaxChunk(chunks), opts)
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
	if res.Copied+res.Direct != res.Bytes {
		t.Errorf("copied %d + direct %d != %d bytes", res.Copied, res.Direct, res.Bytes)
	}
	return res
}

func TestStageModesByteExact(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	pg := int64(os.Getpagesize())
	for _, packed := range []bool{true, false} {
		for _, toBF16 := range []bool{false, true} {
			chunks := oracle(t, ck, packed, 9000, toBF16)
			for _, opts := range []Options{
				{Mode: ModeCopy, WindowBytes: -1, CopyWorkers: 3, SplitBytes: 1000},
				{Mode: ModeCopy, WindowBytes: 1000, CopyWorkers: 3},
				{Mode: ModeCopy, WindowBytes: 500, PinnedBytes: 1500, CopyWorkers: 4, SplitBytes: 300},
				{Mode: ModeCopy, WindowBytes: 777, CopyWorkers: 2, PrefaultWorkers: 2, RegisterSegmentBytes: pg},
				{Mode: ModeCopy, HostAllocFlags: nccl.HostAllocPortable | nccl.HostAllocWriteCombined},
				{Mode: ModeRegister, RegisterSegmentBytes: pg, WindowBytes: 3000, RegisterWorkers: 3},
				{Mode: ModeRegister, RegisterSegmentBytes: 2 * pg, WindowBytes: -1, RegisterWorkers: 1, PrefaultWorkers: 1},
				{Mode: ModeRegister},
				{Mode: ModeRegister, Unregister: UnregisterAtEnd, RegisterSegmentBytes: pg, WindowBytes: 3000},
				{Mode: ModeRegister, CopyFraction: 0.4, RegisterSegmentBytes: pg, WindowBytes: 2000, CopyWorkers: 2},
				{Mode: ModeRegister, CopyFraction: 1, RegisterSegmentBytes: pg},
			} {
				name := fmt.Sprintf("packed=%v/bf16=%v/%v-w%d-p%d-seg%d-pf%d-%v-copy%.1f", packed, toBF16, opts.Mode, opts.WindowBytes, opts.PinnedBytes, opts.RegisterSegmentBytes, opts.PrefaultWorkers, opts.Unregister, opts.CopyFraction)
				t.Run(name, func(t *testing.T) {
					f := nccltest.NewFake(nccltest.Config{OpDelay: 50 * time.Microsecond})
					var regs atomic.Int64
					f.OnHostRegister(func(b []byte, flags uint) error {
						regs.Add(1)
						if flags != nccl.HostRegisterReadOnly|nccl.HostRegisterPortable {
							t.Errorf("registered with flags %#x", flags)
						}
						if uintptr(len(b))%uintptr(pg) != 0 {
							t.Errorf("registered %d bytes, not whole pages", len(b))
						}
						return nil
					})
					res := stageAll(t, f, ck, ck, chunks, opts)
					if res.Fallback != "" {
						t.Errorf("unexpected fallback: %s", res.Fallback)
					}
					if opts.Mode == ModeRegister && opts.CopyFraction >= 1 {
						if res.Direct != 0 || res.Segments != 0 {
							t.Errorf("CopyFraction 1 sent %d bytes directly in %d segments", res.Direct, res.Segments)
						}
					} else if opts.Mode == ModeRegister {
						if opts.CopyFraction > 0 && res.Copied == 0 {
							t.Errorf("CopyFraction %v copied nothing: %v", opts.CopyFraction, res)
						}
						if res.Direct == 0 || regs.Load() == 0 || res.Segments != int(regs.Load()) {
							t.Errorf("register mode moved %d bytes directly in %d registrations: %v", res.Direct, regs.Load(), res)
						}
						if !toBF16 && opts.CopyFraction == 0 && res.Copied != 0 {
							t.Errorf("register mode without conversions copied %d bytes", res.Copied)
						}
						if res.Unregister <= 0 {
							t.Errorf("unregistration not timed: %v", res)
						}
						early := opts.Unregister != UnregisterAtEnd
						if early && opts.RegisterSegmentBytes == pg && res.EarlyUnregistered == 0 {
							t.Errorf("nothing unregistered before the end: %v", res)
						}
						if !early && res.EarlyUnregistered != 0 {
							t.Errorf("unregistered early with UnregisterAtEnd: %v", res)
						}
					} else if res.Direct != 0 || regs.Load() != 0 {
						t.Errorf("copy mode registered: %v", res)
					}
					if opts.WindowBytes > 0 && opts.WindowBytes < 2000 && res.Windows <= res.Chunks {
						t.Errorf("%d windows for %d chunks with %d-byte windows", res.Windows, res.Chunks, opts.WindowBytes)
					}
					if opts.PrefaultWorkers > 0 && opts.Mode == ModeRegister && res.Prefault <= 0 {
						t.Errorf("prefault not timed: %v", res)
					}
					if res.H2D <= 0 {
						t.Errorf("no H2D time: %v", res)
					}
				})
			}
		}
	}
}

// The wire sequence through a real broadcast, in register mode, with the
// copies running out of step with the host.
func TestBroadcastRegisterMode(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	pg := int64(os.Getpagesize())
	for _, packed := range []bool{true, false} {
		for _, frac := range []float64{0, 0.5} {
			chunks := oracle(t, ck, packed, 9000, true)
			e := setup(t, nccltest.Config{OpDelay: 200 * time.Microsecond}, MaxChunk(chunks),
				Options{Mode: ModeRegister, RegisterSegmentBytes: pg, WindowBytes: 5000, CopyWorkers: 2, SplitBytes: 700, CopyFraction: frac})
			res, err := e.pipe.Broadcast(context.Background(), e.comm, ck, chunks)
			if err != nil {
				t.Fatal(err)
			}
			checkWire(t, e.fake, ck, chunks)
			if res.Direct == 0 || res.Copied == 0 || res.Broadcast <= 0 {
				t.Errorf("packed=%v: want direct and converted (copied) bytes: %v", packed, res)
			}
		}
	}
}

// Registration refused from the start (a platform without read-only
// registration, say) or partway (out of lockable memory): the remaining
// bytes go through the host copy, byte-exact, and the reason is reported.
func TestRegisterFallback(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	pg := int64(os.Getpagesize())
	chunks := oracle(t, ck, true, 9000, false)
	for _, failAt := range []int64{1, 3} {
		t.Run(fmt.Sprint("fail at registration ", failAt), func(t *testing.T) {
			f := nccltest.NewFake(nccltest.Config{OpDelay: 50 * time.Microsecond})
			var n atomic.Int64
			f.OnHostRegister(func(b []byte, flags uint) error {
				if n.Add(1) >= failAt {
					return &nccl.Error{Func: "cudaHostRegister", Code: nccl.CudaErrorNotSupported, Detail: "injected"}
				}
				return nil
			})
			// One registration thread: registrations happen in order, so
			// failAt 3 fails partway through the first chunk.
			res := stageAll(t, f, ck, ck, chunks, Options{Mode: ModeRegister, RegisterSegmentBytes: pg, WindowBytes: 2000, RegisterWorkers: 1})
			if !strings.Contains(res.Fallback, "cudaErrorNotSupported") || !strings.Contains(res.Fallback, "injected") {
				t.Errorf("fallback reason %q", res.Fallback)
			}
			if failAt == 1 && (res.Direct != 0 || res.Segments != 0) {
				t.Errorf("nothing registered, yet %v", res)
			}
			if failAt > 1 && (res.Direct == 0 || res.Copied == 0) {
				t.Errorf("want some bytes direct and the rest copied: %v", res)
			}
			if n.Load() > failAt {
				t.Errorf("%d registrations attempted after the first failure (%d)", n.Load()-failAt, failAt)
			}
		})
	}
	t.Run("not a mapped source", func(t *testing.T) {
		f := nccltest.NewFake(nccltest.Config{})
		src := &instrumented{Source: ck, reads: map[string]bool{}, read: make(chan string, 1000)}
		res := stageAll(t, f, ck, src, chunks, Options{Mode: ModeRegister})
		if !strings.Contains(res.Fallback, "not a mapped checkpoint") || res.Direct != 0 {
			t.Errorf("result %v", res)
		}
	})
}

// A cancelled transfer in register mode still unregisters everything it
// registered (and leaves nothing registered that a copy may read).
func TestRegisterCancelUnregisters(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), pageTensors)
	pg := int64(os.Getpagesize())
	chunks := oracle(t, ck, false, 0, false)
	e := setup(t, nccltest.Config{}, MaxChunk(chunks), Options{Mode: ModeRegister, RegisterSegmentBytes: pg})
	e.fake.OnCollective(func(c nccltest.Call) nccltest.Fault { return nccltest.Fault{Stall: c.Index == 3} })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := e.pipe.Broadcast(ctx, e.comm, ck, chunks)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v", err)
	}
	// setup's cleanup checks the Fake for leftover registrations.
}

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
	res := stageAll(t, f, ck, ck, chunks, Options{Mode: ModeCopy, WindowBytes: 1000, CopyWorkers: 2})
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
