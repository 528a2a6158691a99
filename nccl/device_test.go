package nccl_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
)

func TestDeviceRunsEverythingOnOneThread(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{Devices: 2})
	d, err := nccl.OpenDevice(f, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var mu sync.Mutex
	tids := map[int]bool{}
	var wg sync.WaitGroup
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := d.Do(context.Background(), func(api nccl.API) error {
				mu.Lock()
				tids[nccl.ThreadID()] = true
				mu.Unlock()
				p, err := api.Malloc(16)
				if err != nil {
					return err
				}
				if p>>40 != 2 { // fake addresses say the device: (d+1)<<40
					t.Errorf("allocated on the wrong device: %#x", uintptr(p))
				}
				return api.Free(p)
			})
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if len(tids) != 1 {
		t.Fatalf("requests ran on %d threads", len(tids))
	}
	// Nested Do runs inline instead of deadlocking.
	err = d.Do(context.Background(), func(nccl.API) error {
		return d.Do(context.Background(), func(nccl.API) error { return errors.New("inner") })
	})
	if err == nil || err.Error() != "inner" {
		t.Fatalf("nested: %v", err)
	}
	// A panic is an error, and the actor survives it.
	err = d.Do(context.Background(), func(nccl.API) error { panic("boom") })
	if err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("panic: %v", err)
	}
	if err := d.Do(context.Background(), func(nccl.API) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

func TestDeviceBusyAndClosed(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{})
	d, err := nccl.OpenDevice(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	go d.Do(context.Background(), func(nccl.API) error { <-release; return nil })
	time.Sleep(10 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := d.Do(ctx, func(nccl.API) error { return nil }); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("busy device: %v", err)
	}
	close(release)
	d.Close()
	if err := d.Do(context.Background(), func(nccl.API) error { return nil }); !errors.Is(err, nccl.ErrClosed) {
		t.Fatalf("closed device: %v", err)
	}
	if _, err := nccl.OpenDevice(f, 3); err == nil {
		t.Fatal("device 3 of 1 opened")
	}
}

func TestDeviceWaitEventHonoursContext(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{})
	d, err := nccl.OpenDevice(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var s nccl.Stream
	var gate, e nccl.Event
	_ = d.Do(context.Background(), func(api nccl.API) error {
		s, _ = api.StreamCreate(nccl.StreamNonBlocking)
		gate, _ = api.EventCreate(0)
		e, _ = api.EventCreate(0)
		_ = api.EventRecord(gate, 0) // recorded on the default stream...
		return nil
	})
	// ...but make the stream wait on a record that happens later.
	_ = d.Do(context.Background(), func(api nccl.API) error {
		other, _ := api.StreamCreate(nccl.StreamNonBlocking)
		block, _ := api.EventCreate(0)
		_ = api.EventRecord(block, other)
		_ = api.StreamWaitEvent(s, block)
		_ = api.EventRecord(e, s)
		_ = api.StreamSynchronize(other)
		_ = api.StreamDestroy(other)
		return api.EventDestroy(block)
	})
	if err := d.WaitEvent(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	if err := d.WaitStream(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	// A stream stuck behind a collective that never completes.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	_ = d.Do(context.Background(), func(api nccl.API) error {
		stuck, _ := api.EventCreate(0)
		_ = api.StreamWaitEvent(s, stuck)
		_ = api.EventRecord(stuck, 0)
		// The record on the default stream completes: the wait passes.
		return api.EventDestroy(stuck)
	})
	if err := d.WaitStream(ctx, s); err != nil {
		t.Fatal(err)
	}
	_ = d.Do(context.Background(), func(api nccl.API) error {
		_ = api.EventDestroy(gate)
		_ = api.EventDestroy(e)
		return api.StreamDestroy(s)
	})
}

func TestFakeChecks(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{Devices: 2, DeviceMemory: 1000})
	d0, _ := nccl.OpenDevice(f, 0)
	defer d0.Close()
	d1, _ := nccl.OpenDevice(f, 1)
	defer d1.Close()
	ctx := context.Background()
	var p1 nccl.DevPtr
	_ = d1.Do(ctx, func(api nccl.API) error { p1, _ = api.Malloc(100); return nil })
	err := d0.Do(ctx, func(api nccl.API) error {
		if _, err := api.Malloc(1001); !errors.Is(err, nccl.CudaErrorMemoryAllocation) {
			t.Errorf("oversized malloc: %v", err)
		}
		free, total, _ := api.MemGetInfo()
		if free != 1000 || total != 1000 {
			t.Errorf("device 0 meminfo %d/%d (device 1's allocation must not count)", free, total)
		}
		s, _ := api.StreamCreate(nccl.StreamNonBlocking)
		defer api.StreamDestroy(s)
		if err := api.MemcpyHtoDAsync(p1, make([]byte, 10), s); !errors.Is(err, nccl.ErrNotPinned) {
			t.Errorf("pageable copy: %v", err)
		}
		h, _ := api.HostAlloc(10, 0)
		defer api.FreeHost(h)
		if err := api.MemcpyHtoDAsync(p1+95, h, s); !errors.Is(err, nccl.CudaErrorIllegalAddress) {
			t.Errorf("copy past the allocation: %v", err)
		}
		if err := api.FreeHost(h[1:]); err == nil {
			t.Error("FreeHost of an interior pointer succeeded")
		}
		// A collective on device 0 with device 1's buffer.
		id, _ := api.GetUniqueID()
		c, err := api.CommInitRankConfig(1, id, 0, nccl.CommConfig{})
		if err != nil {
			return err
		}
		defer api.CommDestroy(c)
		if err := api.Broadcast(p1, p1, 100, nccl.Uint8, 0, c, s); !errors.Is(err, nccl.InvalidArgument) || !strings.Contains(err.Error(), "device 1") {
			t.Errorf("cross-device broadcast: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = d1.Do(ctx, func(api nccl.API) error { return api.Free(p1) })
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

func TestFakeMismatchedCollectives(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{Devices: 2})
	id := newID(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	errs := make(chan error, 2)
	for rank := 0; rank < 2; rank++ {
		go func() {
			c, err := nccl.NewComm(ctx, f, rank, 2, rank, id)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close(ctx)
			var p nccl.DevPtr
			_ = c.Device().Do(ctx, func(api nccl.API) error { p, _ = api.Malloc(64); return nil })
			defer c.Device().Do(ctx, func(api nccl.API) error { return api.Free(p) })
			errs <- c.Broadcast(ctx, p, 16+16*rank, nccl.Uint8) // rank 1 expects more bytes
		}()
	}
	for i := 0; i < 2; i++ {
		if err := <-errs; !errors.Is(err, nccl.InvalidUsage) || !strings.Contains(err.Error(), "mismatch") {
			t.Fatalf("got %v, want a mismatch error", err)
		}
	}
}
