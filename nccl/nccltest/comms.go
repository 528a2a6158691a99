package nccltest

import (
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// ---- NCCL ----

type fakeGroup struct {
	world   int
	members map[int]*fakeComm
	ready   bool // every rank joined (or is virtual)
	slots   map[int]*fakeSlot
}

type fakeSlot struct {
	posts map[int]*fakePost
	done  bool
}

type fakePost struct {
	call *Call
	comm *fakeComm
}

type fakeComm struct {
	h          nccl.CommHandle
	g          *fakeGroup
	rank, dev  int
	blocking   bool
	asyncErr   nccl.Result
	detail     string
	aborted    bool
	finalizing bool
	next       int // next collective index
}

func (f *Fake) NCCLVersion() (int, error) { return 22803, nil }

func (f *Fake) GetUniqueID() (nccl.UniqueID, error) {
	f.mu.Lock()
	f.idSeq++
	seq := f.idSeq
	f.mu.Unlock()
	var id nccl.UniqueID
	copy(id[:], "rlflow-fake-nccl")
	binary.LittleEndian.PutUint64(id[16:], seq)
	binary.LittleEndian.PutUint64(id[24:], uint64(time.Now().UnixNano()))
	return id, nil
}

func (f *Fake) record(c Call) *Call {
	c.Thread = nccl.ThreadID()
	f.calls = append(f.calls, &c)
	return &c
}

func (f *Fake) groupReady(g *fakeGroup) bool {
	if f.cfg.VirtualPeers {
		return g.members[0] != nil
	}
	return len(g.members) == g.world
}

func (f *Fake) CommInitRank(nranks int, id nccl.UniqueID, rank int) (nccl.CommHandle, error) {
	h, err := f.CommInitRankConfig(nranks, id, rank, nccl.CommConfig{Blocking: true})
	return h, err
}

func (f *Fake) CommInitRankConfig(nranks int, id nccl.UniqueID, rank int, cfg nccl.CommConfig) (nccl.CommHandle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if nranks < 1 || rank < 0 || rank >= nranks {
		return 0, &nccl.Error{Func: "ncclCommInitRankConfig", Code: nccl.InvalidArgument, Detail: fmt.Sprintf("rank %d of %d", rank, nranks)}
	}
	g := f.groups[id]
	if g == nil {
		g = &fakeGroup{world: nranks, members: map[int]*fakeComm{}, slots: map[int]*fakeSlot{}}
		f.groups[id] = g
	}
	if g.world != nranks || g.members[rank] != nil {
		return 0, &nccl.Error{Func: "ncclCommInitRankConfig", Code: nccl.InvalidUsage, Detail: fmt.Sprintf("rank %d of %d does not fit the group (world %d)", rank, nranks, g.world)}
	}
	c := &fakeComm{h: nccl.CommHandle(f.handle()), g: g, rank: rank, dev: f.device(), blocking: cfg.Blocking}
	f.comms[c.h] = c
	g.members[rank] = c
	f.record(Call{Op: "CommInitRank", Comm: c.h, Rank: rank, World: nranks, Device: c.dev})
	if f.groupReady(g) && !g.ready {
		if f.cfg.VirtualPeers && f.cfg.VirtualJoinDelay > 0 {
			time.AfterFunc(f.cfg.VirtualJoinDelay, func() {
				f.mu.Lock()
				g.ready = true
				f.cond.Broadcast()
				f.mu.Unlock()
			})
		} else {
			g.ready = true
		}
	}
	f.cond.Broadcast()
	if !cfg.Blocking {
		if g.ready {
			return c.h, nil
		}
		return c.h, &nccl.Error{Func: "ncclCommInitRankConfig", Code: nccl.InProgress}
	}
	for !g.ready && !c.aborted && c.asyncErr == 0 {
		f.cond.Wait()
	}
	if c.asyncErr != 0 {
		return c.h, &nccl.Error{Func: "ncclCommInitRank", Code: c.asyncErr, Detail: c.detail}
	}
	return c.h, nil
}

func (f *Fake) comm(h nccl.CommHandle, fn string) (*fakeComm, error) {
	c := f.comms[h]
	if c == nil {
		return nil, &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: fmt.Sprintf("no communicator %#x (destroyed or aborted?)", uintptr(h))}
	}
	return c, nil
}

func (f *Fake) CommGetAsyncError(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommGetAsyncError")
	if err != nil {
		return err
	}
	switch {
	case c.asyncErr != 0:
		return &nccl.Error{Func: "ncclCommGetAsyncError (async)", Code: c.asyncErr, Detail: c.detail}
	case !c.g.ready:
		return &nccl.Error{Func: "ncclCommGetAsyncError (async)", Code: nccl.InProgress}
	case c.finalizing:
		c.finalizing = false // answer InProgress once, like a real flush
		return &nccl.Error{Func: "ncclCommGetAsyncError (async)", Code: nccl.InProgress}
	}
	return nil
}

func (f *Fake) AllReduce(send, recv nccl.DevPtr, count int, dt nccl.DataType, op nccl.RedOp, h nccl.CommHandle, s nccl.Stream) error {
	if dt != nccl.Float32 || op != nccl.Sum {
		return &nccl.Error{Func: "ncclAllReduce", Code: nccl.InvalidArgument, Detail: "the fake implements float32 sum only"}
	}
	return f.collective(Call{Op: "AllReduce", Count: count, DType: dt, Bytes: count * dt.Size(), Send: send, Recv: recv}, h, s)
}

func (f *Fake) Broadcast(send, recv nccl.DevPtr, count int, dt nccl.DataType, root int, h nccl.CommHandle, s nccl.Stream) error {
	if !dt.Valid() {
		return &nccl.Error{Func: "ncclBroadcast", Code: nccl.InvalidArgument, Detail: dt.String()}
	}
	return f.collective(Call{Op: "Broadcast", Count: count, DType: dt, Bytes: count * dt.Size(), Root: root, Send: send, Recv: recv}, h, s)
}

func (f *Fake) collective(call Call, h nccl.CommHandle, s nccl.Stream) error {
	fn := "nccl" + call.Op
	f.mu.Lock()
	c, err := f.comm(h, fn)
	if err != nil {
		f.mu.Unlock()
		return err
	}
	if !c.g.ready {
		f.mu.Unlock()
		return &nccl.Error{Func: fn, Code: nccl.InvalidUsage, Detail: "communicator initialisation not complete"}
	}
	if call.Root < 0 || call.Root >= c.g.world {
		f.mu.Unlock()
		return &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: fmt.Sprintf("root %d", call.Root)}
	}
	for _, p := range []nccl.DevPtr{call.Send, call.Recv} {
		_, dev, err := f.devSlice(p, call.Bytes)
		if err != nil {
			f.mu.Unlock()
			return &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: err.Error()}
		}
		if dev != c.dev {
			f.mu.Unlock()
			return &nccl.Error{Func: fn, Code: nccl.InvalidArgument, Detail: fmt.Sprintf("buffer %#x is on device %d, the communicator on %d", uintptr(p), dev, c.dev)}
		}
	}
	call.Comm, call.Rank, call.World, call.Device = h, c.rank, c.g.world, c.dev
	call.Index = c.next
	c.next++
	rec := f.record(call)
	f.mu.Unlock()
	return f.enqueue(s, fn, func() error { return f.execute(c, rec) })
}

// execute runs on the stream's drainer: post this rank's part and wait for
// the other ranks, a fault, or abort.
func (f *Fake) execute(c *fakeComm, call *Call) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	fault := Fault{}
	if f.hook != nil {
		hook, snapshot := f.hook, *call
		f.mu.Unlock()
		fault = hook(snapshot)
		f.mu.Lock()
	}
	if fault.Stall || fault.Err != 0 {
		if fault.Err != 0 {
			time.AfterFunc(fault.Delay, func() {
				f.mu.Lock()
				if !c.aborted && c.asyncErr == 0 {
					c.asyncErr, c.detail = fault.Err, "injected by the fake"
				}
				f.cond.Broadcast()
				f.mu.Unlock()
			})
		}
		for !c.aborted {
			f.cond.Wait()
		}
		return nil
	}
	g := c.g
	slot := g.slots[call.Index]
	if slot == nil {
		slot = &fakeSlot{posts: map[int]*fakePost{}}
		g.slots[call.Index] = slot
	}
	slot.posts[c.rank] = &fakePost{call: call, comm: c}
	need := g.world
	if f.cfg.VirtualPeers {
		need = 1
	}
	if len(slot.posts) == need && !slot.done {
		f.complete(g, slot)
	}
	for !slot.done && !c.aborted && c.asyncErr == 0 {
		f.cond.Wait()
	}
	return nil
}

// complete moves the bytes of one collective once every real rank posted
// it. Ranks that disagree about the collective get ncclInvalidUsage: real
// NCCL would hang or corrupt memory, the fake says what went wrong.
func (f *Fake) complete(g *fakeGroup, slot *fakeSlot) {
	defer f.cond.Broadcast()
	slot.done = true
	var first *Call
	for _, p := range slot.posts {
		if first == nil {
			first = p.call
			continue
		}
		c := p.call
		if c.Op != first.Op || c.Count != first.Count || c.DType != first.DType || c.Root != first.Root {
			for _, q := range slot.posts {
				q.comm.asyncErr = nccl.InvalidUsage
				q.comm.detail = fmt.Sprintf("collective %d mismatch: rank %d %s %d x %v root %d, rank %d %s %d x %v root %d",
					c.Index, first.Rank, first.Op, first.Count, first.DType, first.Root, c.Rank, c.Op, c.Count, c.DType, c.Root)
			}
			return
		}
	}
	switch first.Op {
	case "Broadcast":
		root := slot.posts[first.Root]
		if root == nil { // only with virtual peers: the root is simulated
			return
		}
		src, _, err := f.devSlice(root.call.Send, root.call.Bytes)
		if err != nil {
			root.comm.asyncErr, root.comm.detail = nccl.UnhandledCudaError, err.Error()
			return
		}
		if f.cfg.KeepData {
			root.call.Data = append([]byte(nil), src...)
		}
		for _, p := range slot.posts {
			dst, _, err := f.devSlice(p.call.Recv, p.call.Bytes)
			if err != nil {
				p.comm.asyncErr, p.comm.detail = nccl.UnhandledCudaError, err.Error()
				continue
			}
			copy(dst, src)
		}
	case "AllReduce":
		sum := make([]float32, first.Count)
		for _, p := range slot.posts {
			b, _, _ := f.devSlice(p.call.Send, p.call.Bytes)
			for i := range sum {
				sum[i] += math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
			}
		}
		for _, p := range slot.posts {
			b, _, _ := f.devSlice(p.call.Recv, p.call.Bytes)
			for i, v := range sum {
				binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
			}
		}
	}
}

func (f *Fake) CommAbort(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommAbort")
	if err != nil {
		return err
	}
	f.record(Call{Op: "CommAbort", Comm: h, Rank: c.rank, World: c.g.world, Device: c.dev})
	c.aborted = true
	f.leave(c)
	// The other ranks' sockets close: they see a remote error, as with NCCL.
	for _, m := range c.g.members {
		if m.asyncErr == 0 {
			m.asyncErr, m.detail = nccl.RemoteError, fmt.Sprintf("rank %d aborted its communicator", c.rank)
		}
	}
	f.cond.Broadcast()
	return nil
}

func (f *Fake) leave(c *fakeComm) {
	delete(f.comms, c.h)
	if c.g.members[c.rank] == c {
		delete(c.g.members, c.rank)
	}
}

func (f *Fake) CommFinalize(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommFinalize")
	if err != nil {
		return err
	}
	f.record(Call{Op: "CommFinalize", Comm: h, Rank: c.rank, World: c.g.world, Device: c.dev})
	if !c.blocking {
		c.finalizing = true
		return &nccl.Error{Func: "ncclCommFinalize", Code: nccl.InProgress}
	}
	return nil
}

func (f *Fake) CommDestroy(h nccl.CommHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, err := f.comm(h, "ncclCommDestroy")
	if err != nil {
		return err
	}
	f.record(Call{Op: "CommDestroy", Comm: h, Rank: c.rank, World: c.g.world, Device: c.dev})
	f.leave(c)
	f.cond.Broadcast()
	return nil
}
