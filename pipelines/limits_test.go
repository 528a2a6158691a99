package pipelines

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// hangGuard is how long a test waits on a call that must return at once;
// reaching it means a hang, not slowness.
const hangGuard = 30 * time.Second

// loadFileGuarded calls LoadFile, failing the test instead of hanging.
func loadFileGuarded(t *testing.T, path string) (*Pipeline, error) {
	t.Helper()
	type result struct {
		p   *Pipeline
		err error
	}
	done := make(chan result, 1)
	go func() {
		p, err := LoadFile(path)
		done <- result{p, err}
	}()
	select {
	case r := <-done:
		return r.p, r.err
	case <-time.After(hangGuard):
		t.Fatalf("LoadFile(%s) did not return within %s", path, hangGuard)
		return nil, nil
	}
}

// TestLoadFileRegularOnly: only regular files are read. A FIFO used to
// block `rlflow validate` forever (open waits for a writer).
func TestLoadFileRegularOnly(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte("version: 1\nname: good\nsteps: [{id: a, uses: noop}]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "pipe.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatalf("mkfifo: %v", err)
	}
	sock := filepath.Join(dir, "s.yaml")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatalf("listen on a unix socket: %v", err)
	}
	defer ln.Close()
	linkGood, linkFifo := filepath.Join(dir, "link-good.yaml"), filepath.Join(dir, "link-pipe.yaml")
	for target, link := range map[string]string{good: linkGood, fifo: linkFifo} {
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
	}
	const only = ", not a regular file: a pipeline is read from a regular file only"
	for _, c := range []struct {
		name, path, want string
	}{
		{"regular", good, ""},
		{"link to regular", linkGood, ""},
		{"fifo", fifo, fifo + ":1:1: a named pipe (FIFO)" + only},
		{"link to fifo", linkFifo, linkFifo + ":1:1: a named pipe (FIFO)" + only},
		{"directory", dir, dir + ":1:1: a directory" + only},
		{"socket", sock, sock + ":1:1: a socket" + only},
		{"character device", os.DevNull, os.DevNull + ":1:1: a character device" + only},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := loadFileGuarded(t, c.path)
			if c.want == "" {
				if err != nil || p == nil {
					t.Fatalf("got %v", err)
				}
				return
			}
			if _, ok := err.(ErrorList); !ok || err.Error() != c.want {
				t.Fatalf("got %T %v\nwant %s", err, err, c.want)
			}
		})
	}
}

// TestLoadFileTooLargeUnread: a file over the limit is refused from its
// size, not read.
func TestLoadFileTooLargeUnread(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big.yaml")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(MaxFileBytes + 1); err != nil {
		t.Fatal(err)
	}
	f.Close()
	_, err = loadFileGuarded(t, path)
	want := path + ":1:1: file is too large: 4194305 bytes, the limit is 4194304 (4 MiB)"
	if err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}
}

// TestAliasTextBomb: aliases of a long string used to make a spec of
// 120 GB from a 3 MiB file, and hours of expression checking.
func TestAliasTextBomb(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: 1\nname: bomb\nsteps: [{id: a, uses: noop, with: {outputs: {x: &b \"")
	b.WriteString(strings.Repeat("x", 3<<20))
	b.WriteString("${{ 1 }}\", y: [")
	for i := 0; i < 40000; i++ {
		b.WriteString("*b,")
	}
	b.WriteString("*b]}}}]\n")
	done := make(chan error, 1)
	go func() { _, err := Load("bomb.yaml", []byte(b.String())); done <- err }()
	select {
	case err := <-done:
		want := "document is too large: more than 4194304 bytes of text (aliases expanded); the limit is that of a file"
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("got %v, want %q", err, want)
		}
	case <-time.After(hangGuard):
		t.Fatal("Load did not return")
	}
}

func TestRetryMaxAttemptsFilled(t *testing.T) {
	for _, c := range []struct {
		name, yaml      string
		defaults, step0 int // -1: no policy
	}{
		{"no policy", "steps: [{id: a, uses: noop}]", -1, -1},
		{"defaults leave it out", "defaults: {retry: {backoff: 3}}\nsteps: [{id: a, uses: noop}]", DefaultMaxAttempts, -1},
		{"step leaves it out", "steps: [{id: a, uses: noop, retry: {initial_interval: 2s}}]", -1, DefaultMaxAttempts},
		{"step inherits defaults", "defaults: {retry: {max_attempts: 7}}\nsteps: [{id: a, uses: noop, retry: {backoff: 1.5}}]", 7, 7},
		{"written 0 is unlimited", "defaults: {retry: {max_attempts: 0}}\nsteps: [{id: a, uses: noop, retry: {backoff: 1.5}}]", 0, 0},
		{"step's own", "defaults: {retry: {max_attempts: 7}}\nsteps: [{id: a, uses: noop, retry: {max_attempts: 1}}]", 7, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := Load("r.yaml", []byte("version: 1\nname: r\n"+c.yaml+"\n"))
			if err != nil {
				t.Fatal(err)
			}
			attempts := func(r *RetryPolicy) int {
				if r == nil {
					return -1
				}
				return r.MaxAttempts
			}
			if got := attempts(p.Defaults.Retry); got != c.defaults {
				t.Errorf("defaults.retry.max_attempts = %d, want %d", got, c.defaults)
			}
			if got := attempts(p.Steps[0].Retry); got != c.step0 {
				t.Errorf("steps[0].retry.max_attempts = %d, want %d", got, c.step0)
			}
		})
	}
}

// TestMeasurePartExact: the sizes that name the largest part add up to
// what encoding/json writes, escapes included.
func TestMeasurePartExact(t *testing.T) {
	for _, v := range []any{
		"plain", "<a&b>\"\\\n\t\x01é\u2028", "\xff invalid utf-8", int64(-12), 1.5, 1e21, 1e-7, true, nil,
		[]any{}, map[string]any{}, []any{"a", int64(1), []any{nil, map[string]any{"k<": "v"}}},
		map[string]any{"b": 2.0, "a": []any{"x", "y"}, "é": map[string]any{"z": false}},
	} {
		want, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if got := measurePart("x", v).size; got != len(want) {
			t.Errorf("%#v: measured %d, json writes %d (%s)", v, got, len(want), want)
		}
	}
}

func TestParseDurationTooLong(t *testing.T) {
	for in, want := range map[string]string{
		"2562048h":   `duration "2562048h" is too long: the longest is 2562047h47m16.854775807s`,
		"+9999999h":  `duration "+9999999h" is too long: the longest is 2562047h47m16.854775807s`,
		"5 minutes":  `invalid duration "5 minutes" (want e.g. 30s, 5m, 1h30m)`,
		"2562047h1m": "",
	} {
		_, err := ParseDuration(in)
		if (err == nil) != (want == "") || (err != nil && err.Error() != want) {
			t.Errorf("ParseDuration(%q) = %v, want %q", in, err, want)
		}
	}
}

// TestExamplesFitTemporal: every example stays far inside the spec limits.
func TestExamplesFitTemporal(t *testing.T) {
	for _, f := range pipelineFiles(t) {
		p, err := LoadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(p)
		every := p.Loop.ContinueAsNewEvery
		if every == 0 {
			every = DefaultContinueAsNewEvery
		}
		if len(b)*(every+SpecStartCopies) > MaxRunSpecBytes/4 {
			t.Errorf("%s: %d bytes as JSON, %d copies per run: close to the limits", f, len(b), every+SpecStartCopies)
		}
	}
}
