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
	Index  int // in the fleet; -1 when no server is meant
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

// Each runs fn for every server in parallel and waits for all of them. It
// returns nil when every call succeeded, else a *FleetError naming each
// failed server (in fleet order) with its error.
func (f Fleet) Each(op string, fn func(i int, c *Client) error) error {
	if err := f.check(op); err != nil {
		return err
	}
	errs := make([]error, len(f))
	var wg sync.WaitGroup
	for i, c := range f {
		wg.Go(func() { errs[i] = fn(i, c) })
	}
	wg.Wait()
	fe := &FleetError{Op: op, Total: len(f)}
	for i, err := range errs {
		if err != nil {
			fe.Failed = append(fe.Failed, ServerError{Index: i, Server: f[i].base, Err: err})
		}
	}
	if len(fe.Failed) == 0 {
		return nil
	}
	return fe
}

func (f Fleet) check(op string) error {
	if len(f) == 0 {
		return &FleetError{Op: op, Failed: []ServerError{{Index: -1, Err: errors.New("vllm fleet: no servers")}}}
	}
	for i, c := range f {
		if c == nil {
			return &FleetError{Op: op, Total: len(f), Failed: []ServerError{{Index: i, Err: fmt.Errorf("vllm fleet: server %d is nil", i)}}}
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
	err := f.Each("pause", func(_ int, c *Client) error { return c.Pause(ctx, mode) })
	var fe *FleetError
	if err == nil || !errors.As(err, &fe) || fe.Total == 0 {
		return err
	}
	refused := map[int]bool{}
	for _, sf := range fe.Failed {
		var e *Error
		if errors.As(sf.Err, &e) && e.Status >= 400 && e.Status < 500 {
			refused[sf.Index] = true
		}
	}
	var undo Fleet
	for i, c := range f {
		if !refused[i] {
			undo = append(undo, c)
		}
	}
	if len(undo) == 0 {
		return fe
	}
	rctx := context.WithoutCancel(ctx)
	rerr := undo.Each("resume", func(_ int, c *Client) error { return c.Resume(rctx) })
	failed := map[*Client]error{}
	var rfe *FleetError
	if errors.As(rerr, &rfe) {
		for _, sf := range rfe.Failed {
			failed[undo[sf.Index]] = sf.Err
		}
	}
	for _, c := range undo {
		if err, ok := failed[c]; ok {
			fe.ResumeFailed = append(fe.ResumeFailed, ServerError{Index: indexOf(f, c), Server: c.base, Err: err})
		} else {
			fe.Resumed = append(fe.Resumed, c.base)
		}
	}
	return fe
}

func indexOf(f Fleet, c *Client) int {
	for i, x := range f {
		if x == c {
			return i
		}
	}
	return -1
}

// ResumeAll resumes every server, also after some fail (each is tried).
func (f Fleet) ResumeAll(ctx context.Context) error {
	return f.Each("resume", func(_ int, c *Client) error { return c.Resume(ctx) })
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
	sizes := make([]int, len(f))
	err := f.Each("world size", func(i int, c *Client) (err error) {
		sizes[i], err = c.WorldSize(ctx, true)
		return err
	})
	if err != nil {
		return Topology{}, err
	}
	t := Topology{Sizes: sizes, RankOffsets: make([]int, len(f)), WorldSize: 1}
	for i, s := range sizes {
		t.RankOffsets[i] = t.WorldSize
		t.WorldSize += s
	}
	return t, nil
}
