package staging

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/safetensors"
)

// warmPageCache reads the file once so that the benchmarks measure the
// page-cache path, not the disk.
func warmPageCache(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start := time.Now()
	n, err := io.Copy(io.Discard, f)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("page cache warm: read %d bytes in %v", n, time.Since(start))
}

// pinnedCeiling measures plain cudaMemcpyAsync from one pinned buffer into
// one device buffer, timed with events: the fastest any staging can go.
func pinnedCeiling(t *testing.T, dev *nccl.Device, size, reps int) float64 {
	t.Helper()
	var rate float64
	err := dev.Do(context.Background(), func(api nccl.API) error {
		h, err := api.HostAlloc(size, nccl.HostAllocPortable)
		if err != nil {
			return err
		}
		defer api.FreeHost(h)
		for i := range h {
			h[i] = byte(i)
		}
		d, err := api.Malloc(size)
		if err != nil {
			return err
		}
		defer api.Free(d)
		s, err := api.StreamCreate(nccl.StreamNonBlocking)
		if err != nil {
			return err
		}
		defer api.StreamDestroy(s)
		e1, _ := api.EventCreate(nccl.EventDefault)
		e2, _ := api.EventCreate(nccl.EventDefault)
		defer api.EventDestroy(e1)
		defer api.EventDestroy(e2)
		if err := api.MemcpyHtoDAsync(d, h, s); err != nil { // warm-up
			return err
		}
		if err := api.StreamSynchronize(s); err != nil {
			return err
		}
		wall := time.Now()
		_ = api.EventRecord(e1, s)
		for i := 0; i < reps; i++ {
			if err := api.MemcpyHtoDAsync(d, h, s); err != nil {
				return err
			}
		}
		_ = api.EventRecord(e2, s)
		if err := api.StreamSynchronize(s); err != nil {
			return err
		}
		el, err := api.EventElapsedTime(e1, e2)
		if err != nil {
			return err
		}
		rate = float64(size) * float64(reps) / el.Seconds() / 1e9
		t.Logf("pinned H2D ceiling: %d x %d bytes in %v (events), %v (wall): %.2f GB/s", reps, size, el, time.Since(wall), rate)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return rate
}

// TestGPUBenchStage (benchmark a): checkpoint in the page cache -> device
// through the pipeline, against the pinned H2D ceiling of the same run.
func TestGPUBenchStage(t *testing.T) {
	lib := gpuLib(t)
	path := genCheckpoint(t, "big", bigSpec(envInt("RLFLOW_GPU_LAYERS", 40)), false)
	warmPageCache(t, path)
	dev, err := nccl.OpenDevice(lib, gpuDevice())
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	ceiling := pinnedCeiling(t, dev, 1<<30, 10)
	figure(t, "stage.pinned_h2d_ceiling_GBps", ceiling)

	configs := []struct {
		name      string
		packed    bool
		threshold int64
		opts      Options
	}{
		{"packed-256MiB-2buf", true, 256 << 20, Options{Buffers: 2}},
		{"packed-256MiB-3buf", true, 256 << 20, Options{Buffers: 3}},
		{"packed-1GiB-2buf", true, 1 << 30, Options{Buffers: 2}},
		{"nonpacked-2buf", false, 0, Options{Buffers: 2}},
		{"packed-256MiB-2buf-1worker", true, 256 << 20, Options{Buffers: 2, CopyWorkers: 1}},
	}
	for _, c := range configs {
		ck, err := safetensors.OpenCheckpoint(path) // a fresh mapping: page faults included
		if err != nil {
			t.Fatal(err)
		}
		chunks := gpuLayout(t, ck, c.packed, c.threshold, false).Chunks
		p, err := New(context.Background(), dev, MaxChunk(chunks), c.opts)
		if err != nil {
			t.Fatal(err)
		}
		for _, pass := range []string{"fresh-mmap", "mapped"} {
			res, err := p.Stage(context.Background(), ck, chunks)
			if err != nil {
				t.Fatal(err)
			}
			gb := res.Throughput() / 1e9
			t.Logf("%s %s: %v", c.name, pass, res)
			figure(t, fmt.Sprintf("stage.%s.%s.GBps", c.name, pass), gb)
			figure(t, fmt.Sprintf("stage.%s.%s.host_copy_GBps", c.name, pass), gbps(res.Bytes, res.HostCopy))
			figure(t, fmt.Sprintf("stage.%s.%s.ratio_to_ceiling", c.name, pass), gb/ceiling)
			fmt.Printf("GPU-FIGURE stage %-28s %-10s %6.2f GB/s = %4.0f%% of the pinned ceiling (%.2f GB/s); host copy %.2f GB/s\n",
				c.name, pass, gb, 100*gb/ceiling, ceiling, gbps(res.Bytes, res.HostCopy))
		}
		if err := p.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		ck.Close()
	}
}

// TestGPUBenchE2E (benchmark b): end-to-end broadcast of the checkpoint,
// rank 0 in Go (open, stage, broadcast) against bench_torch.py's trainer
// (safetensors load to cuda, torch.cat chunks, dist.broadcast), both to one
// receiver on the same GPU, both timed after the rendezvous.
func TestGPUBenchE2E(t *testing.T) {
	lib := gpuLib(t)
	path := genCheckpoint(t, "big", bigSpec(envInt("RLFLOW_GPU_LAYERS", 40)), false)
	warmPageCache(t, path)
	const threshold = 1 << 30 // vLLM's default packed_buffer_size_bytes
	ck0, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	meta := writeMeta(t, path, gpuLayout(t, ck0, true, threshold, false))
	ck0.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// Go.
	comm, procs, err := rendezvousWith(ctx, t, lib, 2, receiverArgs(t, meta, 2, "--no-verify"))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	chunks := gpuLayout(t, ck, true, threshold, false).Chunks
	pipe, err := New(ctx, comm.Device(), MaxChunk(chunks), Options{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := pipe.Broadcast(ctx, comm, ck, chunks)
	goSecs := time.Since(start).Seconds()
	if err != nil {
		t.Fatal(err)
	}
	_ = pipe.Close(ctx)
	ck.Close()
	r, err := procs[0].finish(ctx)
	if err != nil || r["verdict"] != "PASS" {
		t.Fatalf("receiver: %v %v", r, err)
	}
	comm.Close(ctx)
	t.Logf("go: %.3fs end to end; %v", goSecs, res)

	// PyTorch.
	port := strconv.Itoa(freePort(t))
	script := scriptPath(t, "bench_torch.py")
	common := []string{script, "--mode", "e2e", "--init", "tcp://127.0.0.1:" + port, "--world-size", "2",
		"--device", strconv.Itoa(gpuDevice()), "--meta", meta}
	tr := launch(t, "torch-trainer", "rlflow-trainer-torch", append(common, "--role", "trainer")...)
	rc := launch(t, "torch-receiver", "rlflow-worker1", append(common, "--role", "receiver")...)
	tres, err := tr.finish(ctx)
	if err != nil || tres["verdict"] != "PASS" {
		t.Fatalf("torch trainer: %v %v", tres, err)
	}
	if rres, err := rc.finish(ctx); err != nil || rres["verdict"] != "PASS" {
		t.Fatalf("torch receiver: %v %v", rres, err)
	}
	torchSecs := num(tres, "seconds")
	figure(t, "e2e.go_s", goSecs)
	figure(t, "e2e.torch_s", torchSecs)
	figure(t, "e2e.torch_load_s", num(tres, "load_seconds"))
	figure(t, "e2e.torch_broadcast_s", num(tres, "broadcast_seconds"))
	figure(t, "e2e.go_transfer_s", res.Wall.Seconds())
	figure(t, "e2e.speedup_go_over_torch", torchSecs/goSecs)
	fmt.Printf("GPU-FIGURE e2e %d bytes packed T=1GiB: go %.3fs (%.2f GB/s; %.3fs without opening the checkpoint and allocating the pinned buffers, which a reused Pipeline skips), torch %.3fs (load %.3fs + broadcast %.3fs): go is %.2fx torch\n",
		res.Bytes, goSecs, float64(res.Bytes)/goSecs/1e9, res.Wall.Seconds(), torchSecs, num(tres, "load_seconds"), num(tres, "broadcast_seconds"), torchSecs/goSecs)
}

// TestGPUBenchRaw (benchmark c): broadcast throughput of a device buffer
// over the two-ranks-on-one-GPU path, Go against torch.distributed.
func TestGPUBenchRaw(t *testing.T) {
	lib := gpuLib(t)
	const size, reps = 1 << 30, 5
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	script := scriptPath(t, "receiver.py")
	comm, procs, err := rendezvousWith(ctx, t, lib, 2, func(rank, port int) []string {
		return []string{script, "--host", "127.0.0.1", "--port", strconv.Itoa(port), "--world-size", "2",
			"--rank", "1", "--device", strconv.Itoa(gpuDevice()), "--raw-bytes", strconv.Itoa(size), "--repeat", strconv.Itoa(reps + 1)}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer comm.Close(context.Background())
	var d nccl.DevPtr
	err = comm.Device().Do(ctx, func(api nccl.API) error {
		h, err := api.HostAlloc(size, nccl.HostAllocPortable)
		if err != nil {
			return err
		}
		defer api.FreeHost(h)
		for i := range h {
			h[i] = byte(i % 251)
		}
		if d, err = api.Malloc(size); err != nil {
			return err
		}
		if err := api.MemcpyHtoDAsync(d, h, comm.Stream()); err != nil {
			return err
		}
		return api.StreamSynchronize(comm.Stream())
	})
	if err != nil {
		t.Fatal(err)
	}
	defer comm.Device().Do(context.Background(), func(api nccl.API) error { return api.Free(d) })
	if err := comm.Broadcast(ctx, d, size, nccl.Uint8); err != nil { // untimed: connections
		t.Fatal(err)
	}
	start := time.Now()
	for i := 0; i < reps; i++ {
		if err := comm.BroadcastAsync(ctx, d, size, nccl.Uint8, nccl.Order{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := comm.Synchronize(ctx); err != nil {
		t.Fatal(err)
	}
	goGBps := float64(size) * reps / time.Since(start).Seconds() / 1e9
	r, err := procs[0].finish(ctx)
	verdict(t, err == nil && r["verdict"] == "PASS", "go raw broadcast received intact by receiver.py: %v %v", r["verdict"], err)

	port := strconv.Itoa(freePort(t))
	bscript := scriptPath(t, "bench_torch.py")
	common := []string{bscript, "--mode", "raw", "--init", "tcp://127.0.0.1:" + port, "--world-size", "2",
		"--device", strconv.Itoa(gpuDevice()), "--raw-bytes", strconv.Itoa(size), "--repeat", strconv.Itoa(reps)}
	tr := launch(t, "torch-trainer", "rlflow-trainer-torch", append(common, "--role", "trainer")...)
	rc := launch(t, "torch-receiver", "rlflow-worker1", append(common, "--role", "receiver", "--verify")...)
	tres, err := tr.finish(ctx)
	if err != nil || tres["verdict"] != "PASS" {
		t.Fatalf("torch trainer: %v %v", tres, err)
	}
	if rres, err := rc.finish(ctx); err != nil || rres["verdict"] != "PASS" {
		t.Fatalf("torch receiver: %v %v", rres, err)
	}
	torchGBps := num(tres, "gbps")
	figure(t, "raw.go_GBps", goGBps)
	figure(t, "raw.torch_GBps", torchGBps)
	figure(t, "raw.ratio_go_over_torch", goGBps/torchGBps)
	fmt.Printf("GPU-FIGURE raw broadcast %d x %d bytes: go %.2f GB/s, torch.distributed %.2f GB/s: ratio %.2f\n",
		reps, size, goGBps, torchGBps, goGBps/torchGBps)
}
