package activities

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/procs"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
)

// One trainer per exec step (the rule README.md states for users):
//
// Every exec attempt's command runs in its own process group with a fresh
// tag in its environment (procs.TagEnv), which all its descendants inherit,
// and a record of it (attemptRecord) lives under <LogDir>/.attempts/ from
// just before the command starts until it has ended and its attempt has
// returned. Before an attempt starts its command, it settles every earlier
// attempt of the same step (same run, iteration and step) on this host:
//
//   - adopt, when this worker process runs the earlier attempt's command,
//     which the server had given up (a later attempt of the same Temporal
//     activity exists only then: Temporal never runs two at once) while the
//     command kept running detached, and the earlier attempt's deadline has
//     not passed: the new attempt waits for that command and takes its exit
//     code, log and outputs instead of starting a second trainer;
//   - otherwise kill: SIGTERM to its process group and every tagged
//     process, kill_grace, SIGKILL to what is left, then confirm none is.
//
// A command detaches only when its attempt was lost to the server (the
// heartbeat found the attempt gone, or could not reach the server for the
// heartbeat timeout), and only until that attempt's deadline: no attempt
// could have let it run longer. A workflow's cancel, a pause or reset, the
// attempt's own timeout, the last allowed attempt, and a worker shutdown
// kill it at once. A worker starting on the host (SweepAttempts) kills the
// commands of every record whose worker process is dead, so a SIGKILLed
// worker's trainer dies as soon as any worker on the host starts, and at
// the latest when the step's next attempt starts there.

// attemptsDirName is the directory under LogDir that holds the records.
const attemptsDirName = ".attempts"

// attemptRecord is the durable record of one exec attempt's command on this
// host, written (fsync, rename) before the command starts and again with its
// pid right after, and removed once the command has ended and its attempt
// returned. It is what a worker that did not start the command (a restarted
// one) needs to find the command's processes and end them.
type attemptRecord struct {
	RunID     string `json:"run_id"`
	Iteration int    `json:"iteration"`
	StepID    string `json:"step_id"`
	// The Temporal activity: the same for every attempt of the step.
	WorkflowID    string `json:"workflow_id,omitempty"`
	WorkflowRunID string `json:"workflow_run_id,omitempty"`
	ActivityID    string `json:"activity_id,omitempty"`
	Attempt       int    `json:"attempt"`
	// Leader is the command's process, whose pid is its process group;
	// zero in the record written before the start.
	Leader    procs.Identity     `json:"leader"`
	Tag       string             `json:"tag"`
	Log       string             `json:"log"`
	Outputs   string             `json:"outputs"`
	KillGrace pipelines.Duration `json:"kill_grace"`
	Started   time.Time          `json:"started"`
	Deadline  time.Time          `json:"deadline,omitzero"`
	// Owner is the worker process that started the command.
	Owner  procs.Identity `json:"owner"`
	Host   string         `json:"host"`
	BootID string         `json:"boot_id"`
}

func (r attemptRecord) run() procs.Run { return procs.Run{Leader: r.Leader, Tag: r.Tag} }

func (r attemptRecord) String() string {
	return fmt.Sprintf("run %s iteration %d step %s attempt %d (%s, worker pid %d)", r.RunID, r.Iteration, r.StepID, r.Attempt, r.Leader, r.Owner.PID)
}

// attemptInfo is the Temporal attempt an exec call serves.
type attemptInfo struct {
	Attempt                               int
	WorkflowID, WorkflowRunID, ActivityID string
	// Deadline is when the server gives the attempt up whatever happens
	// (its start-to-close or schedule-to-close timeout); zero: none known.
	Deadline time.Time
	// Last: the retry policy allows no later attempt.
	Last bool
}

// attemptInfoOf reads the attempt from the activity's info; a plain call
// outside an activity (a unit test) is a first attempt with no deadline.
func attemptInfoOf(ctx context.Context) attemptInfo {
	if !activity.IsActivity(ctx) {
		return attemptInfo{Attempt: 1}
	}
	info := activity.GetInfo(ctx)
	rp := info.RetryPolicy
	return attemptInfo{
		Attempt:       int(info.Attempt),
		WorkflowID:    info.WorkflowExecution.ID,
		WorkflowRunID: info.WorkflowExecution.RunID,
		ActivityID:    info.ActivityID,
		Deadline:      info.Deadline,
		Last:          rp != nil && rp.MaximumAttempts > 0 && info.Attempt >= rp.MaximumAttempts,
	}
}

// lostToServer reports whether an attempt's context ended because the
// server lost the attempt rather than asked for its end: the heartbeat
// found it gone (NotFound: the server timed it out) or failed with a
// transport error for the heartbeat timeout (the server is unreachable).
// Everything else ends the command: the workflow's cancel
// (*temporal.CanceledError), a pause or reset, the attempt's deadline
// (context.DeadlineExceeded), a worker shutdown (context.Canceled).
func lostToServer(cause error) bool {
	if cause == nil || errors.Is(cause, context.Canceled) || errors.Is(cause, context.DeadlineExceeded) ||
		errors.Is(cause, activity.ErrActivityPaused) || errors.Is(cause, activity.ErrActivityReset) {
		return false
	}
	var canceled *temporal.CanceledError
	if errors.As(cause, &canceled) {
		return false
	}
	return isAny[*serviceerror.NotFound](cause) || isAny[*serviceerror.Unavailable](cause) ||
		isAny[*serviceerror.DeadlineExceeded](cause) || isAny[*serviceerror.ResourceExhausted](cause) ||
		isAny[*serviceerror.Aborted](cause) || isAny[*serviceerror.Internal](cause)
}

// isAny reports whether err's chain holds an E.
func isAny[E error](err error) bool {
	var e E
	return errors.As(err, &e)
}

// stepKey names a step's records: <run>~iter-<n>~<step>~<hash>, the hash
// of the exact ids telling apart ids that safeName makes alike.
func stepKey(sc pipelines.StepContext) string {
	h := fnv.New32a()
	fmt.Fprintf(h, "%s\x00%d\x00%s", sc.RunID, sc.Iteration, sc.StepID)
	return fmt.Sprintf("%s~iter-%d~%s~%08x", safeName(sc.RunID), sc.Iteration, safeName(sc.StepID), h.Sum32())
}

func (a *Activities) attemptsDir() string { return filepath.Join(a.LogDir, attemptsDirName) }

func recordPath(dir, key, tag string) string { return filepath.Join(dir, key+"."+tag+".json") }

// writeRecord writes rec durably: a temporary file, fsync, rename, fsync of
// the directory, so a crash leaves the old record or the new one.
func writeRecord(path string, rec attemptRecord) error {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	return writeFileSync(path, b)
}

// readRecords reads the records in dir whose file names start with prefix
// ("" for all), by path.
func readRecords(dir, prefix string) (map[string]attemptRecord, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing the attempt records: %w", err)
	}
	out := map[string]attemptRecord{}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".json") || !strings.HasPrefix(name, prefix) || strings.HasPrefix(name, keptPrefix) {
			continue
		}
		path := filepath.Join(dir, name)
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			continue // its attempt ended since the listing
		}
		if err != nil {
			return nil, fmt.Errorf("reading the attempt record: %w", err)
		}
		var rec attemptRecord
		if err := json.Unmarshal(b, &rec); err != nil || rec.Tag == "" {
			return nil, fmt.Errorf("attempt record %s is not one (%v): remove it once no process of its step runs", path, err)
		}
		out[path] = rec
	}
	return out, nil
}

// host is this worker process on this boot of this host.
type host struct {
	Name   string
	BootID string
	Self   procs.Identity
}

// owns reports what rec's processes are to this host: ours to judge (same
// host and boot), stale (same host, an earlier boot: nothing of it runs),
// or another host's (a log dir shared over the network: not ours to touch).
func (h host) owns(rec attemptRecord) (ours, stale bool) {
	if rec.Host != h.Name {
		return false, false
	}
	return rec.BootID == h.BootID, rec.BootID != h.BootID
}

// execTable is this worker process's running exec commands, by step.
type execTable struct {
	mu    sync.Mutex
	slots map[string]*execSlot

	hostOnce sync.Once
	host     host
	hostErr  error
}

// execSlot is one step's place in the table.
type execSlot struct {
	// claim is held by the attempt that settles the step's earlier
	// attempts and starts (or adopts) its command, so two attempts of one
	// step on this worker never both start one.
	claim sync.Mutex
	refs  int       // claims waiting or holding; under execTable.mu
	live  *liveExec // the step's command this worker knows of; under execTable.mu
}

func (t *execTable) self() (host, error) {
	t.hostOnce.Do(func() {
		name, err := os.Hostname()
		if err != nil {
			t.hostErr = fmt.Errorf("reading the host name: %w", err)
			return
		}
		boot, err := procs.BootID()
		if err != nil {
			t.hostErr = err
			return
		}
		self, err := procs.Self()
		if err != nil {
			t.hostErr = err
			return
		}
		t.host = host{Name: name, BootID: boot, Self: self}
	})
	return t.host, t.hostErr
}

// lock takes the step's claim; release gives it back.
func (t *execTable) lock(key string) (slot *execSlot, release func()) {
	t.mu.Lock()
	if t.slots == nil {
		t.slots = map[string]*execSlot{}
	}
	slot = t.slots[key]
	if slot == nil {
		slot = &execSlot{}
		t.slots[key] = slot
	}
	slot.refs++
	t.mu.Unlock()
	slot.claim.Lock()
	return slot, func() {
		slot.claim.Unlock()
		t.mu.Lock()
		slot.refs--
		t.forget(key, slot)
		t.mu.Unlock()
	}
}

// forget drops an unused slot; t.mu is held.
func (t *execTable) forget(key string, slot *execSlot) {
	if slot.refs == 0 && slot.live == nil && t.slots[key] == slot {
		delete(t.slots, key)
	}
}

func (t *execTable) liveOf(slot *execSlot) *liveExec {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slot.live
}

func (t *execTable) setLive(slot *execSlot, p *liveExec) {
	t.mu.Lock()
	slot.live = p
	t.mu.Unlock()
}

// liveExec is one command this worker started, from its start until it has
// ended and no attempt can still take its result.
type liveExec struct {
	rec   attemptRecord
	path  string // the record
	key   string
	table *execTable
	slot  *execSlot

	done    chan struct{} // closed once cmd.Wait returned
	waitErr error         // cmd.Wait's error, set before done closes

	mu sync.Mutex
	// holder is the attempt waiting for the command; 0 while it runs
	// detached, waiting for a later attempt to adopt it.
	holder int
	// taken is closed when a later attempt adopts the command from holder.
	taken   chan struct{}
	killing bool
	grace   time.Duration
	// deadline is the holder's (or, detached, the last holder's) attempt
	// deadline: no attempt may take the command after it.
	deadline time.Time
	expiry   *time.Timer

	recordOnce, dropOnce sync.Once
}

// startLive starts cmd for the attempt, recording it, and registers it in
// slot. The record is written before the start (with the tag only) and
// again with the pid, so a worker dying in between leaves the tag to find.
func (a *Activities) startLive(cmd *exec.Cmd, rec attemptRecord, key string, slot *execSlot, grace time.Duration) (*liveExec, error) {
	path := recordPath(a.attemptsDir(), key, rec.Tag)
	if err := writeRecord(path, rec); err != nil {
		return nil, fmt.Errorf("writing the attempt record: %w", err)
	}
	if err := procs.Start(cmd); err != nil { // cmd sets Pdeathsig
		_ = os.Remove(path)
		return nil, err
	}
	p := &liveExec{key: key, path: path, table: &a.execs, slot: slot, done: make(chan struct{}),
		holder: rec.Attempt, taken: make(chan struct{}), grace: grace, deadline: rec.Deadline}
	p.rec = rec
	p.rec.Leader = procs.Identity{PID: cmd.Process.Pid}
	if id, err := procs.Of(cmd.Process.Pid); err == nil {
		p.rec.Leader = id
	}
	go p.wait(cmd)
	a.execs.setLive(slot, p)
	if err := writeRecord(path, p.rec); err != nil {
		// The command runs, and the tag in the first record finds it.
		return p, fmt.Errorf("writing the attempt record: %w", err)
	}
	return p, nil
}

// wait reaps the command; a detached one's record goes at once (nothing of
// it runs that the record must find) while its result stays for adoption.
func (p *liveExec) wait(cmd *exec.Cmd) {
	p.waitErr = cmd.Wait()
	close(p.done)
	p.mu.Lock()
	detached := p.holder == 0
	p.mu.Unlock()
	if detached {
		p.removeRecord()
	}
}

func (p *liveExec) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *liveExec) removeRecord() {
	p.recordOnce.Do(func() { _ = os.Remove(p.path) })
}

// drop removes the command from the table: no attempt can take it now.
func (p *liveExec) drop() {
	p.dropOnce.Do(func() {
		p.mu.Lock()
		if p.expiry != nil {
			p.expiry.Stop()
		}
		p.mu.Unlock()
		p.table.mu.Lock()
		if p.slot.live == p {
			p.slot.live = nil
		}
		p.table.forget(p.key, p.slot)
		p.table.mu.Unlock()
	})
}

// finish is the holder's end: the command ended and its attempt returns.
func (p *liveExec) finish() {
	p.removeRecord()
	p.drop()
}

// adopt hands the command to a later attempt of the same activity, if it
// may have it: not being killed, and the attempt that last held it still
// within its deadline. It returns the channel closed when a yet later
// attempt takes it over in turn.
func (p *liveExec) adopt(in attemptInfo, grace time.Duration) (taken <-chan struct{}, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.rec
	if p.killing || in.Attempt <= r.Attempt || in.Attempt <= p.holder ||
		in.WorkflowID != r.WorkflowID || in.WorkflowRunID != r.WorkflowRunID || in.ActivityID != r.ActivityID ||
		(!p.deadline.IsZero() && !time.Now().Before(p.deadline)) {
		return nil, false
	}
	if p.holder != 0 {
		close(p.taken) // the earlier attempt, lost to the server, stops waiting
	}
	if p.expiry != nil {
		p.expiry.Stop()
		p.expiry = nil
	}
	p.holder, p.taken, p.grace, p.deadline = in.Attempt, make(chan struct{}), grace, in.Deadline
	return p.taken, true
}

// detach leaves the command running without a holder until deadline, for
// a later attempt to adopt; it reports false when the command has already
// ended (the holder finishes as usual). An attempt that lost the command
// to a later one has nothing to detach.
func (p *liveExec) detach(attempt int, deadline time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.holder != attempt {
		return true
	}
	if p.exited() {
		return false
	}
	p.holder = 0
	p.expiry = time.AfterFunc(time.Until(deadline), p.expire)
	return true
}

// expire ends a detached command that no attempt adopted by its deadline:
// kills it if it runs, forgets its result if it ended.
func (p *liveExec) expire() {
	p.mu.Lock()
	if p.holder != 0 || p.killing {
		p.mu.Unlock()
		return
	}
	p.killing = true // under the same lock as the check, so adopt cannot slip in
	grace := p.grace
	p.mu.Unlock()
	_, _ = p.end(context.Background(), grace)
}

// kill ends the command (group and tagged descendants) and waits for it to
// be reaped; its holder, if any, then returns the signal as its error. A
// command that has already ended is only forgotten: what it left running
// after its exit is not the attempt's (a step may start a server on
// purpose), as for an attempt that returned.
func (p *liveExec) kill(ctx context.Context, grace time.Duration) ([]procs.Identity, error) {
	p.mu.Lock()
	p.killing = true
	p.mu.Unlock()
	return p.end(ctx, grace)
}

// end is kill once killing is set.
func (p *liveExec) end(ctx context.Context, grace time.Duration) ([]procs.Identity, error) {
	if p.exited() {
		p.finish()
		return nil, nil
	}
	found, err := p.rec.run().Kill(ctx, grace)
	if err != nil {
		return found, err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		return found, fmt.Errorf("waiting for %s to be reaped: %w", p.rec.Leader, context.Cause(ctx))
	}
	p.finish()
	return found, nil
}

// settle deals with the step's earlier attempts on this host before
// attempt `in` starts a command: it returns the command to adopt, or nil
// once none of theirs runs. slot's claim is held.
func (a *Activities) settle(ctx context.Context, key string, slot *execSlot, in attemptInfo, grace time.Duration) (*liveExec, <-chan struct{}, error) {
	if p := a.execs.liveOf(slot); p != nil {
		if taken, ok := p.adopt(in, grace); ok {
			return p, taken, nil
		}
		if _, err := p.kill(ctx, grace); err != nil {
			return nil, nil, fmt.Errorf("ending %s: %w", p.rec, err)
		}
	}
	h, err := a.execs.self()
	if err != nil {
		return nil, nil, err
	}
	recs, err := readRecords(a.attemptsDir(), key+".")
	if err != nil {
		return nil, nil, err
	}
	for path, rec := range recs {
		if err := endRecorded(ctx, h, path, rec, grace); err != nil {
			return nil, nil, err
		}
	}
	return nil, nil, nil
}

// endRecorded kills the processes of a record that no live command of this
// worker answers for (its worker died, or is another process on this host)
// and removes the record.
func endRecorded(ctx context.Context, h host, path string, rec attemptRecord, grace time.Duration) error {
	ours, stale := h.owns(rec)
	switch {
	case stale:
		return removeRecordFile(path)
	case !ours:
		return nil
	}
	if _, err := rec.run().Kill(ctx, grace); err != nil {
		return fmt.Errorf("ending %s: %w", rec, err)
	}
	return removeRecordFile(path)
}

func removeRecordFile(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing the attempt record: %w", err)
	}
	return nil
}

// SweptAttempt is an exec attempt whose worker process had died, which
// SweepAttempts ended.
type SweptAttempt struct {
	RunID     string
	Iteration int
	StepID    string
	Attempt   int
	// Worker is the dead worker's pid.
	Worker int
	// Killed are the processes that were still running.
	Killed []procs.Identity
	// Err says why they could not all be ended; the record stays, and the
	// step's next attempt on this host tries again.
	Err error
}

// SweepAttempts ends the commands of every exec attempt recorded on this
// host whose worker process is dead (a SIGKILLed worker leaves its
// trainer's descendants running), and removes their records; a worker calls
// it once as it starts. Records of live workers are left to them. It fails
// only when the records cannot be read.
func (a *Activities) SweepAttempts(ctx context.Context) ([]SweptAttempt, error) {
	if a.LogDir == "" {
		return nil, nil
	}
	h, err := a.execs.self()
	if err != nil {
		return nil, fmt.Errorf("sweeping exec attempts: %w", err)
	}
	recs, err := readRecords(a.attemptsDir(), "")
	if err != nil {
		return nil, fmt.Errorf("sweeping exec attempts in %s: %w", a.attemptsDir(), err)
	}
	var (
		mu    sync.Mutex
		out   []SweptAttempt
		wg    sync.WaitGroup
		paths []string
	)
	for path := range recs {
		paths = append(paths, path)
	}
	for _, path := range paths {
		rec := recs[path]
		ours, stale := h.owns(rec)
		if stale {
			_ = removeRecordFile(path)
			continue
		}
		if !ours || rec.Owner.Alive() {
			continue
		}
		wg.Go(func() {
			killed, err := rec.run().Kill(ctx, rec.KillGrace.D())
			if err == nil {
				err = removeRecordFile(path)
			}
			mu.Lock()
			out = append(out, SweptAttempt{RunID: rec.RunID, Iteration: rec.Iteration, StepID: rec.StepID, Attempt: rec.Attempt,
				Worker: rec.Owner.PID, Killed: killed, Err: err})
			mu.Unlock()
		})
	}
	wg.Wait()
	return out, nil
}
