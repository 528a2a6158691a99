// Package devserver starts a local Temporal dev server (the Temporal CLI's
// `server start-dev`, with its web UI) for `rlflow dev` and the tests, and
// builds the CLI from the Go module proxy when it is missing (and no
// recent enough one is on PATH), showing the build's progress.
//
// Invariant: the server binds only the loopback address it is given and is
// stopped (its process group killed) by Stop.
package devserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"
)

// TemporalCLIModule is the Temporal CLI version rlflow builds: the newest one
// that `go install` can build from the module proxy.
const TemporalCLIModule = "github.com/temporalio/cli/cmd/temporal@v1.5.1"

// MinTemporalCLI is the oldest Temporal CLI release whose dev server takes
// every flag Start passes.
const MinTemporalCLI = "1.0.0"

// FindTemporal locates the Temporal CLI: explicit path, $RLFLOW_TEMPORAL,
// bin/temporal in the working directory or the module root above it, then
// a `temporal` on PATH whose version is MinTemporalCLI or later (a build
// from source says 0.0.0-DEV and is taken as is), so that a user who has
// the CLI installed never waits for a build.
func FindTemporal(explicit string) (string, error) {
	cands := []string{explicit, os.Getenv("RLFLOW_TEMPORAL")}
	if root, ok := moduleRoot(); ok {
		cands = append(cands, filepath.Join(root, "bin", "temporal"))
	}
	cands = append(cands, filepath.Join("bin", "temporal"))
	for _, c := range cands {
		if c == "" {
			continue
		}
		if st, err := os.Stat(c); err == nil && !st.IsDir() {
			return filepath.Abs(c)
		}
	}
	build := "; build it with `make bin/temporal` or: GOBIN=$PWD/bin go install " + TemporalCLIModule
	p, err := exec.LookPath("temporal")
	if err != nil {
		return "", errors.New("temporal CLI not found (looked at $RLFLOW_TEMPORAL, ./bin/temporal and PATH)" + build)
	}
	if err := checkTemporalVersion(p); err != nil {
		return "", fmt.Errorf("%w%s", err, build)
	}
	return p, nil
}

// temporalVersion matches `temporal --version`: "temporal version 1.5.1
// (Server 1.29.1, UI 2.42.1)".
var temporalVersion = regexp.MustCompile(`^temporal version (\d+)\.(\d+)\.(\d+)(\S*)`)

// checkTemporalVersion says why the Temporal CLI at path will not do: too
// old, or not answering --version as the CLI does.
func checkTemporalVersion(path string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "--version").Output()
	if err != nil {
		return fmt.Errorf("temporal on PATH (%s) did not answer --version: %w", path, err)
	}
	line := strings.TrimSpace(string(out))
	m := temporalVersion.FindStringSubmatch(line)
	if m == nil {
		return fmt.Errorf("temporal on PATH (%s) is not the Temporal CLI: --version printed %q", path, firstLine(line))
	}
	if m[1]+"."+m[2]+"."+m[3] == "0.0.0" && m[4] == "-DEV" {
		return nil
	}
	got := [3]int{atoi(m[1]), atoi(m[2]), atoi(m[3])}
	var want [3]int
	fmt.Sscanf(MinTemporalCLI, "%d.%d.%d", &want[0], &want[1], &want[2])
	for i := range got {
		if got[i] != want[i] {
			if got[i] < want[i] {
				return fmt.Errorf("temporal on PATH (%s) is version %s.%s.%s; rlflow needs %s or later", path, m[1], m[2], m[3], MinTemporalCLI)
			}
			break
		}
	}
	return nil
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s) // the pattern matched digits
	return n
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}

// moduleRoot walks up from the working directory to the directory holding
// rlflow's go.mod, so `rlflow dev` works from any subdirectory of a clone.
func moduleRoot() (string, bool) {
	dir, err := os.Getwd()
	if err != nil {
		return "", false
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, true
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", false
		}
		dir = parent
	}
}

// BuildTemporal builds the Temporal CLI into binDir with `go install -v`,
// copying each package line it prints to out as it comes and, every 10 s,
// the time elapsed: a first build takes minutes, and a silent one looks hung.
func BuildTemporal(ctx context.Context, binDir string, out io.Writer) (string, error) {
	return buildTemporal(ctx, "go", binDir, out, 10*time.Second)
}

// buildTemporal is BuildTemporal with the go command and the progress
// period given.
func buildTemporal(ctx context.Context, goCmd, binDir string, out io.Writer, every time.Duration) (string, error) {
	abs, err := filepath.Abs(binDir)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return "", fmt.Errorf("creating %s: %w", abs, err)
	}
	cmd := exec.CommandContext(ctx, goCmd, "install", "-v", TemporalCLIModule)
	cmd.Env = append(os.Environ(), "GOBIN="+abs)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var mu sync.Mutex // the lines and the ticks share out
	packages := 0
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			mu.Lock()
			packages++
			fmt.Fprintf(out, "  %s\n", sc.Text())
			mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, pr) // a line past the scanner's limit
	}()
	start := time.Now()
	tick := time.NewTicker(every)
	defer tick.Stop()
	stop, ticked := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(ticked)
		for {
			select {
			case <-tick.C:
				mu.Lock()
				fmt.Fprintf(out, "  still building the Temporal CLI: %s elapsed, %d lines of `go install -v` so far\n", time.Since(start).Round(time.Second), packages)
				mu.Unlock()
			case <-stop:
				return
			}
		}
	}()
	err = cmd.Run()
	pw.Close()
	<-copied
	close(stop)
	<-ticked
	if err != nil {
		return "", fmt.Errorf("building the Temporal CLI (go install %s) failed after %s: %w", TemporalCLIModule, time.Since(start).Round(time.Second), err)
	}
	return filepath.Join(abs, "temporal"), nil
}

// Options configure a dev server.
type Options struct {
	TemporalPath string
	// Address is the frontend host:port; empty = a free loopback port.
	Address string
	// UIPort enables the web UI on that port (0 = headless).
	UIPort int
	// DBFile persists the server's state across restarts (empty = in memory).
	DBFile    string
	Namespace string
	Log       io.Writer
}

// Server is a running dev server.
type Server struct {
	srv     *testsuite.DevServer
	Address string
	UIURL   string // empty when headless
}

// Start starts a dev server with rlflow's search attributes registered and
// waits until its frontend answers.
func Start(ctx context.Context, o Options) (*Server, error) {
	if o.Namespace == "" {
		o.Namespace = "default"
	}
	if o.Address == "" {
		addr, err := freeLoopbackPort()
		if err != nil {
			return nil, err
		}
		o.Address = addr
	}
	// Dynamic config for a one-host server; each value's effect on the
	// orchestration overhead is measured in bench/RESULTS.md. One partition
	// per task queue: a dev server has one matching host, and with several
	// partitions tasks wait on forwarding between them.
	args := []string{
		"--dynamic-config-value", "matching.numTaskqueueReadPartitions=1",
		"--dynamic-config-value", "matching.numTaskqueueWritePartitions=1",
		"--dynamic-config-value", "system.enableActivityEagerExecution=true",
		// The transfer queue moves every workflow and activity task to
		// matching; at its default poll rate every step waits for it.
		"--dynamic-config-value", "history.transferProcessorMaxPollRPS=1000",
		// Completed queue tasks are range-deleted at each ack update, every
		// 30 s by default, so a long loop's task tables keep growing and its
		// late iterations run slower than its first.
		"--dynamic-config-value", "history.transferProcessorUpdateAckInterval=\"2s\"",
		"--dynamic-config-value", "history.visibilityProcessorUpdateAckInterval=\"2s\"",
	}
	names := make([]string, 0, len(workflows.SearchAttributeTypes))
	for n := range workflows.SearchAttributeTypes {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		args = append(args, "--search-attribute", n+"="+workflows.SearchAttributeTypes[n])
	}
	log := o.Log
	if log == nil {
		log = io.Discard
	}
	opts := testsuite.DevServerOptions{
		ExistingPath:  o.TemporalPath,
		ClientOptions: &client.Options{HostPort: o.Address, Namespace: o.Namespace, Logger: nopLogger{}},
		DBFilename:    o.DBFile,
		LogLevel:      "error",
		ExtraArgs:     args,
		Stdout:        log,
		Stderr:        log,
	}
	if o.UIPort > 0 {
		opts.EnableUI = true
		opts.UIPort = fmt.Sprint(o.UIPort)
	}
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	srv, err := testsuite.StartDevServer(sctx, opts)
	if err != nil {
		return nil, fmt.Errorf("starting the Temporal dev server (%s) on %s: %w", o.TemporalPath, o.Address, err)
	}
	s := &Server{srv: srv, Address: o.Address}
	if o.UIPort > 0 {
		host, _, _ := net.SplitHostPort(o.Address)
		s.UIURL = fmt.Sprintf("http://%s", net.JoinHostPort(host, fmt.Sprint(o.UIPort)))
	}
	return s, nil
}

// Stop stops the server.
func (s *Server) Stop() error { return s.srv.Stop() }

func freeLoopbackPort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// Reachable reports whether something accepts TCP connections at addr.
func Reachable(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 300*time.Millisecond)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

type nopLogger struct{}

func (nopLogger) Debug(string, ...any) {}
func (nopLogger) Info(string, ...any)  {}
func (nopLogger) Warn(string, ...any)  {}
func (nopLogger) Error(string, ...any) {}
