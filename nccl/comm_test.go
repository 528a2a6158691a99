package nccl_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/nccltest"
)

func newID(t *testing.T, f *nccltest.Fake) nccl.UniqueID {
	t.Helper()
	id, err := f.GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// alloc makes a device buffer on the comm's thread and fills it with data.
func fill(t *testing.T, c *nccl.Comm, data []byte) nccl.DevPtr {
	t.Helper()
	var p nccl.DevPtr
	err := c.Device().Do(context.Background(), func(api nccl.API) error {
		var err error
		if p, err = api.Malloc(len(data)); err != nil {
			return err
		}
		h, err := api.HostAlloc(len(data), nccl.HostAllocPortable)
		if err != nil {
			return err
		}
		copy(h, data)
		if err := api.MemcpyHtoDAsync(p, h, c.Stream()); err != nil {
			return err
		}
		if err := api.StreamSynchronize(c.Stream()); err != nil {
			return err
		}
		return api.FreeHost(h)
	})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func free(t *testing.T, c *nccl.Comm, p nccl.DevPtr) {
	t.Helper()
	if err := c.Device().Do(context.Background(), func(api nccl.API) error { return api.Free(p) }); err != nil {
		t.Fatal(err)
	}
}

func checkOneThread(t *testing.T, calls []nccltest.Call) {
	t.Helper()
	threads := map[nccl.CommHandle]int{}
	for _, c := range calls {
		if tid, ok := threads[c.Comm]; ok && tid != c.Thread {
			t.Fatalf("%s on comm %#x ran on thread %d, earlier calls on %d", c.Op, c.Comm, c.Thread, tid)
		}
		threads[c.Comm] = c.Thread
	}
}

func TestCommInitWarmupBroadcastClose(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{VirtualPeers: true, VirtualJoinDelay: 20 * time.Millisecond, KeepData: true})
	ctx := context.Background()
	c, err := nccl.NewComm(ctx, f, 0, 3, 0, newID(t, f))
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte("weights, 19 bytes!!")
	p := fill(t, c, payload)
	if err := c.Broadcast(ctx, p, len(payload), nccl.Uint8); err != nil {
		t.Fatal(err)
	}
	free(t, c, p)
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(ctx); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if err := c.Broadcast(ctx, p, 1, nccl.Uint8); !errors.Is(err, nccl.ErrClosed) {
		t.Fatalf("broadcast after close: %v, want ErrClosed", err)
	}

	calls := f.Calls()
	var ops []string
	for _, c := range calls {
		ops = append(ops, c.Op)
	}
	want := []string{"CommInitRank", "AllReduce", "Broadcast", "CommFinalize", "CommDestroy"}
	if len(ops) != len(want) {
		t.Fatalf("calls %v, want %v", ops, want)
	}
	for i := range want {
		if ops[i] != want[i] {
			t.Fatalf("calls %v, want %v", ops, want)
		}
	}
	if ar := calls[1]; ar.Count != 1 || ar.DType != nccl.Float32 || ar.Bytes != 4 || ar.Index != 0 || ar.World != 3 {
		t.Errorf("warm-up %+v, want 1 x float32 as collective 0 of a 3-rank comm", ar)
	}
	if b := calls[2]; b.Count != len(payload) || b.DType != nccl.Uint8 || b.Root != 0 || b.Send != b.Recv || !bytes.Equal(b.Data, payload) {
		t.Errorf("broadcast %+v, want %d x uint8 root 0 in place carrying %q", b, len(payload), payload)
	}
	checkOneThread(t, calls)
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

func TestTwoRanksMoveBytes(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{Devices: 2, OpDelay: time.Millisecond})
	id := newID(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	payload := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7}, 1000)

	var wg sync.WaitGroup
	var got []byte
	var rerr error
	wg.Add(1)
	go func() { // the receiver, on device 1
		defer wg.Done()
		c, err := nccl.NewComm(ctx, f, 1, 2, 1, id)
		if err != nil {
			rerr = err
			return
		}
		defer c.Close(ctx)
		var p nccl.DevPtr
		if err := c.Device().Do(ctx, func(api nccl.API) error {
			p, err = api.Malloc(len(payload))
			return err
		}); err != nil {
			rerr = err
			return
		}
		if err := c.Broadcast(ctx, p, len(payload)/4, nccl.Int32); err != nil {
			rerr = err
			return
		}
		got, rerr = f.DeviceBytes(p, len(payload))
		_ = c.Device().Do(ctx, func(api nccl.API) error { return api.Free(p) })
	}()
	c, err := nccl.NewComm(ctx, f, 0, 2, 0, id)
	if err != nil {
		t.Fatal(err)
	}
	p := fill(t, c, payload)
	if err := c.Broadcast(ctx, p, len(payload)/4, nccl.Int32); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if rerr != nil {
		t.Fatalf("receiver: %v", rerr)
	}
	if !bytes.Equal(got, payload) {
		t.Fatal("receiver got different bytes")
	}
	free(t, c, p)
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, call := range f.Calls() {
		if want := call.Rank; call.Device != want {
			t.Errorf("%s of rank %d ran on device %d, want %d", call.Op, call.Rank, call.Device, want)
		}
	}
	checkOneThread(t, f.Calls())
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

func TestPeerNeverJoins(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{}) // no virtual peers: rank 1 never comes
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := nccl.NewComm(ctx, f, 0, 2, 0, newID(t, f))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want a deadline error", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("took %v after a 100ms deadline", d)
	}
	calls := f.Calls()
	if last := calls[len(calls)-1]; last.Op != "CommAbort" {
		t.Fatalf("last call %s, want CommAbort (so NCCL stops waiting)", last.Op)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
	t.Logf("error: %v", err)
}

func stallBroadcasts(f *nccltest.Fake) {
	f.OnCollective(func(c nccltest.Call) nccltest.Fault { return nccltest.Fault{Stall: c.Op == "Broadcast"} })
}

func TestBroadcastDeadlineAbortsAndPoisons(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{VirtualPeers: true})
	c, err := nccl.NewComm(context.Background(), f, 0, 2, 0, newID(t, f))
	if err != nil {
		t.Fatal(err)
	}
	p := fill(t, c, make([]byte, 64))
	stallBroadcasts(f)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = c.Broadcast(ctx, p, 64, nccl.Uint8)
	if !errors.Is(err, nccl.ErrAborted) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want ErrAborted wrapping the deadline", err)
	}
	n := len(f.Calls())
	start := time.Now()
	for _, call := range []func() error{
		func() error { return c.Broadcast(context.Background(), p, 64, nccl.Uint8) },
		func() error { return c.BroadcastAsync(context.Background(), p, 64, nccl.Uint8, nccl.Order{}) },
		func() error { return c.Synchronize(context.Background()) },
	} {
		if err := call(); !errors.Is(err, nccl.ErrAborted) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("call on a poisoned comm: %v, want the original poison", err)
		}
	}
	if time.Since(start) > time.Second || len(f.Calls()) != n {
		t.Fatal("calls on a poisoned comm should fail fast without reaching NCCL")
	}
	if !errors.Is(c.Err(), nccl.ErrAborted) {
		t.Fatalf("Err() = %v", c.Err())
	}
	free(t, c, p)
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
	checkOneThread(t, f.Calls())
}

// commWith8Bytes is rank 0 of 2 on a Fake with virtual peers and an
// 8-byte device buffer, both released when the test ends.
func commWith8Bytes(t *testing.T) (*nccltest.Fake, *nccl.Comm, nccl.DevPtr) {
	t.Helper()
	f := nccltest.NewFake(nccltest.Config{VirtualPeers: true})
	c, err := nccl.NewComm(context.Background(), f, 0, 2, 0, newID(t, f))
	if err != nil {
		t.Fatal(err)
	}
	p := fill(t, c, make([]byte, 8))
	t.Cleanup(func() {
		free(t, c, p)
		c.Close(context.Background())
	})
	return f, c, p
}

// remoteErrorOnBroadcasts makes every broadcast raise ncclRemoteError
// asynchronously after 10ms and stay stuck, as a dead peer does.
func remoteErrorOnBroadcasts(f *nccltest.Fake) {
	f.OnCollective(func(c nccltest.Call) nccltest.Fault {
		if c.Op == "Broadcast" {
			return nccltest.Fault{Err: nccl.RemoteError, Delay: 10 * time.Millisecond}
		}
		return nccltest.Fault{}
	})
}

func TestAsyncErrorAborts(t *testing.T) {
	f, c, p := commWith8Bytes(t)
	remoteErrorOnBroadcasts(f)
	// No deadline: only the asynchronous error can end this wait.
	err := c.Broadcast(context.Background(), p, 8, nccl.Uint8)
	if !errors.Is(err, nccl.ErrAborted) || !errors.Is(err, nccl.RemoteError) {
		t.Fatalf("got %v, want ErrAborted wrapping ncclRemoteError", err)
	}
	var e *nccl.Error
	if !errors.As(err, &e) || e.Detail == "" {
		t.Fatalf("want an *Error with NCCL's detail, got %v", err)
	}
	calls := f.Calls()
	if calls[len(calls)-1].Op != "CommAbort" {
		t.Fatal("the comm was not aborted")
	}
}

func TestAbortFromAnotherGoroutine(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{VirtualPeers: true})
	c, err := nccl.NewComm(context.Background(), f, 0, 2, 0, newID(t, f))
	if err != nil {
		t.Fatal(err)
	}
	p := fill(t, c, make([]byte, 8))
	stallBroadcasts(f)
	cause := errors.New("init_weight_transfer_engine answered 500")
	time.AfterFunc(30*time.Millisecond, func() { c.Abort(cause) })
	err = c.Broadcast(context.Background(), p, 8, nccl.Uint8)
	if !errors.Is(err, nccl.ErrAborted) || !errors.Is(err, cause) {
		t.Fatalf("got %v, want ErrAborted wrapping the caller's cause", err)
	}
	free(t, c, p)
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

func TestCloseWhileWaiting(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{VirtualPeers: true})
	c, err := nccl.NewComm(context.Background(), f, 0, 2, 0, newID(t, f))
	if err != nil {
		t.Fatal(err)
	}
	p := fill(t, c, make([]byte, 8))
	stallBroadcasts(f)
	done := make(chan error, 1)
	go func() { done <- c.Broadcast(context.Background(), p, 8, nccl.Uint8) }()
	time.Sleep(20 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, nccl.ErrAborted) {
		t.Fatalf("broadcast interrupted by Close: %v", err)
	}
	// The buffer outlived the comm's actor: free it on a fresh device actor.
	d, err := nccl.OpenDevice(f, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Do(context.Background(), func(api nccl.API) error { return api.Free(p) }); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

// The fake must catch a broadcast that is not ordered after its copy: the
// copy is held back on its stream, so only the event can order them.
func TestBroadcastAsyncOrdersAfterEvent(t *testing.T) {
	for _, ordered := range []bool{true, false} {
		f := nccltest.NewFake(nccltest.Config{VirtualPeers: true, KeepData: true})
		ctx := context.Background()
		c, err := nccl.NewComm(ctx, f, 0, 2, 0, newID(t, f))
		if err != nil {
			t.Fatal(err)
		}
		payload := []byte("ordered bytes")
		var p nccl.DevPtr
		var host []byte
		var copyStream nccl.Stream
		var copied, sent nccl.Event
		var release func()
		err = c.Device().Do(ctx, func(api nccl.API) error {
			var err error
			p, _ = api.Malloc(len(payload))
			host, _ = api.HostAlloc(len(payload), 0)
			copy(host, payload)
			copyStream, _ = api.StreamCreate(nccl.StreamNonBlocking)
			copied, _ = api.EventCreate(nccl.EventDisableTiming)
			sent, _ = api.EventCreate(nccl.EventDisableTiming)
			// Hold the copy until the broadcast was enqueued.
			if release, err = f.Hold(copyStream); err != nil {
				return err
			}
			if err = api.MemcpyHtoDAsync(p, host, copyStream); err != nil {
				return err
			}
			return api.EventRecord(copied, copyStream)
		})
		if err != nil {
			t.Fatal(err)
		}
		after := copied
		if !ordered {
			after = 0
		}
		if err := c.BroadcastAsync(ctx, p, len(payload), nccl.Uint8, nccl.Order{After: after, Done: sent}); err != nil {
			t.Fatal(err)
		}
		if !ordered {
			// Let the unordered broadcast run first, then the copy.
			time.Sleep(20 * time.Millisecond)
		}
		release()
		if err := c.WaitEvent(ctx, sent); err != nil {
			t.Fatal(err)
		}
		got := f.Collectives(0)[1].Data
		if ordered != bytes.Equal(got, payload) {
			t.Errorf("ordered=%v: broadcast carried %q", ordered, got)
		}
		_ = c.Device().Do(ctx, func(api nccl.API) error {
			_ = api.StreamSynchronize(copyStream)
			_ = api.StreamDestroy(copyStream)
			_ = api.EventDestroy(copied)
			_ = api.EventDestroy(sent)
			_ = api.FreeHost(host)
			return api.Free(p)
		})
		if err := c.Close(ctx); err != nil {
			t.Fatal(err)
		}
		if l := f.Leaks(); l != "" {
			t.Errorf("leaked %s", l)
		}
	}
}

func TestPeerAbortIsRemoteError(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{Devices: 2})
	id := newID(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var c1 *nccl.Comm
	var err1 error
	wg.Add(1)
	go func() {
		defer wg.Done()
		c1, err1 = nccl.NewComm(ctx, f, 1, 2, 1, id)
	}()
	c0, err := nccl.NewComm(ctx, f, 0, 2, 0, id)
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if err1 != nil {
		t.Fatal(err1)
	}
	p := fill(t, c1, make([]byte, 16))
	// Rank 1 waits in a broadcast rank 0 never issues; rank 0 gives up.
	done := make(chan error, 1)
	go func() { done <- c1.Broadcast(ctx, p, 16, nccl.Uint8) }()
	time.Sleep(10 * time.Millisecond)
	c0.Abort(errors.New("trainer gave up"))
	if err := <-done; !errors.Is(err, nccl.RemoteError) {
		t.Fatalf("peer saw %v, want ncclRemoteError", err)
	}
	free(t, c1, p)
	c1.Close(ctx)
	c0.Close(ctx)
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

// EventDone polls without holding the actor and surfaces the asynchronous
// error of a broadcast that cannot finish, aborting the communicator.
func TestEventDoneSeesAsyncError(t *testing.T) {
	f, c, p := commWith8Bytes(t)
	var done nccl.Event
	if err := c.Device().Do(context.Background(), func(api nccl.API) error {
		var err error
		done, err = api.EventCreate(nccl.EventDisableTiming)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Device().Do(context.Background(), func(api nccl.API) error { return api.EventDestroy(done) })
	// A healthy broadcast: EventDone turns true.
	if err := c.BroadcastAsync(context.Background(), p, 8, nccl.Uint8, nccl.Order{Done: done}); err != nil {
		t.Fatal(err)
	}
	for {
		ok, err := c.EventDone(context.Background(), done)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	// A broadcast whose peer died: EventDone fails with the remote error.
	remoteErrorOnBroadcasts(f)
	if err := c.BroadcastAsync(context.Background(), p, 8, nccl.Uint8, nccl.Order{Done: done}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		ok, err := c.EventDone(context.Background(), done)
		if err != nil {
			if !errors.Is(err, nccl.ErrAborted) || !errors.Is(err, nccl.RemoteError) {
				t.Fatalf("got %v, want ErrAborted wrapping ncclRemoteError", err)
			}
			break
		}
		if ok {
			t.Fatal("a failed broadcast's event reported done without an error")
		}
		if time.Now().After(deadline) {
			t.Fatal("EventDone never saw the asynchronous error")
		}
		time.Sleep(time.Millisecond)
	}
	if c.Err() == nil {
		t.Fatal("the communicator is not poisoned")
	}
}
