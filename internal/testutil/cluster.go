package testutil

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/procs"
	"github.com/rlflow/rlflow/runs"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/serviceerror"
	taskqueuepb "go.temporal.io/api/taskqueue/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	sdklog "go.temporal.io/sdk/log"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ShippedDynamicConfig is the repository path of the Temporal dynamic
// config rlflow ships for its workload: every cluster StartCluster starts
// uses exactly this file, and docker-compose.yml mounts it.
const ShippedDynamicConfig = "deploy/temporal/dynamicconfig.yaml"

// The binaries `make bin/temporal-server` builds from the Go module proxy
// (go.temporal.io/server's cmd/server and cmd/tools/sql, renamed as
// Temporal's images name them).
const (
	temporalServerBin  = "temporal-server"
	temporalSQLToolBin = "temporal-sql-tool"
)

// TemporalServerBinaries finds the Temporal server and its SQL schema tool:
// $RLFLOW_TEMPORAL_SERVER and $RLFLOW_TEMPORAL_SQL_TOOL, else bin/ in the
// repository. Without them the test skips, saying how to build them, except
// under CI (CI=true), where that is a failure.
func TemporalServerBinaries(t testing.TB) (server, sqlTool string) {
	t.Helper()
	find := func(env, name string) (string, error) {
		p := os.Getenv(env)
		if p == "" {
			p = filepath.Join(ModuleRoot(), "bin", name)
		}
		if st, err := os.Stat(p); err != nil || st.IsDir() {
			return "", fmt.Errorf("%s not found at %s ($%s or bin/%s); build it with `make bin/temporal-server`", name, p, env, name)
		}
		return p, nil
	}
	server, err := find("RLFLOW_TEMPORAL_SERVER", temporalServerBin)
	if err == nil {
		sqlTool, err = find("RLFLOW_TEMPORAL_SQL_TOOL", temporalSQLToolBin)
	}
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI needs the Temporal server: %v", err)
		}
		t.Skipf("needs a Temporal server: %v", err)
	}
	return server, sqlTool
}

// TestTemporalEnv names the variable that points DevServer and
// RestartableDevServer at a real cluster: "cluster" (all services in one
// process) or "cluster-split" (four processes); unset or "dev": the dev
// server. `make test-cluster` runs the e2e suite with it.
const TestTemporalEnv = "RLFLOW_TEST_TEMPORAL"

// clusterFromEnv reports whether $RLFLOW_TEST_TEMPORAL asks for a real
// cluster, and which; the test fails on any other value.
func clusterFromEnv(t testing.TB) (ClusterOptions, bool) {
	t.Helper()
	switch v := os.Getenv(TestTemporalEnv); v {
	case "", "dev":
		return ClusterOptions{}, false
	case "cluster":
		return ClusterOptions{}, true
	case "cluster-split":
		return ClusterOptions{Split: true}, true
	default:
		t.Fatalf("$%s=%q: want dev, cluster or cluster-split", TestTemporalEnv, v)
		return ClusterOptions{}, false
	}
}

// ClusterUnderTest starts the cluster $RLFLOW_TEST_TEMPORAL names, for the
// tests that need a real cluster's parts (its database, its processes); it
// skips when the variable names none: `make test-cluster` sets it.
func ClusterUnderTest(t testing.TB) *Cluster {
	t.Helper()
	o, ok := clusterFromEnv(t)
	if !ok {
		t.Skipf("needs a real Temporal cluster: runs under make test-cluster ($%s=cluster or cluster-split)", TestTemporalEnv)
	}
	return StartCluster(t, o)
}

// ClusterOptions shape a cluster.
type ClusterOptions struct {
	// Split runs the frontend, history, matching and worker services as
	// four processes, as a production deployment does, instead of one.
	Split bool
}

// Cluster is a real Temporal server on its own PostgreSQL, for one test:
// 4 history shards, every service bound to 127.0.0.1, configured through
// the server's own embedded config template and environment variables (as
// the temporalio/server image, and so docker-compose.yml, configures it),
// with the shipped dynamic config. The default namespace and rlflow's
// search attributes are registered.
//
// Invariant: Address and every port stay the same across Down and Up, and
// the server's state (in Postgres) survives both.
type Cluster struct {
	t testing.TB
	// Address is the frontend's host:port.
	Address string
	// Postgres is the cluster's database server; stopping it plays a
	// database outage.
	Postgres *Postgres

	bin      string
	env      []string
	services [][]string // per process; nil: every service
	logDir   string

	mu    sync.Mutex
	procs []*serverProc
}

type serverProc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

// StartCluster creates the Temporal schemas on a new private PostgreSQL
// (StartPostgres), starts the server and registers the default namespace
// with rlflow's search attributes. It skips (or fails under CI) when the
// server binaries or PostgreSQL are missing.
func StartCluster(t testing.TB, o ClusterOptions) *Cluster {
	t.Helper()
	server, sqlTool := TemporalServerBinaries(t)
	PostgresBinaries(t) // skip before building anything
	dynamicConfig := RepoFile(t, ShippedDynamicConfig)
	pg := StartPostgres(t)
	c := &Cluster{t: t, Postgres: pg, bin: server, logDir: t.TempDir()}
	createSchemas(t, sqlTool, pg, c.logDir)

	frontend := RebindablePort(t)
	c.Address = "127.0.0.1:" + strconv.Itoa(frontend)
	// The embedded template's variables (go.temporal.io/server's
	// common/config/config_template_embedded.yaml).
	c.env = []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + c.logDir,
		"DB=postgres12",
		"POSTGRES_SEEDS=127.0.0.1",
		"DB_PORT=" + strconv.Itoa(pg.Port),
		"POSTGRES_USER=" + pg.User,
		"POSTGRES_PWD=" + pg.Password,
		"NUM_HISTORY_SHARDS=4",
		"BIND_ON_IP=127.0.0.1",
		"DYNAMIC_CONFIG_FILE_PATH=" + dynamicConfig,
		"LOG_LEVEL=warn",
		"TEMPORAL_ALLOW_NO_AUTH=true",
		"FRONTEND_GRPC_PORT=" + strconv.Itoa(frontend),
		"FRONTEND_HTTP_PORT=" + strconv.Itoa(RebindablePort(t)),
	}
	for _, s := range []string{"FRONTEND", "HISTORY", "MATCHING", "WORKER"} {
		if s != "FRONTEND" {
			c.env = append(c.env, s+"_GRPC_PORT="+strconv.Itoa(RebindablePort(t)))
		}
		c.env = append(c.env, s+"_MEMBERSHIP_PORT="+strconv.Itoa(RebindablePort(t)))
	}
	t.Cleanup(func() {
		c.Down()
		if t.Failed() {
			c.logTails()
		}
	})

	// The first start is one process even for a split cluster: services
	// starting together on an empty database race to create the cluster's
	// metadata, and the losers exit.
	c.services = [][]string{nil}
	c.up(false)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := register(ctx, c.Address); err != nil {
		t.Fatalf("temporal cluster at %s: %v", c.Address, err)
	}
	// Every service caches namespaces and refreshes them every 2 s
	// (system.namespaceCacheRefreshInterval), so a run started right now
	// could find the search attributes missing in one of them; a restart
	// loads them fresh, and proves the cluster comes back from a SIGKILL.
	c.Down()
	if o.Split {
		c.services = [][]string{{"frontend"}, {"history"}, {"matching"}, {"worker"}}
	}
	c.Up()
	return c
}

// createSchemas creates the temporal and temporal_visibility databases
// with the server's schema tool, from the schemas embedded in the tool
// (the same files as the module's schema/postgresql/v12 directories).
func createSchemas(t testing.TB, sqlTool string, pg *Postgres, logDir string) {
	t.Helper()
	for _, db := range []struct{ name, schema string }{
		{"temporal", "postgresql/v12/temporal"},
		{"temporal_visibility", "postgresql/v12/visibility"},
	} {
		for _, args := range [][]string{
			{"create-database"},
			{"setup-schema", "-v", "0.0"},
			{"update-schema", "--schema-name", db.schema},
		} {
			cmd := exec.Command(sqlTool, append([]string{"--plugin", "postgres12", "--endpoint", "127.0.0.1",
				"--port", strconv.Itoa(pg.Port), "--user", pg.User, "--database", db.name}, args...)...)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "SQL_PASSWORD=" + pg.Password}
			cmd.Dir = logDir
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s %s on database %s: %v\n%s", filepath.Base(sqlTool), args[0], db.name, err, tailLines(string(out), 20))
			}
		}
	}
}

// register registers the default namespace and rlflow's search
// attributes, retrying while the server is still coming up.
func register(ctx context.Context, addr string) error {
	opts := client.Options{HostPort: addr, Namespace: "default", Logger: quietLogger()}
	nc, err := client.NewNamespaceClient(opts)
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	defer nc.Close()
	for {
		err = nc.Register(ctx, &workflowservice.RegisterNamespaceRequest{
			Namespace: "default", WorkflowExecutionRetentionPeriod: durationpb.New(24 * time.Hour)})
		var exists *serviceerror.NamespaceAlreadyExists
		if err == nil || errors.As(err, &exists) {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("registering namespace default: %w", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	c, err := client.NewLazyClient(opts)
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		ok, err := runs.EnsureSearchAttributes(ctx, c, "default")
		if ok {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("registering rlflow's search attributes: %w", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Down SIGKILLs every server process, as a crashed host or an OOM kill
// would, and waits for them to be gone; PostgreSQL keeps running. A no-op
// when the server is down.
func (c *Cluster) Down() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.procs {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
	for _, p := range c.procs {
		<-p.done
	}
	c.procs = nil
}

// Up starts the server processes again on the same ports and waits until
// the cluster serves the default namespace through frontend, history and
// matching; a no-op when they run.
func (c *Cluster) Up() {
	c.t.Helper()
	c.up(true)
}

func (c *Cluster) up(registered bool) {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.procs != nil {
		return
	}
	for _, svc := range c.services {
		name := "all"
		args := []string{"start"}
		if svc != nil {
			name = strings.Join(svc, "+")
			for _, s := range svc {
				args = append(args, "--service", s)
			}
		}
		log, err := os.OpenFile(filepath.Join(c.logDir, "temporal-"+name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			c.t.Fatal(err)
		}
		cmd := exec.Command(c.bin, args...)
		cmd.Env = c.env
		cmd.Dir = c.logDir
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		err = procs.Start(cmd) // Pdeathsig: see procs.Start
		log.Close()
		if err != nil {
			c.t.Fatalf("starting the Temporal server (%s): %v", name, err)
		}
		p := &serverProc{name: name, cmd: cmd, done: make(chan struct{})}
		go func() { _ = cmd.Wait(); close(p.done) }()
		c.procs = append(c.procs, p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := client.NewLazyClient(client.Options{HostPort: c.Address, Namespace: "default", Logger: quietLogger()})
	if err != nil {
		c.t.Fatal(err)
	}
	defer cl.Close()
	for {
		err := ready(ctx, cl, registered)
		if err == nil {
			return
		}
		for _, p := range c.procs {
			select {
			case <-p.done:
				c.t.Fatalf("the Temporal server (%s) exited at start: %v; its log:\n%s", p.name, p.cmd.ProcessState,
					tailFile(filepath.Join(c.logDir, "temporal-"+p.name+".log"), 30))
			default:
			}
		}
		if ctx.Err() != nil {
			c.t.Fatalf("the Temporal cluster at %s is not ready after 2 minutes: %v", c.Address, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ready says why the cluster does not serve yet: before registration the
// frontend's health; after it, the default namespace (frontend and
// persistence), a workflow lookup (history) and a task queue (matching).
func ready(ctx context.Context, c client.Client, registered bool) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if !registered {
		_, err := c.CheckHealth(rctx, &client.CheckHealthRequest{})
		return err
	}
	if _, err := c.WorkflowService().DescribeNamespace(rctx, &workflowservice.DescribeNamespaceRequest{Namespace: "default"}); err != nil {
		return fmt.Errorf("frontend: %w", err)
	}
	var notFound *serviceerror.NotFound
	if _, err := c.DescribeWorkflow(rctx, "rlflow-readiness-probe", ""); !errors.As(err, &notFound) {
		return fmt.Errorf("history: %v", err)
	}
	if _, err := c.WorkflowService().DescribeTaskQueue(rctx, &workflowservice.DescribeTaskQueueRequest{
		Namespace: "default", TaskQueue: &taskqueuepb.TaskQueue{Name: "rlflow-readiness-probe"},
		TaskQueueType: enumspb.TASK_QUEUE_TYPE_WORKFLOW}); err != nil {
		return fmt.Errorf("matching: %w", err)
	}
	return nil
}

// logTails logs the end of every server process's log.
func (c *Cluster) logTails() {
	logs, _ := filepath.Glob(filepath.Join(c.logDir, "temporal-*.log"))
	for _, l := range logs {
		c.t.Logf("%s, last lines:\n%s", filepath.Base(l), tailFile(l, 30))
	}
}

func quietLogger() sdklog.Logger { return sdklog.NewStructuredLogger(slog.New(slog.DiscardHandler)) }

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
