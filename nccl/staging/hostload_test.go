package staging

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/safetensors"
)

// The staging sweep's ratio is against the pinned H2D ceiling, which is DMA
// only: it does not see a host whose CPUs are stolen by other tenants or
// whose cores are slow to read the page cache. What is below measures that
// side in the same run, so a low figure can be told apart from a slow
// pipeline: the host copy's own ceiling (the CPU copy alone, no GPU) and
// the CPU accounting of each run.

// cpuSample is the machine's CPU time (/proc/stat's first line, in clock
// ticks) and this process's (getrusage) at one moment.
type cpuSample struct {
	at                time.Time
	busy, idle, steal uint64 // machine-wide ticks; busy excludes idle, iowait and steal
	procUser, procSys time.Duration
	ok                bool // /proc/stat was read
}

func sampleCPU() cpuSample {
	s := cpuSample{at: time.Now()}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		s.procUser = time.Duration(ru.Utime.Nano())
		s.procSys = time.Duration(ru.Stime.Nano())
	}
	f, err := os.Open("/proc/stat")
	if err != nil {
		return s
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	if !sc.Scan() {
		return s
	}
	busy, idle, steal, ok := parseProcStatCPU(sc.Text())
	s.busy, s.idle, s.steal, s.ok = busy, idle, steal, ok
	return s
}

// parseProcStatCPU reads /proc/stat's aggregate line: "cpu user nice system
// idle iowait irq softirq steal ...". Guest time is already counted in
// user and nice, so the fields after steal are not added again.
func parseProcStatCPU(line string) (busy, idle, steal uint64, ok bool) {
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, 0, false
	}
	var v [8]uint64
	for i := range v {
		n, err := strconv.ParseUint(f[i+1], 10, 64)
		if err != nil {
			return 0, 0, 0, false
		}
		v[i] = n
	}
	user, nice, system, idl, iowait, irq, softirq, st := v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
	return user + nice + system + irq + softirq, idl + iowait, st, true
}

// cpuDelta is what the machine and this process did between two samples.
type cpuDelta struct {
	// Busy, Idle and Steal are shares of the machine's CPU time (summing
	// to 1): Steal is time the hypervisor gave the vCPUs to someone else.
	Busy, Idle, Steal float64
	// ProcCPUs is this process's CPU time over the wall time: how many
	// CPUs it kept busy on average.
	ProcCPUs float64
	// Ticks is the machine's CPU time between the samples in clock ticks
	// (USER_HZ, 100 a second per CPU): the shares' resolution.
	Ticks float64
	ok    bool // /proc/stat was read both times
}

func (a cpuSample) to(b cpuSample) cpuDelta {
	var d cpuDelta
	if wall := b.at.Sub(a.at); wall > 0 {
		d.ProcCPUs = float64(b.procUser+b.procSys-a.procUser-a.procSys) / float64(wall)
	}
	if !a.ok || !b.ok {
		return d
	}
	d.ok = true
	busy, idle, steal := float64(b.busy-a.busy), float64(b.idle-a.idle), float64(b.steal-a.steal)
	if d.Ticks = busy + idle + steal; d.Ticks > 0 {
		d.Busy, d.Idle, d.Steal = busy/d.Ticks, idle/d.Ticks, steal/d.Ticks
	}
	return d
}

func (d cpuDelta) String() string {
	switch {
	case !d.ok:
		return fmt.Sprintf("this process %.1f CPUs; /proc/stat unavailable", d.ProcCPUs)
	case d.Ticks == 0:
		return fmt.Sprintf("this process %.1f CPUs; no clock tick of /proc/stat elapsed", d.ProcCPUs)
	}
	return fmt.Sprintf("machine busy %.0f%% idle %.0f%% steal %.1f%% (of %.0f ticks), this process %.1f CPUs", 100*d.Busy, 100*d.Idle, 100*d.Steal, d.Ticks, d.ProcCPUs)
}

// hostCopyCeiling measures the host copy by itself: workers goroutines copy
// the whole of src in jobs of job bytes, each into a private buffer of
// four jobs that stays in the cache (as a ring slot does until the copy
// engine reads it), with the same Go copy the pipeline uses and no GPU
// work beside it. It returns the rate in GB/s. Staging cannot beat it on
// this host at this moment.
func hostCopyCeiling(src []byte, workers, job int) float64 {
	start := time.Now()
	copyInJobs(src, workers, job)
	return gbps(int64(len(src)), time.Since(start))
}

// copyInJobs is hostCopyCeiling's work. The jobs are disjoint (an atomic
// counter hands out their offsets), so the bytes it returns, summed over
// the workers, equal len(src) exactly when every byte was copied.
func copyInJobs(src []byte, workers, job int) int64 {
	var next, copied atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 4*job)
			for k := 0; ; k++ {
				off := next.Add(int64(job)) - int64(job)
				if off >= int64(len(src)) {
					return
				}
				end := min(off+int64(job), int64(len(src)))
				slot := (k % 4) * job
				copied.Add(int64(copy(buf[slot:slot+int(end-off)], src[off:end])))
			}
		}()
	}
	wg.Wait()
	return copied.Load()
}

// probeHostCopy measures hostCopyCeiling over the checkpoint at path with
// the pipeline's default worker count and 1 MiB jobs: on a fresh mapping
// (page faults included, as the fresh staging runs) and again once it is
// faulted in. It returns the fresh figure.
func probeHostCopy(path string, pass int) (float64, error) {
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		return 0, err
	}
	defer ck.Close()
	// The bench checkpoint is one file: the first tensor's mapping is all of it.
	m, _, err := ck.Mapping(ck.Tensors()[0])
	if err != nil {
		return 0, err
	}
	workers := min(runtime.GOMAXPROCS(0), 16) // as Options.CopyWorkers' default
	c0 := sampleCPU()
	fresh := hostCopyCeiling(m, workers, 1<<20)
	faulted := hostCopyCeiling(m, workers, 1<<20)
	fmt.Printf("GPU-FIGURE stage pass %d host copy ceiling (%d goroutines, 1 MiB jobs, page cache -> cached buffers, no GPU): fresh mapping %.2f GB/s, faulted in %.2f GB/s; %v\n",
		pass, workers, fresh, faulted, c0.to(sampleCPU()))
	return fresh, nil
}

func TestParseProcStatCPU(t *testing.T) {
	for _, tc := range []struct {
		name              string
		line              string
		busy, idle, steal uint64
		ok                bool
	}{
		// user nice system idle iowait irq softirq steal guest guest_nice
		{"kernel 6 line", "cpu  100 2 30 500 7 1 4 50 20 0", 137, 507, 50, true},
		{"no guest fields", "cpu 1 0 1 10 0 0 0 3", 2, 10, 3, true},
		{"a per-CPU line", "cpu0 1 0 1 10 0 0 0 3", 0, 0, 0, false},
		{"too short (no steal)", "cpu 1 0 1 10 0 0 0", 0, 0, 0, false},
		{"not a number", "cpu 1 0 x 10 0 0 0 3", 0, 0, 0, false},
		{"empty", "", 0, 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			busy, idle, steal, ok := parseProcStatCPU(tc.line)
			if busy != tc.busy || idle != tc.idle || steal != tc.steal || ok != tc.ok {
				t.Fatalf("parseProcStatCPU(%q) = %d, %d, %d, %v; want %d, %d, %d, %v", tc.line, busy, idle, steal, ok, tc.busy, tc.idle, tc.steal, tc.ok)
			}
		})
	}
}

func TestCPUDelta(t *testing.T) {
	t0 := time.Unix(100, 0)
	a := cpuSample{at: t0, busy: 1000, idle: 500, steal: 10, procUser: time.Second, ok: true}
	b := cpuSample{at: t0.Add(2 * time.Second), busy: 1600, idle: 800, steal: 110, procUser: 5 * time.Second, procSys: time.Second, ok: true}
	d := a.to(b)
	if d.Busy != 0.6 || d.Idle != 0.3 || d.Steal != 0.1 || d.ProcCPUs != 2.5 || !d.ok {
		t.Fatalf("delta = %+v; want busy 0.6, idle 0.3, steal 0.1, 2.5 CPUs", d)
	}
	if got, want := d.String(), "machine busy 60% idle 30% steal 10.0% (of 1000 ticks), this process 2.5 CPUs"; got != want {
		t.Fatalf("String() = %q; want %q", got, want)
	}
	if got, want := a.to(a).String(), "this process 0.0 CPUs; no clock tick of /proc/stat elapsed"; got != want {
		t.Fatalf("no tick: %q; want %q", got, want)
	}
	a.ok = false
	if got, want := a.to(b).String(), "this process 2.5 CPUs; /proc/stat unavailable"; got != want {
		t.Fatalf("without /proc/stat: %q; want %q", got, want)
	}
}

func TestHostCopyCeilingCopiesEverything(t *testing.T) {
	// The probe's rate is len(src) over its time: it must copy every byte
	// once (a job lost past the end, or a short last job cut, would make
	// the rate a lie).
	src := make([]byte, 10<<20+12345)
	for _, tc := range []struct {
		name       string
		n, workers int
		job        int
	}{
		{"jobs and a short last one", len(src), 3, 1 << 20},
		{"exact multiple of the job", 8 << 20, 16, 1 << 20},
		{"fewer bytes than one job", 5, 4, 1 << 20},
		{"more workers than jobs", 3<<20 + 1, 16, 1 << 20},
		{"empty", 0, 2, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := copyInJobs(src[:tc.n], tc.workers, tc.job); got != int64(tc.n) {
				t.Fatalf("copied %d bytes of %d", got, tc.n)
			}
		})
	}
	if r := hostCopyCeiling(src, 3, 1<<20); r <= 0 {
		t.Fatalf("rate %v", r)
	}
}
