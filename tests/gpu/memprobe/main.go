//go:build amd64 && cgo

// Command memprobe measures where page cache -> device staging bandwidth
// goes on a GPU host, outside the staging package: the pinned H2D ceiling
// by copy size, CPU copy kernels (Go copy, AVX2 non-temporal and temporal
// stores, rep movsb) from a page-cache mapping by thread count, the CPU copy
// with an H2D loop running beside it, and a ring of small pinned slots fed
// by copy threads and drained by the copy engine. It is what led to the
// staging package's pinned ring (nccl/GPU-RESULTS.md, third session).
//
// Build here and run on the GPU host (it writes a 4 GiB file, -file):
//
//	CGO_ENABLED=1 go build -o .carry/memprobe ./tests/gpu/memprobe
//	.carry/memprobe [-quick] | grep PROBE
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

const MiB = 1 << 20

func must(err error) {
	if err != nil {
		fmt.Println("FATAL", err)
		os.Exit(1)
	}
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func main() {
	path := flag.String("file", "/tmp/memprobe.bin", "")
	size := flag.Int64("size", 4<<30, "")
	quick := flag.Bool("quick", false, "")
	flag.Parse()
	ctx := context.Background()
	if st, err := os.Stat(*path); err != nil || st.Size() != *size {
		f, err := os.Create(*path)
		must(err)
		buf := make([]byte, 64*MiB)
		rand.New(rand.NewSource(1)).Read(buf)
		for off := int64(0); off < *size; off += int64(len(buf)) {
			buf[0]++
			_, err := f.Write(buf[:min(int64(len(buf)), *size-off)])
			must(err)
		}
		must(f.Close())
	}
	f, err := os.Open(*path)
	must(err)
	src, err := syscall.Mmap(int(f.Fd()), 0, int(*size), syscall.PROT_READ, syscall.MAP_SHARED)
	must(err)
	var sink byte
	for i := 0; i < len(src); i += 4096 {
		sink ^= src[i]
	}
	_ = sink
	lib, err := nccl.Load(nccl.Config{})
	must(err)
	dev, err := nccl.OpenDevice(lib, 0)
	must(err)
	var pinned, ring []byte
	var devb nccl.DevPtr
	var st nccl.Stream
	const ringMax = 512 * MiB
	events := make([]nccl.Event, 4096)
	must(dev.Do(ctx, func(api nccl.API) error {
		var err error
		if pinned, err = api.HostAlloc(1<<30, nccl.HostAllocPortable); err != nil {
			return err
		}
		if ring, err = api.HostAlloc(ringMax, nccl.HostAllocPortable); err != nil {
			return err
		}
		if devb, err = api.Malloc(1 << 30); err != nil {
			return err
		}
		if st, err = api.StreamCreate(nccl.StreamNonBlocking); err != nil {
			return err
		}
		for i := range events {
			if events[i], err = api.EventCreate(nccl.EventDisableTiming); err != nil {
				return err
			}
		}
		return nil
	}))
	for i := range pinned {
		pinned[i] = byte(i)
	}
	for i := range ring {
		ring[i] = byte(i)
	}
	fmt.Printf("PROBE GOMAXPROCS %d, file %s %d bytes\n", runtime.GOMAXPROCS(0), *path, *size)

	// a. ceiling.
	h2d := func(b []byte, reps int) float64 {
		t := time.Now()
		must(dev.Do(ctx, func(api nccl.API) error {
			for r := 0; r < reps; r++ {
				if err := api.MemcpyHtoDAsync(devb, b, st); err != nil {
					return err
				}
			}
			return api.StreamSynchronize(st)
		}))
		return float64(int64(len(b))*int64(reps)) / time.Since(t).Seconds() / 1e9
	}
	h2d(pinned, 1)
	var cs []float64
	for i := 0; i < 3; i++ {
		cs = append(cs, h2d(pinned, 4))
	}
	ceiling := median(cs)
	fmt.Printf("PROBE ceiling H2D 1GiB pinned: %.2f GB/s (runs %.2f)\n", ceiling, cs)
	for _, b := range []int{1, 2, 4, 8, 16} {
		var rs []float64
		for i := 0; i < 3; i++ {
			t := time.Now()
			n := 0
			must(dev.Do(ctx, func(api nccl.API) error {
				for off := 0; off+b*MiB <= 1<<30; off += b * MiB {
					if err := api.MemcpyHtoDAsync(devb+nccl.DevPtr(off), pinned[off:off+b*MiB], st); err != nil {
						return err
					}
					n += b * MiB
				}
				return api.StreamSynchronize(st)
			}))
			rs = append(rs, float64(n)/time.Since(t).Seconds()/1e9)
		}
		fmt.Printf("PROBE ceiling H2D in %d MiB copies: %.2f GB/s\n", b, median(rs))
	}

	// b. CPU only: page cache -> pinned (1 GiB, wrapping), parts of B.
	cpuCopy := func(k, threads int, part int, dst []byte, dstWrap int) float64 {
		var next atomic.Int64
		var wg sync.WaitGroup
		t := time.Now()
		for w := 0; w < threads; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				for {
					off := next.Add(int64(part)) - int64(part)
					if off >= int64(len(src)) {
						return
					}
					end := min(off+int64(part), int64(len(src)))
					var d []byte
					if dstWrap > 0 { // each worker its own small region
						base := w * dstWrap
						d = dst[base : base+int(end-off)]
					} else {
						o := off % int64(len(dst))
						d = dst[o : o+end-off]
					}
					copyK(k, d, src[off:end])
				}
			}(w)
		}
		wg.Wait()
		return float64(len(src)) / time.Since(t).Seconds() / 1e9
	}
	threadsList := []int{1, 4, 8, 12, 16}
	if *quick {
		threadsList = []int{16}
	}
	for k := range kernelNames {
		for _, T := range threadsList {
			var rs []float64
			for i := 0; i < 3; i++ {
				rs = append(rs, cpuCopy(k, T, 8*MiB, pinned, 0))
			}
			fmt.Printf("PROBE cpu pagecache->pinned kernel %-5s threads %2d parts 8MiB: %.2f GB/s\n", kernelNames[k], T, median(rs))
		}
		var rs []float64
		for i := 0; i < 3; i++ {
			rs = append(rs, cpuCopy(k, 16, 1*MiB, ring, 1*MiB))
		}
		fmt.Printf("PROBE cpu pagecache->small-per-thread-1MiB kernel %-5s threads 16: %.2f GB/s\n", kernelNames[k], median(rs))
	}
	// b2. CPU copy with a concurrent H2D loop on another buffer.
	for _, k := range []int{0, 1, 2} {
		stop := make(chan struct{})
		var moved atomic.Int64
		var hw sync.WaitGroup
		hw.Add(1)
		go func() {
			defer hw.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				must(dev.Do(ctx, func(api nccl.API) error {
					if err := api.MemcpyHtoDAsync(devb, ring[:256*MiB], st); err != nil {
						return err
					}
					return api.StreamSynchronize(st)
				}))
				moved.Add(256 * MiB)
			}
		}()
		time.Sleep(20 * time.Millisecond)
		m0 := moved.Load()
		t := time.Now()
		gb := cpuCopy(k, 16, 8*MiB, pinned, 0)
		el := time.Since(t)
		m1 := moved.Load()
		close(stop)
		hw.Wait()
		fmt.Printf("PROBE cpu copy kernel %-5s 16 threads with concurrent H2D: cpu %.2f GB/s, h2d ~%.2f GB/s\n", kernelNames[k], gb, float64(m1-m0)/el.Seconds()/1e9)
	}

	// c. ring pipeline: page cache -> small pinned slots -> device.
	type job struct{ slot, off int64 }
	ringRun := func(k, threads int, slotBytes int64, slots int) (float64, error) {
		if int64(slots)*slotBytes > ringMax || slots > len(events) {
			return 0, fmt.Errorf("ring too big")
		}
		total := int64(len(src))
		free := make(chan int64, slots)
		for s := 0; s < slots; s++ {
			free <- int64(s)
		}
		jobs := make(chan job, slots)
		filled := make(chan job, slots)
		go func() {
			for off := int64(0); off < total; off += slotBytes {
				s := <-free
				jobs <- job{s, off}
			}
			close(jobs)
		}()
		var wg sync.WaitGroup
		for w := 0; w < threads; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := range jobs {
					end := min(j.off+slotBytes, total)
					copyK(k, ring[j.slot*slotBytes:j.slot*slotBytes+end-j.off], src[j.off:end])
					filled <- j
				}
			}()
		}
		t := time.Now()
		njobs := int((total + slotBytes - 1) / slotBytes)
		var pending []job
		done := 0
		for done < njobs {
			progress := false
			var batch []job
		drain:
			for {
				select {
				case j := <-filled:
					batch = append(batch, j)
				default:
					break drain
				}
			}
			err := dev.Do(ctx, func(api nccl.API) error {
				for _, j := range batch {
					end := min(j.off+slotBytes, total)
					d := devb + nccl.DevPtr(j.off%(1<<30))
					if err := api.MemcpyHtoDAsync(d, ring[j.slot*slotBytes:j.slot*slotBytes+end-j.off], st); err != nil {
						return err
					}
					if err := api.EventRecord(events[j.slot], st); err != nil {
						return err
					}
					pending = append(pending, j)
					progress = true
				}
				for len(pending) > 0 {
					ok, err := api.EventQuery(events[pending[0].slot])
					if err != nil {
						return err
					}
					if !ok {
						break
					}
					free <- pending[0].slot
					pending = pending[1:]
					done++
					progress = true
				}
				return nil
			})
			if err != nil {
				return 0, err
			}
			if !progress {
				runtime.Gosched()
			}
		}
		wg.Wait()
		return float64(total) / time.Since(t).Seconds() / 1e9, nil
	}
	type rc struct {
		k, T  int
		slot  int64
		slots int
	}
	var cfgs []rc
	for _, k := range []int{0, 1, 2} {
		for _, slot := range []int64{1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB} {
			for _, mult := range []int{1, 2, 4} {
				cfgs = append(cfgs, rc{k, 16, slot, 16 * mult})
			}
		}
	}
	cfgs = append(cfgs, rc{1, 8, 4 * MiB, 32}, rc{2, 8, 2 * MiB, 32}, rc{1, 12, 4 * MiB, 48}, rc{2, 12, 2 * MiB, 48}, rc{0, 12, 4 * MiB, 48})
	for _, c := range cfgs {
		var rs []float64
		var err error
		for i := 0; i < 3 && err == nil; i++ {
			var g float64
			g, err = ringRun(c.k, c.T, c.slot, c.slots)
			rs = append(rs, g)
		}
		if err != nil {
			fmt.Printf("PROBE ring kernel %-5s threads %2d slot %2dMiB x %3d: error %v\n", kernelNames[c.k], c.T, c.slot/MiB, c.slots, err)
			continue
		}
		m := median(rs)
		fmt.Printf("PROBE ring kernel %-5s threads %2d slot %2dMiB x %3d: %.2f GB/s = %.0f%% of ceiling (runs %.2f)\n", kernelNames[c.k], c.T, c.slot/MiB, c.slots, m, 100*m/ceiling, rs)
	}
	fmt.Printf("PROBE ceiling again: %.2f GB/s\n", h2d(pinned, 4))
}
