package e2e

import (
	"errors"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/procs"
	"github.com/stretchr/testify/require"
)

// outageProc is an rlflow process of an outage test, in its own process
// group, whose output the test reads while it runs.
type outageProc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  strings.Builder
	done chan struct{} // closed when the process has exited
	err  error         // Wait's, once done is closed
}

func (p *outageProc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.Write(b)
}

// Output is everything the process printed so far (stdout and stderr).
func (p *outageProc) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// Exited reports whether the process has exited.
func (p *outageProc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// ExitCode waits up to timeout for the process to exit and returns its
// exit status; the test fails if it is still running then.
func (p *outageProc) ExitCode(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("%s still running after %s; output:\n%s", p.name, timeout, p.Output())
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		return ee.ExitCode()
	}
	require.NoError(t, p.err, "%s", p.name)
	return 0
}

// WaitFor waits up to timeout for the output to contain s.
func (p *outageProc) WaitFor(t *testing.T, timeout time.Duration, s string) {
	t.Helper()
	testutil.Eventually(t, timeout, p.name+" to print "+s, func() bool {
		time.Sleep(50 * time.Millisecond)
		return strings.Contains(p.Output(), s)
	})
}

// startOutageProc starts `rlflow args...`; cleanup kills its process group
// and, when the test failed, logs its output.
func startOutageProc(t *testing.T, name string, args ...string) *outageProc {
	t.Helper()
	p := &outageProc{name: name, cmd: exec.Command(testutil.RlflowBinary(t), args...), done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p, p
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	require.NoError(t, procs.Start(p.cmd))
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			t.Logf("%s (pid %d) output:\n%s", name, p.cmd.Process.Pid, p.Output())
		}
	})
	return p
}
