package activities

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/temporal"
)

// Generate and evaluate never keep a sample from weights the run does not
// expect. Every server is checked at the start of an attempt, every
// heartbeat interval while it generates, after a request of it came back
// aborted (a pause), and at the end; each sample is kept (confirmed in the
// partial file) only once a check after its answer found its server still
// on the weights the attempt's first check saw, and the rows a server
// answered since its last good check are voided when a check finds it
// stale, so that the retry after the re-sync regenerates exactly those.
// Samples a killed attempt left unconfirmed are confirmed by the next
// attempt's first check when their server still serves what it served
// then, so a kill alone costs no answered sample.
//
// A check reads the server's weight version (GET /weight_info, C and D)
// and its process start time (process_start_time_seconds on GET /metrics,
// any generation), each where the server has it. A server that reports
// neither cannot be checked.

// Weight-check signals: GenerateOutput.WeightCheck names the weakest one
// the servers gave.
const (
	// WeightCheckVersion: every server reports its weight version (and,
	// where it exports one, its start time, which also catches a restart
	// followed by a re-sync between two checks).
	WeightCheckVersion = "weight_version"
	// WeightCheckStartTime: some server reports no version, only its start
	// time: a restart is caught, a weight change without one is not. An
	// attempt cannot tell a restart before its start from a re-sync.
	WeightCheckStartTime = "start_time"
	// WeightCheckNone: some server reports neither.
	WeightCheckNone = "none"
)

// serverState is what one check saw of a server.
type serverState struct {
	Version    string  `json:"version"`
	HasVersion bool    `json:"has_version"`
	StartTime  float64 `json:"start_time,omitempty"`
	HasStart   bool    `json:"has_start_time"`
}

func (s serverState) signal() string {
	switch {
	case s.HasVersion:
		return WeightCheckVersion
	case s.HasStart:
		return WeightCheckStartTime
	}
	return WeightCheckNone
}

// weakestSignal is the weakest signal of states.
func weakestSignal(states []serverState) string {
	rank := map[string]int{WeightCheckVersion: 0, WeightCheckStartTime: 1, WeightCheckNone: 2}
	out := WeightCheckVersion
	for _, s := range states {
		if sig := s.signal(); rank[sig] > rank[out] {
			out = sig
		}
	}
	return out
}

// served names a version as a problem text shows it.
func served(v string) string {
	if v == "" {
		return "no weight version, so the weights it started with,"
	}
	return fmt.Sprintf("weight version %q", v)
}

func expected(want *pipelines.ExpectedWeights) string {
	s := fmt.Sprintf("the run expects weight version %q", want.Version)
	if want.Checkpoint != "" {
		s += " (its last sync, " + want.Checkpoint + ")"
	}
	return s
}

func startTime(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// judge says why a server seen now (and, at its last good check, as was;
// nil at the attempt's start) cannot have served the weights the run
// expects all along, or "". Without an expected version, the weights must
// not change: a restart means the weights it started with, so one is the
// same weights only where the server served those before and after (no
// version, or none loaded). Without a version nothing can be compared but
// the start time.
func judge(was *serverState, now serverState, want *pipelines.ExpectedWeights) string {
	if was != nil {
		switch {
		case was.HasVersion && !now.HasVersion:
			return "no longer reports a weight version on GET /weight_info: another server answers at its address"
		case was.HasStart && !now.HasStart:
			return "no longer exports " + vllm.StartTimeMetric + " on GET /metrics: another server answers at its address"
		}
	}
	restarted := ""
	if was != nil && was.HasStart && was.StartTime != now.StartTime {
		restarted = fmt.Sprintf("restarted (%s on GET /metrics went from %s to %s)", vllm.StartTimeMetric, startTime(was.StartTime), startTime(now.StartTime))
	}
	if want != nil && want.Version != "" && now.HasVersion && now.Version != want.Version {
		p := fmt.Sprintf("serves %s on GET /weight_info; %s", served(now.Version), expected(want))
		if restarted != "" {
			p = restarted + " and " + p
		}
		return p
	}
	switch {
	case was == nil:
		return ""
	case was.HasVersion && was.Version != now.Version:
		p := fmt.Sprintf("served %s at its last good check and %s now on GET /weight_info: the weights changed under the step", served(was.Version), served(now.Version))
		if restarted != "" {
			p = restarted + ": it " + p
		}
		return p
	case restarted != "" && want != nil:
		return restarted + ": a restarted server serves the weights it started with; " + expected(want)
	case restarted != "" && was.HasVersion && was.Version != "":
		return restarted + fmt.Sprintf(" and serves %s again: its samples since its last good check may come from the weights it started with", served(now.Version))
	}
	return ""
}

// serverCheck is one server's weight check within an attempt: the epoch
// its first check opened, and the answers it gave in it.
type serverCheck struct {
	epoch int
	state serverState // what the attempt's first check saw: its rows' label
	seq   atomic.Int64

	mu        sync.Mutex // one check at a time, so confirms only grow
	confirmed int64
	problem   string // why its rows from `confirmed` on are void; "" while good
}

// observe reads what server i serves: its version and start time where it
// reports them. A route the server lacks (404, or an API generation
// without it) is a signal it does not give. With prev (what the attempt's
// first check saw), only the signals the server gave then are read again:
// losing one is a change, gaining one is not.
func (g *genRun) observe(ctx context.Context, i int, prev *serverState) (serverState, error) {
	var st serverState
	c := g.fleet[i]
	if prev == nil || prev.HasVersion {
		v, err := c.WeightInfo(ctx)
		switch {
		case err == nil:
			st.Version, st.HasVersion = v, true
		case !notAvailable(err):
			return st, err
		}
	}
	if prev == nil || prev.HasStart {
		t, ok, err := c.ProcessStartTime(ctx)
		switch {
		case err == nil:
			st.StartTime, st.HasStart = t, ok
		case !notAvailable(err):
			return st, err
		}
	}
	return st, nil
}

// check checks server i now: it confirms the server's rows answered before
// the check (emitting a confirm), or voids those since its last good check
// (emitting a void) and returns why. A server found stale stays so.
func (g *genRun) check(ctx context.Context, i int, emit func(record)) (problem string, err error) {
	sc := g.checks[i]
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.problem != "" {
		return sc.problem, nil
	}
	upto := sc.seq.Load() // answered before the check asks
	now, err := g.observe(ctx, i, &sc.state)
	if err != nil {
		return "", err
	}
	if problem = judge(&sc.state, now, g.in.Context.Weights); problem != "" {
		sc.problem = problem
		emit(voidRec(sc.epoch, sc.confirmed, problem))
		return problem, nil
	}
	if upto > sc.confirmed {
		sc.confirmed = upto
		emit(confirmRec(sc.epoch, upto))
	}
	return "", nil
}

// checkAll checks every server at once; stale maps the stale ones to why.
func (g *genRun) checkAll(ctx context.Context, emit func(record)) (stale map[int]string, err error) {
	var mu sync.Mutex
	stale = map[int]string{}
	err = g.fleet.Each("check weights", func(i int, _ *vllm.Client) error {
		problem, err := g.check(ctx, i, emit)
		if problem != "" {
			mu.Lock()
			stale[i] = problem
			mu.Unlock()
		}
		return err
	})
	if err != nil {
		return stale, serverError(ctx, err, "%s: checking the servers' weights", g.step)
	}
	return stale, nil
}

// errStale stops an attempt's generation when a check found a server
// stale; the attempt then reports every stale server (staleWeightsError).
var errStale = errors.New("a server serves other weights")

// staleWeightsError is the StaleWeights error naming each stale server;
// its second detail (pipelines.StaleServers) tells the interpreter which
// servers to re-sync.
func (g *genRun) staleWeightsError(ctx context.Context, stale map[int]string) error {
	idx := make([]int, 0, len(stale))
	for i := range stale {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	ss := pipelines.StaleServers{Indexes: idx, URLs: make([]string, len(idx))}
	msgs := make([]string, len(idx))
	for j, i := range idx {
		ss.URLs[j] = g.fleet[i].URL()
		msgs[j] = fmt.Sprintf("servers[%d] %s %s", i, g.fleet[i].URL(), stale[i])
	}
	msg := fmt.Sprintf("%s: stale weights on %d of %d servers: %s", g.step, len(idx), len(g.fleet), strings.Join(msgs, "; "))
	return temporal.NewApplicationErrorWithOptions(msg, pipelines.ErrTypeStaleWeights, temporal.ApplicationErrorOptions{
		NonRetryable: pipelines.IsNonRetryable(pipelines.ErrTypeStaleWeights),
		Details:      []any{pipelines.AttemptDetail{Attempt: attemptOf(ctx)}, ss},
	})
}

// startChecks runs the attempt's first check: it decides the rows an
// earlier attempt left unconfirmed (confirmed when their server still
// serves what it served then, else void), fails with StaleWeights when a
// server does not serve the run's weights, and opens an epoch per server.
// It writes to pw directly (the writer has not started) and syncs.
func (g *genRun) startChecks(ctx context.Context, pw *partialFile, states []serverState) error {
	want := g.in.Context.Weights
	byURL := map[string]int{}
	for i := len(g.fleet) - 1; i >= 0; i-- {
		byURL[g.fleet[i].URL()] = i
	}
	ids := make([]int, 0, len(pw.epochs))
	for id := range pw.epochs {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	for _, id := range ids {
		e := pw.epochs[id]
		if len(e.pending) == 0 || !e.open() {
			continue
		}
		i, ok := byURL[e.url]
		problem := "is no longer among the pipeline's servers"
		if ok {
			problem = judge(&e.state, states[i], want)
		}
		r := confirmRec(id, maxSeq(pw, e)+1)
		if problem != "" {
			r = voidRec(id, e.confirmed, e.url+" "+problem)
		}
		if err := pw.write(r); err != nil {
			return stepError(ctx, pipelines.ErrTypeIO, err, "%s: writing %s", g.step, pw.path)
		}
	}
	stale := map[int]string{}
	for i, st := range states {
		if problem := judge(nil, st, want); problem != "" {
			stale[i] = problem
		}
	}
	var err error
	if len(stale) > 0 {
		err = g.staleWeightsError(ctx, stale)
	} else {
		g.checks = make([]*serverCheck, len(g.fleet))
		for i, st := range states {
			id, werr := pw.openEpoch(i, g.fleet[i].URL(), st)
			if werr != nil {
				return stepError(ctx, pipelines.ErrTypeIO, werr, "%s: writing %s", g.step, pw.path)
			}
			g.checks[i] = &serverCheck{epoch: id, state: st}
		}
	}
	if werr := pw.sync(); werr != nil {
		return stepError(ctx, pipelines.ErrTypeIO, werr, "%s: writing %s", g.step, pw.path)
	}
	return err
}

// maxSeq is the highest seq of e's pending rows.
func maxSeq(pw *partialFile, e *epochInfo) int64 {
	m := int64(-1)
	for _, key := range e.pending {
		m = max(m, pw.rows[key].seq)
	}
	return m
}
