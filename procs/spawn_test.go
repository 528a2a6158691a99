package procs

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A command with Pdeathsig started by Start outlives the thread of the
// goroutine that called Start when that goroutine ends its thread (returns
// locked, as nccl.Device does); the same command started with cmd.Start on
// such a thread is SIGKILLed when the thread ends, which is why Start
// exists.
func TestStartOutlivesTheCallersThread(t *testing.T) {
	for _, tc := range []struct {
		name     string
		start    func(*exec.Cmd) error
		survives bool
	}{
		{"procs.Start", Start, true},
		{"cmd.Start on the ended thread", (*exec.Cmd).Start, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command("sleep", "60")
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			tid := runOnEndedThread(t, func() error { return tc.start(cmd) })
			t.Cleanup(func() { _ = cmd.Process.Kill() })
			waitThreadGone(t, tid)

			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			wait := 500 * time.Millisecond // the signal comes as the thread exits; this is slack
			if !tc.survives {
				wait = 10 * time.Second
			}
			select {
			case err := <-exited:
				assert.False(t, tc.survives, "the command died with the thread that started it: %v", err)
			case <-time.After(wait):
				assert.True(t, tc.survives, "the command outlived the thread that forked it: the test no longer shows the hazard")
			}
		})
	}
}

// runOnEndedThread runs fn on a goroutine locked to a thread other than
// the main one, which returns locked so the runtime ends the thread; it
// returns the thread's id.
func runOnEndedThread(t *testing.T, fn func() error) int {
	t.Helper()
	type result struct {
		tid int
		err error
	}
	var try func(done chan<- result)
	try = func(done chan<- result) {
		runtime.LockOSThread()
		if syscall.Gettid() == os.Getpid() {
			// The main thread is never ended. Holding it while the next try
			// runs puts that try on another thread.
			next := make(chan result, 1)
			go try(next)
			done <- <-next
			runtime.UnlockOSThread()
			return
		}
		done <- result{syscall.Gettid(), fn()} // returns locked: the thread ends
	}
	done := make(chan result, 1)
	go try(done)
	r := <-done
	require.NoError(t, r.err)
	return r.tid
}

func waitThreadGone(t *testing.T, tid int) {
	t.Helper()
	task := fmt.Sprintf("/proc/self/task/%d", tid)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(task); errors.Is(err, os.ErrNotExist) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("thread %d still runs 10s after its goroutine returned locked", tid)
}
