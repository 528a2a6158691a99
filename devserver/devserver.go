// Package devserver starts a local Temporal dev server (the Temporal CLI's
// `server start-dev`, with its web UI) for `rlflow dev` and the tests, and
// builds the CLI from the Go module proxy when it is missing.
//
// Invariant: the server binds only the loopback address it is given and is
// stopped (its process group killed) by Stop.
package devserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"time"

	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"
)

// TemporalCLIModule is the Temporal CLI version rlflow builds: the newest one
// that `go install` can build from the module proxy.
const TemporalCLIModule = "github.com/temporalio/cli/cmd/temporal@v1.5.1"

// FindTemporal locates the Temporal CLI: explicit path, $RLFLOW_TEMPORAL,
// bin/temporal in the working directory or the module root above it, then PATH.
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
	if p, err := exec.LookPath("temporal"); err == nil {
		return p, nil
	}
	return "", errors.New("temporal CLI not found (looked at $RLFLOW_TEMPORAL, ./bin/temporal and PATH); build it with `make bin/temporal` or: GOBIN=$PWD/bin go install " + TemporalCLIModule)
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

// BuildTemporal builds the Temporal CLI into binDir with `go install`.
func BuildTemporal(ctx context.Context, binDir string, out io.Writer) (string, error) {
	abs, err := filepath.Abs(binDir)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return "", fmt.Errorf("creating %s: %w", abs, err)
	}
	cmd := exec.CommandContext(ctx, "go", "install", TemporalCLIModule)
	cmd.Env = append(os.Environ(), "GOBIN="+abs)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("building the Temporal CLI (go install %s): %w", TemporalCLIModule, err)
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
