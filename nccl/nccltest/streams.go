package nccltest

import (
	"fmt"
	"time"

	"github.com/rlflow/rlflow/nccl"
)

// ---- streams ----

type fakeStream struct {
	dev     int
	q       []func() error
	pending int // queued + running
	err     error
	closing bool
}

func (f *Fake) newStream(dev int) *fakeStream {
	s := &fakeStream{dev: dev}
	go f.drain(s)
	return s
}

// drain executes s's operations in order, one at a time.
func (f *Fake) drain(s *fakeStream) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for {
		for len(s.q) == 0 && !s.closing {
			f.cond.Wait()
		}
		if len(s.q) == 0 {
			return
		}
		op := s.q[0]
		s.q = s.q[1:]
		f.mu.Unlock()
		if f.cfg.OpDelay > 0 {
			time.Sleep(f.cfg.OpDelay)
		}
		err := op()
		f.mu.Lock()
		if err != nil && s.err == nil {
			s.err = err // sticky, like a failed kernel
		}
		s.pending--
		f.cond.Broadcast()
	}
}

func (f *Fake) stream(s nccl.Stream) (*fakeStream, error) {
	if s == 0 {
		d := f.device()
		st := f.defStr[d]
		if st == nil {
			st = f.newStream(d)
			f.defStr[d] = st
		}
		return st, nil
	}
	st := f.streams[s]
	if st == nil {
		return nil, &nccl.Error{Func: "fake", Code: nccl.CudaErrorInvalidHandle, Detail: fmt.Sprintf("no stream %#x", uintptr(s))}
	}
	return st, nil
}

func (f *Fake) enqueue(s nccl.Stream, fn string, op func() error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.stream(s)
	if err != nil {
		return fmt.Errorf("%s: %w", fn, err)
	}
	st.q = append(st.q, op)
	st.pending++
	f.cond.Broadcast()
	return nil
}

func (f *Fake) StreamCreate(flags uint) (nccl.Stream, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h := nccl.Stream(f.handle())
	f.streams[h] = f.newStream(f.device())
	return h, nil
}

func (f *Fake) StreamDestroy(s nccl.Stream) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.streams[s]
	if st == nil {
		return &nccl.Error{Func: "cudaStreamDestroy", Code: nccl.CudaErrorInvalidHandle}
	}
	// CUDA lets pending work finish after destroy; so does the drainer.
	st.closing = true
	delete(f.streams, s)
	f.cond.Broadcast()
	return nil
}

func (f *Fake) StreamSynchronize(s nccl.Stream) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.stream(s)
	if err != nil {
		return err
	}
	for st.pending > 0 {
		f.cond.Wait()
	}
	return st.err
}

func (f *Fake) StreamQuery(s nccl.Stream) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.stream(s)
	if err != nil {
		return false, err
	}
	if st.err != nil {
		return false, st.err
	}
	return st.pending == 0, nil
}

func (f *Fake) DeviceSynchronize() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.device()
	for {
		busy := false
		for _, st := range f.streams {
			if st.dev == d && st.pending > 0 {
				busy = true
			}
		}
		if st := f.defStr[d]; st != nil && st.pending > 0 {
			busy = true
		}
		if !busy {
			return nil
		}
		f.cond.Wait()
	}
}

// ---- events ----

type fakeEvent struct {
	flags     uint
	recorded  int // records enqueued
	completed int // records executed
	at        time.Time
}

func (f *Fake) EventCreate(flags uint) (nccl.Event, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h := nccl.Event(f.handle())
	f.events[h] = &fakeEvent{flags: flags}
	return h, nil
}

func (f *Fake) event(e nccl.Event) (*fakeEvent, error) {
	ev := f.events[e]
	if ev == nil {
		return nil, &nccl.Error{Func: "fake", Code: nccl.CudaErrorInvalidHandle, Detail: fmt.Sprintf("no event %#x", uintptr(e))}
	}
	return ev, nil
}

func (f *Fake) EventRecord(e nccl.Event, s nccl.Stream) error {
	f.mu.Lock()
	ev, err := f.event(e)
	if err != nil {
		f.mu.Unlock()
		return err
	}
	ev.recorded++
	target := ev.recorded
	f.mu.Unlock()
	return f.enqueue(s, "cudaEventRecord", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		if target > ev.completed {
			ev.completed = target
			ev.at = time.Now()
		}
		return nil
	})
}

func (f *Fake) StreamWaitEvent(s nccl.Stream, e nccl.Event) error {
	f.mu.Lock()
	ev, err := f.event(e)
	if err != nil {
		f.mu.Unlock()
		return err
	}
	target := ev.recorded // the most recent record at the time of the call
	f.mu.Unlock()
	return f.enqueue(s, "cudaStreamWaitEvent", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		for ev.completed < target {
			f.cond.Wait()
		}
		return nil
	})
}

func (f *Fake) EventSynchronize(e nccl.Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev, err := f.event(e)
	if err != nil {
		return err
	}
	for ev.completed < ev.recorded {
		f.cond.Wait()
	}
	return nil
}

func (f *Fake) EventQuery(e nccl.Event) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev, err := f.event(e)
	if err != nil {
		return false, err
	}
	return ev.completed >= ev.recorded, nil
}

func (f *Fake) EventElapsedTime(start, end nccl.Event) (time.Duration, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a, err := f.event(start)
	if err != nil {
		return 0, err
	}
	b, err := f.event(end)
	if err != nil {
		return 0, err
	}
	if a.flags&nccl.EventDisableTiming != 0 || b.flags&nccl.EventDisableTiming != 0 || a.recorded == 0 || b.recorded == 0 {
		return 0, &nccl.Error{Func: "cudaEventElapsedTime", Code: nccl.CudaErrorInvalidHandle}
	}
	if a.completed < a.recorded || b.completed < b.recorded {
		return 0, &nccl.Error{Func: "cudaEventElapsedTime", Code: nccl.CudaErrorNotReady}
	}
	return b.at.Sub(a.at), nil
}

func (f *Fake) EventDestroy(e nccl.Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.events[e]; !ok {
		return &nccl.Error{Func: "cudaEventDestroy", Code: nccl.CudaErrorInvalidHandle}
	}
	delete(f.events, e)
	return nil
}
