package staging

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/ncclid"
	"github.com/rlflow/rlflow/nccl/nccltest"
	"github.com/rlflow/rlflow/nccl/tcpstore"
)

// fakeWorker does what a vLLM worker does against rank 0's store (as a torch
// client: VALIDATE, PING, ADD init/, WAIT, GET), then joins the fake NCCL
// group with the unpickled id.
func fakeWorker(ctx context.Context, f *nccltest.Fake, port, world, rank int) (*nccl.Comm, error) {
	cl, err := tcpstore.Dial(ctx, fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	if _, err := cl.Add(ctx, tcpstore.InitKey, 1); err != nil {
		return nil, err
	}
	if err := cl.Wait(ctx, tcpstore.UniqueIDKey); err != nil {
		return nil, err
	}
	raw, err := cl.Get(ctx, tcpstore.UniqueIDKey)
	if err != nil {
		return nil, err
	}
	id, err := ncclid.Unpickle(raw)
	if err != nil {
		return nil, err
	}
	return nccl.NewComm(ctx, f, rank, world, rank, nccl.UniqueID(id))
}

func TestRendezvousWithWorkers(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{Devices: 3})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var workers []*nccl.Comm
	gotPort := 0
	init := func(ctx context.Context, port int, _ nccl.UniqueID) error {
		gotPort = port
		// Like /init_weight_transfer_engine: returns once every worker joined.
		errs := make(chan error, 2)
		comms := make(chan *nccl.Comm, 2)
		for rank := 1; rank <= 2; rank++ {
			go func() {
				c, err := fakeWorker(ctx, f, port, 3, rank)
				errs <- err
				comms <- c
			}()
		}
		for i := 0; i < 2; i++ {
			if err := <-errs; err != nil {
				return err
			}
			workers = append(workers, <-comms)
		}
		return nil
	}
	comm, err := Rendezvous(ctx, RendezvousConfig{MasterAddress: "127.0.0.1", WorldSize: 3}, f, init)
	if err != nil {
		t.Fatal(err)
	}
	if comm.Rank() != 0 || comm.WorldSize() != 3 || gotPort == 0 {
		t.Fatalf("rank %d of %d, port %d", comm.Rank(), comm.WorldSize(), gotPort)
	}
	// Every rank ran the warm-up all-reduce as collective 0.
	for r := 0; r < 3; r++ {
		c := f.Collectives(r)
		if len(c) != 1 || c[0].Op != "AllReduce" || c[0].Count != 1 || c[0].DType != nccl.Float32 {
			t.Fatalf("rank %d collectives %+v, want the warm-up", r, c)
		}
	}
	// The store is closed once the rendezvous is over.
	if conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", gotPort), time.Second); err == nil {
		conn.Close()
		t.Error("TCPStore still listening after Rendezvous returned")
	}
	for _, w := range append(workers, comm) {
		if err := w.Close(ctx); err != nil {
			t.Error(err)
		}
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
}

func TestRendezvousInitFailsEarly(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	http500 := errors.New("POST /init_weight_transfer_engine: 500 Internal Server Error")
	start := time.Now()
	_, err := Rendezvous(ctx, RendezvousConfig{MasterAddress: "127.0.0.1", WorldSize: 2}, f,
		func(ctx context.Context, port int, _ nccl.UniqueID) error {
			time.Sleep(20 * time.Millisecond)
			return http500
		})
	if !errors.Is(err, http500) {
		t.Fatalf("got %v, want the init call's error", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("took %v: the communicator should be aborted at once", d)
	}
	calls := f.Calls()
	if len(calls) == 0 || calls[len(calls)-1].Op != "CommAbort" {
		t.Fatalf("calls %v: want the half-built communicator aborted", calls)
	}
	if !strings.Contains(err.Error(), "no worker connected") {
		t.Errorf("error should say no worker reached the store: %v", err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
	t.Logf("error: %v", err)
}

func TestRendezvousPeerNeverJoins(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := Rendezvous(ctx, RendezvousConfig{MasterAddress: "127.0.0.1", WorldSize: 2}, f,
		func(ctx context.Context, port int, _ nccl.UniqueID) error {
			// The worker reaches the store but never joins NCCL.
			cl, err := tcpstore.Dial(ctx, fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				return err
			}
			defer cl.Close()
			if _, err := cl.Add(ctx, tcpstore.InitKey, 1); err != nil {
				return err
			}
			<-ctx.Done()
			return ctx.Err()
		})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want the deadline", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("took %v after a 200ms deadline", d)
	}
	if !strings.Contains(err.Error(), "1 of 1 workers connected") {
		t.Errorf("error should count the workers that reached the store: %v", err)
	}
	if l := f.Leaks(); l != "" {
		t.Errorf("leaked %s", l)
	}
	t.Logf("error: %v", err)
}

func TestRendezvousRefusesBadConfig(t *testing.T) {
	f := nccltest.NewFake(nccltest.Config{})
	noop := func(context.Context, int, nccl.UniqueID) error { return nil }
	for _, cfg := range []RendezvousConfig{
		{WorldSize: 2},
		{MasterAddress: "127.0.0.1", WorldSize: 1},
	} {
		if _, err := Rendezvous(context.Background(), cfg, f, noop); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
}
