// Package procs finds and ends the processes of one command run on this
// host, through Linux's /proc: the command's process group and every process
// whose environment carries the run's tag. A descendant inherits the tag even
// when it leaves the group (setsid, a launcher's own group) or is reparented
// to init after its parent died, so a wrapper, torchrun or a launcher cannot
// hide a trainer from Kill; only a process that scrubs its environment and
// leaves the group escapes, and then only the group's members are found.
//
// Invariants: a process is named by its pid and its start time (field 22 of
// /proc/<pid>/stat, clock ticks since boot), so a reused pid is never taken
// for the process it replaced; zombies count as gone (they hold no memory,
// GPU or files, and only their parent can reap them); the calling process is
// never found or signalled. The package never logs.
package procs

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// TagEnv is the environment variable that carries a run's tag.
const TagEnv = "RLFLOW_ATTEMPT_TAG"

// procRoot is where the proc file system is mounted.
const procRoot = "/proc"

// Identity names one process across pid reuse.
type Identity struct {
	PID int `json:"pid"`
	// Start is the process's start time in clock ticks since boot.
	Start uint64 `json:"start_ticks"`
}

// String is "pid N".
func (id Identity) String() string { return "pid " + strconv.Itoa(id.PID) }

// Stat is what Find needs of /proc/<pid>/stat.
type Stat struct {
	Identity
	PGID int
	// State is the one-letter state: R, S, D, Z (zombie), X (dead), ...
	State byte
}

// gone reports whether the process no longer runs code.
func (s Stat) gone() bool { return s.State == 'Z' || s.State == 'X' }

// ReadStat reads /proc/<pid>/stat.
func ReadStat(pid int) (Stat, error) {
	b, err := os.ReadFile(procRoot + "/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return Stat{}, err
	}
	return parseStat(pid, b)
}

// parseStat parses a stat line. The command name (field 2) is in parentheses
// and may itself hold spaces and parentheses, so the fields are counted from
// the last ')'.
func parseStat(pid int, b []byte) (Stat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return Stat{}, fmt.Errorf("/proc/%d/stat: no ')' closing the command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state), f[2] field 5 (pgrp), f[19] field 22 (starttime).
	if len(f) < 20 || len(f[0]) != 1 {
		return Stat{}, fmt.Errorf("/proc/%d/stat: %d fields after the command name, want at least 20", pid, len(f))
	}
	pgid, err := strconv.Atoi(f[2])
	if err != nil {
		return Stat{}, fmt.Errorf("/proc/%d/stat: process group %q: %w", pid, f[2], err)
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return Stat{}, fmt.Errorf("/proc/%d/stat: start time %q: %w", pid, f[19], err)
	}
	return Stat{Identity: Identity{PID: pid, Start: start}, PGID: pgid, State: f[0][0]}, nil
}

// Self is the calling process.
func Self() (Identity, error) {
	st, err := ReadStat(os.Getpid())
	if err != nil {
		return Identity{}, fmt.Errorf("reading this process's start time: %w", err)
	}
	return st.Identity, nil
}

// Of is the identity of a live process.
func Of(pid int) (Identity, error) {
	st, err := ReadStat(pid)
	if err != nil {
		return Identity{}, fmt.Errorf("reading the start time of pid %d: %w", pid, err)
	}
	return st.Identity, nil
}

// Alive reports whether the process still runs: its pid exists with the
// same start time and is not a zombie.
func (id Identity) Alive() bool {
	st, err := ReadStat(id.PID)
	return err == nil && st.Start == id.Start && !st.gone()
}

// BootID identifies this boot of this host: a record naming processes by
// pid is meaningless under another.
func BootID() (string, error) {
	b, err := os.ReadFile(procRoot + "/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("reading the boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// NewTag returns a fresh random tag.
func NewTag() (string, error) {
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("making a process tag: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// Run is one command run: its process group, led by Leader (whose pid is
// the group id), and its tag.
type Run struct {
	Leader Identity
	Tag    string
}

// Find returns the run's live processes, sorted by pid: every process whose
// environment holds TagEnv=Tag, and every member of a process group that
// holds one of those or is still led by Leader. Processes it may not read
// (another user's) are skipped.
func (r Run) Find() ([]Identity, error) {
	if r.Tag == "" {
		return nil, errors.New("procs: a run without a tag")
	}
	entries, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", procRoot, err)
	}
	self := os.Getpid()
	want := []byte(TagEnv + "=" + r.Tag)
	var all []Stat
	tagged := map[int]bool{}
	groups := map[int]bool{} // process groups that are this run's
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		st, err := ReadStat(pid)
		if err != nil || st.gone() {
			continue // exited since the listing, or a zombie
		}
		all = append(all, st)
		if st.Identity == r.Leader {
			groups[st.PGID] = true
		}
		env, err := os.ReadFile(procRoot + "/" + e.Name() + "/environ")
		if err != nil {
			continue
		}
		if slices.ContainsFunc(bytes.Split(env, []byte{0}), func(kv []byte) bool { return bytes.Equal(kv, want) }) {
			tagged[pid] = true
			groups[st.PGID] = true
		}
	}
	// The caller's own group is never the run's as a whole: a tagged
	// process that joined it does not make the caller's relatives targets.
	delete(groups, syscall.Getpgrp())
	var out []Identity
	for _, st := range all {
		if tagged[st.PID] || groups[st.PGID] {
			out = append(out, st.Identity)
		}
	}
	return out, nil
}

// pollEvery is how often Kill looks for survivors.
const pollEvery = 25 * time.Millisecond

// killWait bounds the wait for SIGKILLed processes to go: one in an
// uninterruptible sleep (a hung NFS or GPU driver call) may take a while.
const killWait = 30 * time.Second

// Kill ends the run: SIGTERM to every process Find returns and their
// groups, up to grace for them to exit, then SIGKILL to whatever is left
// (and whatever they started meanwhile) until Find returns none. It returns
// the processes it found at first (none: the run had already ended), and an
// error naming the survivors when some outlive SIGKILL by killWait or ctx
// ends first.
func (r Run) Kill(ctx context.Context, grace time.Duration) ([]Identity, error) {
	found, err := r.Find()
	if err != nil || len(found) == 0 {
		return nil, err
	}
	r.signal(found, syscall.SIGTERM)
	left, err := r.waitGone(ctx, found, grace, false)
	if err != nil {
		return found, err
	}
	if len(left) == 0 {
		return found, nil
	}
	left, err = r.waitGone(ctx, found, killWait, true)
	if err != nil {
		return found, err
	}
	if len(left) > 0 {
		return found, fmt.Errorf("%s still alive %v after SIGKILL", join(left), killWait)
	}
	return found, nil
}

// waitGone polls until neither Find nor the processes found at first
// return any, or d passes; with kill, it SIGKILLs what is left on every
// poll, so children forked meanwhile go too. The first ones are checked by
// identity as well: a process on its way out no longer shows its
// environment to Find while it still runs.
func (r Run) waitGone(ctx context.Context, found []Identity, d time.Duration, kill bool) ([]Identity, error) {
	deadline := time.Now().Add(d)
	for {
		left, err := r.Find()
		if err != nil {
			return nil, err
		}
		for _, p := range found {
			if p.Alive() && !slices.Contains(left, p) {
				left = append(left, p)
			}
		}
		if len(left) == 0 {
			return nil, nil
		}
		if kill {
			r.signal(left, syscall.SIGKILL)
		}
		if !time.Now().Before(deadline) {
			return left, nil
		}
		select {
		case <-ctx.Done():
			return left, fmt.Errorf("stopped waiting for %s to exit: %w", join(left), context.Cause(ctx))
		case <-time.After(min(pollEvery, time.Until(deadline))):
		}
	}
}

// signal sends sig to each process and to each of their groups (which
// Find found to be the run's), re-reading each start time first so a pid
// reused since Find is left alone.
func (r Run) signal(ps []Identity, sig syscall.Signal) {
	groups := map[int]bool{}
	for _, p := range ps {
		st, err := ReadStat(p.PID)
		if err != nil || st.Start != p.Start {
			continue
		}
		_ = syscall.Kill(p.PID, sig)
		groups[st.PGID] = true
	}
	delete(groups, syscall.Getpgrp())
	for g := range groups {
		if g > 1 {
			_ = syscall.Kill(-g, sig)
		}
	}
}

func join(ps []Identity) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = strconv.Itoa(p.PID)
	}
	if len(s) == 1 {
		return "pid " + s[0]
	}
	return "pids " + strings.Join(s, ", ")
}
