package vllm

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
)

// Fleet is every vLLM server of a pipeline. Pause and resume must reach
// each instance (a load balancer would deliver them to one), so they fan
// out in parallel and report per server.
type Fleet []*Client

// ServerError is one server's failure inside a FleetError.
type ServerError struct {
	Server string
	Err    error
}

// FleetError lists exactly which servers failed an operation and why.
type FleetError struct {
	Op     string // "pause", "resume", "world size"
	Total  int    // servers in the fleet
	Failed []ServerError
	// Rollback of a failed PauseAll: the servers resumed again (those that
	// paused and those whose pause outcome is unknown), and those whose
	// resume failed too (they may still be paused).
	Resumed      []string
	ResumeFailed []ServerError
}

func (e *FleetError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "vllm fleet: %s failed on %d of %d servers", e.Op, len(e.Failed), e.Total)
	for _, f := range e.Failed {
		fmt.Fprintf(&b, "; %v", f.Err)
	}
	if len(e.Resumed) > 0 {
		fmt.Fprintf(&b, "; resumed %s again", strings.Join(e.Resumed, ", "))
	}
	for _, f := range e.ResumeFailed {
		fmt.Fprintf(&b, "; resume failed too, may still be paused: %v", f.Err)
	}
	return b.String()
}

// Unwrap exposes every per-server error to errors.Is and errors.As.
func (e *FleetError) Unwrap() []error {
	var out []error
	for _, f := range e.Failed {
		out = append(out, f.Err)
	}
	for _, f := range e.ResumeFailed {
		out = append(out, f.Err)
	}
	return out
}

// each runs fn for every server in parallel; errs[i] is server i's error.
func (f Fleet) each(fn func(i int, c *Client) error) []error {
	errs := make([]error, len(f))
	var wg sync.WaitGroup
	for i, c := range f {
		wg.Go(func() { errs[i] = fn(i, c) })
	}
	wg.Wait()
	return errs
}

func (f Fleet) check(op string) error {
	if len(f) == 0 {
		return &FleetError{Op: op, Failed: []ServerError{{Server: "", Err: errors.New("vllm fleet: no servers")}}}
	}
	for i, c := range f {
		if c == nil {
			return &FleetError{Op: op, Total: len(f), Failed: []ServerError{{Err: fmt.Errorf("vllm fleet: server %d is nil", i)}}}
		}
	}
	return nil
}

// PauseAll pauses every server in mode. If any fails, it resumes the others
// so that generation is never left half-paused, and the *FleetError says
// which servers failed, which were resumed, and which resumes failed. A
// server whose pause outcome is unknown (no answer, timeout, 5xx) is resumed
// too, since it may have paused; one that answered 4xx did not pause. The
// rollback runs even when ctx is already done.
func (f Fleet) PauseAll(ctx context.Context, mode string) error {
	if err := f.check("pause"); err != nil {
		return err
	}
	errs := f.each(func(_ int, c *Client) error { return c.Pause(ctx, mode) })
	fe := &FleetError{Op: "pause", Total: len(f)}
	var undo []int
	for i, err := range errs {
		if err != nil {
			fe.Failed = append(fe.Failed, ServerError{Server: f[i].base, Err: err})
			var e *Error
			if errors.As(err, &e) && e.Status >= 400 && e.Status < 500 {
				continue
			}
		}
		undo = append(undo, i)
	}
	if len(fe.Failed) == 0 {
		return nil
	}
	rctx := context.WithoutCancel(ctx)
	rerrs := make([]error, len(undo))
	var wg sync.WaitGroup
	for k, i := range undo {
		wg.Go(func() { rerrs[k] = f[i].Resume(rctx) })
	}
	wg.Wait()
	for k, i := range undo {
		if rerrs[k] != nil {
			fe.ResumeFailed = append(fe.ResumeFailed, ServerError{Server: f[i].base, Err: rerrs[k]})
		} else {
			fe.Resumed = append(fe.Resumed, f[i].base)
		}
	}
	return fe
}

// ResumeAll resumes every server, also after some fail (each is tried).
func (f Fleet) ResumeAll(ctx context.Context) error {
	if err := f.check("resume"); err != nil {
		return err
	}
	errs := f.each(func(_ int, c *Client) error { return c.Resume(ctx) })
	return f.collect("resume", errs)
}

func (f Fleet) collect(op string, errs []error) error {
	fe := &FleetError{Op: op, Total: len(f)}
	for i, err := range errs {
		if err != nil {
			fe.Failed = append(fe.Failed, ServerError{Server: f[i].base, Err: err})
		}
	}
	if len(fe.Failed) == 0 {
		return nil
	}
	return fe
}

// Topology is the NCCL group a fleet forms with the trainer (rank 0).
type Topology struct {
	Sizes       []int // each server's world size, including DP, in fleet order
	RankOffsets []int // each server's first rank: 1, 1+Sizes[0], ...
	WorldSize   int   // 1 + sum(Sizes)
}

// WorldSizes asks every server for its world size (DP included) and lays
// the servers out after the trainer in fleet order.
func (f Fleet) WorldSizes(ctx context.Context) (Topology, error) {
	if err := f.check("world size"); err != nil {
		return Topology{}, err
	}
	sizes := make([]int, len(f))
	errs := f.each(func(i int, c *Client) (err error) {
		sizes[i], err = c.WorldSize(ctx, true)
		return err
	})
	if err := f.collect("world size", errs); err != nil {
		return Topology{}, err
	}
	t := Topology{Sizes: sizes, RankOffsets: make([]int, len(f)), WorldSize: 1}
	for i, s := range sizes {
		t.RankOffsets[i] = t.WorldSize
		t.WorldSize += s
	}
	return t, nil
}
