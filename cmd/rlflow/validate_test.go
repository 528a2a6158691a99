package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// hangGuard is how long a test waits for a command that must return at
// once; reaching it means a hang, not slowness.
const hangGuard = 20 * time.Second

// runValidate runs `rlflow validate args...` in process and returns its
// error and what it wrote to stderr, failing the test if it hangs.
func runValidate(t *testing.T, ctx context.Context, args ...string) (string, error) {
	t.Helper()
	cmd := newValidateCmd()
	cmd.SilenceUsage, cmd.SilenceErrors = true, true // as under the root command
	var stderr bytes.Buffer
	cmd.SetErr(&stderr)
	cmd.SetOut(&stderr)
	cmd.SetArgs(args)
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()
	select {
	case err := <-done:
		return stderr.String(), err
	case <-time.After(hangGuard):
		t.Fatalf("rlflow validate %v did not return within %s", args, hangGuard)
		return "", nil
	}
}

func TestValidateRefusesFIFO(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "pipe.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte("version: 1\nname: good\nsteps: [{id: a, uses: noop}]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	stderr, err := runValidate(t, context.Background(), good, fifo, dir)
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != 1 || ee.err.Error() != "2 of 3 file(s) invalid" {
		t.Fatalf("got %v, want exit 1 with 2 of 3 invalid", err)
	}
	want := fifo + ":1:1: a named pipe (FIFO), not a regular file: a pipeline is read from a regular file only\n" +
		dir + ":1:1: a directory, not a regular file: a pipeline is read from a regular file only\n"
	if stderr != want {
		t.Errorf("stderr:\n%s\nwant:\n%s", stderr, want)
	}
}

func TestValidateStopsOnSignal(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	stuck := make(chan struct{})
	defer close(stuck)
	started := make(chan string, 1)
	load := func(path string) error {
		started <- path
		<-stuck // a read that never ends, as on a hung network mount
		return nil
	}
	done := make(chan error, 1)
	var stderr bytes.Buffer
	go func() { done <- validateFiles(ctx, []string{"a.yaml", "b.yaml"}, &stderr, load) }()
	if got := <-started; got != "a.yaml" {
		t.Fatalf("first load of %s", got)
	}
	cancel() // what main's signal.NotifyContext does on SIGINT or SIGTERM
	select {
	case err := <-done:
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != 130 || !strings.Contains(ee.err.Error(), "interrupted while reading a.yaml") {
			t.Fatalf("got %v, want exit 130 naming a.yaml", err)
		}
	case <-time.After(hangGuard):
		t.Fatal("validate did not return after its context ended")
	}
}
