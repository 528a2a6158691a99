package testutil

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/procs"
)

// Postgres is a private PostgreSQL server for one test: its own data
// directory under the system temp dir, listening on 127.0.0.1 at a free
// port and on a unix socket in that directory, with one password-protected
// superuser. Its durability settings are PostgreSQL's defaults (fsync and
// synchronous_commit on), as a production server has them, so that what the
// tests measure on it is what users get.
//
// Invariant: at most one postmaster runs per Postgres; Stop waits for it to
// be gone, and the test's cleanup stops it and removes the directory.
type Postgres struct {
	t       testing.TB
	binDir  string
	dir     string // data directory's parent: socket, password file, log
	cred    *syscall.Credential
	logPath string
	// Port is the TCP port on 127.0.0.1, the same across restarts.
	Port int
	// User and Password are the superuser's (the Temporal server's) login.
	User, Password string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// PostgresBinaries finds the directory holding PostgreSQL's initdb and
// postgres: $RLFLOW_POSTGRES_BIN, the newest Debian install
// (/usr/lib/postgresql/N/bin), then PATH. Without them the test skips,
// saying how to get them, except under CI (CI=true), where that is a failure.
func PostgresBinaries(t testing.TB) string {
	t.Helper()
	dir, err := findPostgres()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI needs PostgreSQL (.ci/run installs it): %v", err)
		}
		t.Skipf("needs a PostgreSQL server: %v", err)
	}
	return dir
}

func findPostgres() (string, error) {
	has := func(dir string) bool {
		for _, b := range []string{"initdb", "postgres"} {
			if st, err := os.Stat(filepath.Join(dir, b)); err != nil || st.IsDir() {
				return false
			}
		}
		return true
	}
	if dir := os.Getenv("RLFLOW_POSTGRES_BIN"); dir != "" {
		if !has(dir) {
			return "", fmt.Errorf("$RLFLOW_POSTGRES_BIN=%s holds no initdb and postgres", dir)
		}
		return dir, nil
	}
	debian, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(debian, func(a, b string) int { return pgMajor(b) - pgMajor(a) }) // newest first
	for _, dir := range debian {
		if has(dir) {
			return dir, nil
		}
	}
	if p, err := exec.LookPath("postgres"); err == nil && has(filepath.Dir(p)) {
		return filepath.Dir(p), nil
	}
	return "", errors.New("initdb and postgres not found (looked at $RLFLOW_POSTGRES_BIN, /usr/lib/postgresql/*/bin and PATH); install it with `apt-get install postgresql`")
}

// pgMajor is N of /usr/lib/postgresql/N/bin, 0 when it is not a number.
func pgMajor(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

// StartPostgres initializes and starts a private PostgreSQL server for the
// test; it skips (or fails under CI) like PostgresBinaries. Running as root
// (CI containers do), the server runs as the "postgres" account that the
// Debian package creates: PostgreSQL refuses to run as root.
func StartPostgres(t testing.TB) *Postgres {
	t.Helper()
	bin := PostgresBinaries(t)
	p := &Postgres{t: t, binDir: bin, User: "temporal", Password: randomHex(t, 16)}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root, PostgreSQL needs an unprivileged account to run as: %v (the Debian package creates \"postgres\")", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		p.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	// Not t.TempDir(): its parents are private to the test's user, and the
	// postgres account must reach the data directory.
	dir, err := os.MkdirTemp("", "rlflow-postgres-")
	if err != nil {
		t.Fatal(err)
	}
	p.dir = dir
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("postgres log (%s), last lines:\n%s", p.logPath, tailFile(p.logPath, 30))
		}
		_ = os.RemoveAll(dir)
	})
	p.logPath = filepath.Join(dir, "postgres.log")
	pwfile := filepath.Join(dir, "pwfile")
	if err := os.WriteFile(pwfile, []byte(p.Password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if p.cred != nil {
		for _, f := range []string{dir, pwfile} {
			if err := os.Chown(f, int(p.cred.Uid), int(p.cred.Gid)); err != nil {
				t.Fatalf("handing %s to the postgres account: %v", f, err)
			}
		}
	}
	// Password logins over TCP (the server's), trust on the socket, which
	// only this directory's owner can reach.
	initdb := p.command(filepath.Join(bin, "initdb"), "-D", p.dataDir(), "-U", p.User, "--pwfile", pwfile,
		"--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--no-locale", "--no-instructions")
	var out bytes.Buffer
	initdb.Stdout, initdb.Stderr = &out, &out
	if err := startAndWait(initdb); err != nil {
		t.Fatalf("initdb in %s: %v\n%s", p.dataDir(), err, out.Bytes())
	}
	_ = os.Remove(pwfile)
	p.Port = RebindablePort(t) // Stop and Start keep it
	p.Start()
	return p
}

func startAndWait(cmd *exec.Cmd) error {
	if err := procs.Start(cmd); err != nil {
		return err
	}
	return cmd.Wait()
}

func (p *Postgres) dataDir() string { return filepath.Join(p.dir, "data") }

// command runs name as the server's account, in its own process group,
// killed if the test process dies; start it with procs.Start, or
// startAndWait, so that it dies only then.
func (p *Postgres) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.Dir = p.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL, Credential: p.cred}
	return cmd
}

// Start starts the server on its port and waits until it accepts
// connections (a no-op when it runs).
func (p *Postgres) Start() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return
	}
	log, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	defer log.Close()
	st, _ := log.Stat()
	from := st.Size() // this start's lines begin here
	// max_connections: a cluster of four server processes opens up to 30
	// connections each (maxConns of both stores); the default 100 is short.
	cmd := p.command(filepath.Join(p.binDir, "postgres"), "-D", p.dataDir(),
		"-c", "listen_addresses=127.0.0.1", "-c", "port="+strconv.Itoa(p.Port),
		"-c", "unix_socket_directories="+p.dir, "-c", "max_connections=200")
	cmd.Stdout, cmd.Stderr = log, log
	if err := procs.Start(cmd); err != nil {
		p.t.Fatalf("starting postgres: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p.cmd, p.done = cmd, done
	deadline := time.Now().Add(time.Minute)
	for {
		b, _ := os.ReadFile(p.logPath)
		if int64(len(b)) > from && strings.Contains(string(b[from:]), "database system is ready to accept connections") {
			return
		}
		select {
		case <-done:
			p.cmd = nil
			p.t.Fatalf("postgres exited at start; its log:\n%s", tailFile(p.logPath, 30))
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("postgres not ready after a minute; its log:\n%s", tailFile(p.logPath, 30))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop shuts the server down as `pg_ctl stop -m fast` (and a service
// manager's stop) does: SIGINT, open transactions rolled back, connections
// closed. It waits for the server to exit, killing it after a minute; a
// no-op when it is stopped.
func (p *Postgres) Stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-p.done:
	case <-time.After(time.Minute):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
	p.cmd = nil
}

// Addr is the server's host:port.
func (p *Postgres) Addr() string { return "127.0.0.1:" + strconv.Itoa(p.Port) }

func randomHex(t testing.TB, n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// tailFile is the last n lines of the file at path (empty when unreadable).
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return tailLines(string(b), n)
}
