package staging

import (
	"fmt"
	"time"
)

// Result describes one run.
type Result struct {
	Bytes   int64 // bytes on the wire (or staged)
	Tensors int
	Chunks  int // broadcasts (or staged chunks)
	Buffers int
	// BufferBytes is the size of each device buffer.
	BufferBytes int64
	// Slots and SlotBytes describe the host copy's pinned ring.
	Slots     int
	SlotBytes int64
	// Windows is the number of host-to-device copy windows (see
	// Options.WindowBytes).
	Windows int
	// Wall is the run from the first host copy to the completion of the
	// last broadcast (or host-to-device copy); buffer allocation excluded.
	Wall time.Duration
	// Copied is the bytes that went through the host copy into pinned
	// slots: every staged byte.
	Copied int64
	// HostCopy is the wall time spent copying (and converting) from the
	// checkpoint into pinned buffers, summed over chunks.
	HostCopy time.Duration
	// HostWait is the time the host waited for a device buffer or a
	// pinned slot to come free (slot waits summed over windows).
	HostWait time.Duration
	// H2D and Broadcast are GPU times (CUDA events) summed over chunks:
	// host-to-device copies (estimated per chunk from one window in
	// timeEvery, scaled to the chunk's bytes), and broadcasts from the
	// moment their copy was done.
	H2D, Broadcast time.Duration
	// Prefault is the time spent in madvise(MADV_POPULATE_READ), summed
	// over the goroutines doing it.
	Prefault time.Duration
}

func gbps(b int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(b) / d.Seconds() / 1e9
}

// Throughput is Bytes over Wall, in bytes per second.
func (r Result) Throughput() float64 {
	if r.Wall <= 0 {
		return 0
	}
	return float64(r.Bytes) / r.Wall.Seconds()
}

// Overlap says how much of the host copy ran concurrently with the
// host-to-device copies: (HostCopy + H2D - Wall) / min(HostCopy, H2D),
// clamped to [0, 1]. 1 means the shorter of the two was entirely hidden, 0
// that they ran one after the other.
func (r Result) Overlap() float64 {
	host := r.HostCopy
	m := min(host, r.H2D)
	if m <= 0 {
		return 0
	}
	return max(0, min(1, float64(host+r.H2D-r.Wall)/float64(m)))
}

func (r Result) String() string {
	s := fmt.Sprintf("%d bytes, %d tensors, %d chunks, %d windows, %d x %d-byte device buffers, %d x %d-byte pinned slots: wall %v (%.2f GB/s), host copy %d bytes in %v (%.2f GB/s), host wait %v, H2D %v (%.2f GB/s), overlap %.2f",
		r.Bytes, r.Tensors, r.Chunks, r.Windows, r.Buffers, r.BufferBytes, r.Slots, r.SlotBytes, r.Wall, gbps(r.Bytes, r.Wall),
		r.Copied, r.HostCopy, gbps(r.Copied, r.HostCopy), r.HostWait, r.H2D, gbps(r.Bytes, r.H2D), r.Overlap())
	if r.Prefault > 0 {
		s += fmt.Sprintf(", prefault %v", r.Prefault)
	}
	if r.Broadcast > 0 {
		s += fmt.Sprintf(", broadcast %v (%.2f GB/s)", r.Broadcast, gbps(r.Bytes, r.Broadcast))
	}
	return s
}
