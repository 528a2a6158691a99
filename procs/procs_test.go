package procs

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseStat(t *testing.T) {
	// Fields 3.. of a real line; 22 is the start time.
	rest := " S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0"
	for _, tc := range []struct {
		name, line string
		want       Stat
		err        string
	}{
		{"plain", "4243 (sleep)" + rest, Stat{Identity: Identity{PID: 4243, Start: 987654}, PGID: 4242, State: 'S'}, ""},
		{"name with spaces and parentheses", "4243 (a) b (c)" + rest, Stat{Identity: Identity{PID: 4243, Start: 987654}, PGID: 4242, State: 'S'}, ""},
		{"zombie", "4243 (sh)" + strings.Replace(rest, " S ", " Z ", 1), Stat{Identity: Identity{PID: 4243, Start: 987654}, PGID: 4242, State: 'Z'}, ""},
		{"no name", "4243 sleep S 1", Stat{}, "/proc/4243/stat: no ')' closing the command name"},
		{"short", "4243 (sleep) S 1 4242", Stat{}, "/proc/4243/stat: 3 fields after the command name, want at least 20"},
		{"bad start", "4243 (sleep)" + strings.Replace(rest, "987654", "x", 1), Stat{}, `/proc/4243/stat: start time "x": strconv.ParseUint: parsing "x": invalid syntax`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStat(4243, []byte(tc.line))
			if tc.err != "" {
				require.EqualError(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestIdentityAliveTellsReusedPIDsApart(t *testing.T) {
	self, err := Self()
	require.NoError(t, err)
	assert.True(t, self.Alive())
	assert.False(t, Identity{PID: self.PID, Start: self.Start + 1}.Alive(), "another start time is another process")

	cmd := exec.Command("true")
	require.NoError(t, cmd.Start())
	id, err := Of(cmd.Process.Pid)
	require.NoError(t, err)
	require.NoError(t, cmd.Wait())
	assert.False(t, id.Alive(), "an exited, reaped process")
}

// tree starts `sh -c script` as a tagged run in its own group, as exec
// does, with $P the directory its script writes pid files to; the test
// kills whatever is left at its end.
func tree(t *testing.T, script string, env ...string) (Run, string, *exec.Cmd) {
	t.Helper()
	tag, err := NewTag()
	require.NoError(t, err)
	dir := t.TempDir()
	cmd := exec.Command("sh", "-c", script)
	cmd.Env = append(append(os.Environ(), "P="+dir, TagEnv+"="+tag), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	waited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(waited) }()
	leader, err := Of(cmd.Process.Pid)
	require.NoError(t, err)
	t.Cleanup(func() {
		for _, p := range readPIDs(t, dir) {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-waited
	})
	return Run{Leader: leader, Tag: tag}, dir, cmd
}

// readPIDs reads the pid files the script wrote, by file name.
func readPIDs(t *testing.T, dir string) map[string]int {
	t.Helper()
	out := map[string]int{}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			out[e.Name()] = n
		}
	}
	return out
}

func waitPIDs(t *testing.T, dir string, n int) map[string]int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if p := readPIDs(t, dir); len(p) >= n {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("the script wrote %d of %d pid files: %v", len(readPIDs(t, dir)), n, readPIDs(t, dir))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func pidsOf(ids []Identity) []int {
	out := make([]int, len(ids))
	for i, id := range ids {
		out[i] = id.PID
	}
	return out
}

// A descendant that leaves the group (setsid) is found by its tag; one that
// scrubs the tag but stays in the group is found by the group; one that does
// both escapes, which is the documented limit.
func TestFindFollowsTagAndGroup(t *testing.T) {
	run, dir, cmd := tree(t, `
setsid sh -c 'echo $$ > "$P/grandchild.tmp" && mv "$P/grandchild.tmp" "$P/grandchild"; exec sleep 300' &
env -u `+TagEnv+` sleep 300 & echo $! > "$P/scrubbed"
env -u `+TagEnv+` setsid sleep 300 & echo $! > "$P/escaped"
wait`)
	pids := waitPIDs(t, dir, 3)
	found, err := run.Find()
	require.NoError(t, err)
	got := pidsOf(found)
	assert.Contains(t, got, cmd.Process.Pid, "the leader")
	assert.Contains(t, got, pids["grandchild"], "the setsid'd grandchild, by its tag")
	assert.Contains(t, got, pids["scrubbed"], "the untagged group member, by its group")
	assert.NotContains(t, got, pids["escaped"], "untagged and out of the group: not the run's")
	assert.NotContains(t, got, os.Getpid())
	assert.True(t, slices.IsSorted(got))

	other, err := NewTag()
	require.NoError(t, err)
	none, err := Run{Tag: other}.Find()
	require.NoError(t, err)
	assert.Empty(t, none, "another tag finds nothing")
}

// Kill leaves none of the run's processes alive (zombies awaiting their
// parent count as gone), escalating to SIGKILL for one that ignores
// SIGTERM once the grace has passed.
func TestKillEndsGroupAndTaggedDescendants(t *testing.T) {
	run, dir, cmd := tree(t, `
setsid sh -c 'trap "" TERM; echo $$ > "$P/stubborn.tmp" && mv "$P/stubborn.tmp" "$P/stubborn"; while :; do sleep 1; done' &
sleep 300 & echo $! > "$P/child"
wait`)
	pids := waitPIDs(t, dir, 2)
	before, err := run.Find()
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(before), 3, "leader, child, stubborn (and its sleep)")

	start := time.Now()
	killed, err := run.Kill(context.Background(), 200*time.Millisecond)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond, "the stubborn one had its grace")
	assert.Subset(t, pidsOf(killed), []int{cmd.Process.Pid, pids["child"], pids["stubborn"]})
	for _, id := range before {
		assert.False(t, id.Alive(), "pid %d survived", id.PID)
	}
	left, err := run.Find()
	require.NoError(t, err)
	assert.Empty(t, left)

	again, err := run.Kill(context.Background(), time.Second)
	require.NoError(t, err)
	assert.Empty(t, again, "nothing left to kill")
}

func TestKillStopsWaitingWhenContextEnds(t *testing.T) {
	run, dir, _ := tree(t, `trap "" TERM; echo $$ > "$P/sh"; while :; do sleep 1; done`)
	waitPIDs(t, dir, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := run.Kill(ctx, time.Minute)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "stopped waiting for pid")
	assert.Contains(t, err.Error(), "context deadline exceeded")
}

func TestBootIDAndTag(t *testing.T) {
	id, err := BootID()
	require.NoError(t, err)
	assert.Len(t, id, 36)
	a, err := NewTag()
	require.NoError(t, err)
	b, err := NewTag()
	require.NoError(t, err)
	assert.Len(t, a, 24)
	assert.NotEqual(t, a, b)
}
