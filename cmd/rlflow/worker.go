package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker"
	"github.com/spf13/cobra"
	"go.temporal.io/sdk/client"
	"google.golang.org/grpc"
)

func newWorkerCmd(g *globalFlags) *cobra.Command {
	var logDir, dataDir, roots, metricsAddr string
	var maxActivities int
	var execEnv string
	var gf gpuFlags
	var cf connectFlags
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a control worker (the pipeline interpreter and the control step types) or, with --gpu, a GPU worker",
		Long: `Worker serves --task-queue on the Temporal cluster at --address: it runs the
rlflow.Pipeline and rlflow.Iteration workflows and the control activities
(exec, noop, load_pipeline, ...). Run as many as you like; Temporal spreads
steps over them and retries a dead worker's steps on a live one.

With --gpu it is a GPU worker instead, on the trainer's GPU host: it answers
gpu_acquire on --gpu-task-queue with a task queue of its own
(rlflow-gpu/<host>/<instance>) and runs init_transfer and broadcast there,
broadcasting checkpoints from --gpu-device over NCCL to the vLLM servers.
--advertise is the address the servers reach it at for the NCCL rendezvous.

A worker reads and writes only inside its roots (--roots): every path a
pipeline names (spec_path, base_dir, prompts, outputs, checkpoints, an exec
step's dir and relative program) must resolve there, symbolic links followed,
or the step fails naming the field. Anyone who can start a workflow on the
cluster chooses those paths. Without --roots (or RLFLOW_ROOTS) the root is
the working directory; a control worker's --log-dir and --data-dir are always
roots. / and the kernel's /proc, /sys and /dev are refused as roots.

Exec commands get a minimal environment (PATH, HOME, the locale, the
CUDA/NVIDIA/NCCL variables: see the exec step's reference), the secrets their
step names (secrets: [HF_TOKEN]) from the worker's environment, and their
env; --exec-env inherit passes the worker's whole environment instead. Every
secret the worker knows (exec secrets, api_key_env keys) is masked as *** in
what it reports to Temporal.

A worker started while Temporal is down (or unreachable) waits for it,
logging a warning per attempt, and starts once it answers (--connect-timeout
bounds the wait); a running worker rides out later outages. The Temporal
SDK's own warnings and errors (a workflow task failing, polls failing) go to
the worker's log.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := cf.check(); err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, nil))
			m, metricsURL, stopMetrics, err := startMetrics(metricsAddr, log)
			if err != nil && metricsAddr == defaultMetricsAddress && !cmd.Flags().Changed("metrics-address") {
				// Only the default: a second worker on the host finds it
				// taken, and must still run; an address asked for fails.
				log.Warn("serving no metrics: the default metrics address is taken (another worker on this host?); pass --metrics-address host:port, or empty to disable", "err", err)
				m, stopMetrics, err = nil, func() {}, nil
			}
			if err != nil {
				return err
			}
			defer stopMetrics()
			if m != nil {
				log.Info("serving metrics", "url", metricsURL)
			}
			if gf.enabled {
				r, err := workerRoots(roots)
				if err != nil {
					return err
				}
				return runGPUWorker(ctx, g, gf, cf, r, m, log)
			}
			if gf.fakeNCCL {
				return errors.New("--fake-nccl needs --gpu")
			}
			abs, err := filepath.Abs(logDir)
			if err != nil {
				return err
			}
			data, err := filepath.Abs(dataDir)
			if err != nil {
				return err
			}
			r, err := workerRoots(roots, abs, data)
			if err != nil {
				return err
			}
			execMode, err := activities.ParseExecEnv(execEnv)
			if err != nil {
				return fmt.Errorf("--exec-env (env RLFLOW_EXEC_ENV): %w", err)
			}
			// Each step's result is kept until Temporal acknowledged it;
			// the connection shows whether it did.
			reports := activities.NewReports()
			defer reports.Close()
			c, err := dialWorker(ctx, g, cf, m, log, reports.Watch)
			if err != nil || c == nil {
				return err
			}
			defer c.Close()
			fatal := make(chan error, 1)
			w, err := worker.NewControl(c, worker.Options{
				TaskQueue: g.taskQueue, Deps: activities.Deps{LogDir: abs, DataDir: data, Roots: r, ExecEnv: execMode}, MaxConcurrentActivities: maxActivities,
				Metrics: m, Reports: reports,
				OnFatalError: func(err error) {
					select {
					case fatal <- err:
					default:
					}
				},
			})
			if err != nil {
				return err
			}
			if err := w.Start(); err != nil {
				return fmt.Errorf("starting worker: %w", err)
			}
			log.Info("rlflow worker running",
				"address", g.address, "namespace", g.namespace, "task_queue", g.taskQueue, "log_dir", abs, "data_dir", data, "roots", r.String(), "pid", os.Getpid())
			select {
			case <-ctx.Done():
			case err := <-fatal:
				// The SDK stopped polling for good: exit, so a supervisor
				// restarts the worker instead of it looking alive.
				w.Stop()
				return fmt.Errorf("worker stopped: %w", err)
			}
			w.Stop()
			return nil
		},
	}
	cmd.Flags().StringVar(&logDir, "log-dir", envOr("RLFLOW_LOG_DIR", ".rlflow/logs"), "directory for per-attempt step logs (env RLFLOW_LOG_DIR)")
	cmd.Flags().StringVar(&dataDir, "data-dir", envOr("RLFLOW_DATA_DIR", ".rlflow/data"), "directory for generate and evaluate output files that steps do not place (env RLFLOW_DATA_DIR)")
	addRootsFlag(cmd, &roots, "the working directory")
	cmd.Flags().IntVar(&maxActivities, "max-concurrent-steps", 0, "steps this worker runs at once (0 = Temporal's default)")
	cmd.Flags().StringVar(&execEnv, "exec-env", envOr("RLFLOW_EXEC_ENV", string(activities.ExecEnvMinimal)),
		"environment of exec commands: minimal (PATH, HOME, locale, CUDA/NVIDIA/NCCL variables, and the secrets a step names) or inherit (the worker's whole environment) (env RLFLOW_EXEC_ENV)")
	addMetricsFlag(cmd, &metricsAddr, envOr("RLFLOW_METRICS_ADDRESS", defaultMetricsAddress))
	gf.register(cmd)
	cf.register(cmd)
	return cmd
}

// defaultMetricsAddress is where a worker serves Prometheus metrics unless
// told otherwise: loopback, so nothing is exposed beyond the host by
// default (9464 is the port OpenTelemetry's Prometheus exporter uses).
const defaultMetricsAddress = "127.0.0.1:9464"

// addMetricsFlag registers --metrics-address on cmd with default def.
func addMetricsFlag(cmd *cobra.Command, v *string, def string) {
	cmd.Flags().StringVar(v, "metrics-address", def,
		"host:port to serve Prometheus metrics on at "+metrics.Path+" (rlflow_* step and sync metrics, the Temporal SDK's temporal_*); empty disables (env RLFLOW_METRICS_ADDRESS)")
}

// startMetrics serves a worker's metrics on addr, or returns nil metrics
// (recording nothing) when addr is empty; url is where they are served,
// stop closes the server.
func startMetrics(addr string, log *slog.Logger) (m *metrics.Metrics, url string, stop func(), err error) {
	addr = strings.TrimSpace(addr)
	if addr == "" {
		return nil, "", func() {}, nil
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, "", nil, fmt.Errorf("--metrics-address (env RLFLOW_METRICS_ADDRESS) %q: want host:port such as 127.0.0.1:9464, or empty to disable: %v", addr, err)
	}
	m = metrics.New()
	srv, err := m.Serve(addr, log)
	if err != nil {
		return nil, "", nil, fmt.Errorf("--metrics-address (env RLFLOW_METRICS_ADDRESS): %w", err)
	}
	return m, srv.URL(), func() { srv.Close() }, nil
}

// addRootsFlag registers --roots (env RLFLOW_ROOTS) on cmd.
func addRootsFlag(cmd *cobra.Command, v *string, def string) {
	cmd.Flags().StringVar(v, "roots", os.Getenv("RLFLOW_ROOTS"), fmt.Sprintf(
		"directories, separated by %q, that every path a pipeline names must resolve inside, symbolic links followed "+
			"(spec_path, base_dir, prompts, outputs, checkpoints, exec dir); default: %s (env RLFLOW_ROOTS)", string(os.PathListSeparator), def))
}

// workerRoots are a worker's roots: those of list (a --roots value), or
// the working directory when it names none, plus own, the worker's own
// directories, created when missing.
func workerRoots(list string, own ...string) (*activities.Roots, error) {
	var dirs []string
	for _, d := range filepath.SplitList(list) {
		if d = strings.TrimSpace(d); d != "" {
			dirs = append(dirs, d)
		}
	}
	if len(dirs) == 0 {
		wd, err := os.Getwd()
		if err != nil {
			return nil, fmt.Errorf("the default root, the working directory: %w", err)
		}
		if _, err := activities.NewRoots(wd); err != nil {
			return nil, fmt.Errorf("the default root, the working directory: %w (pass --roots or set RLFLOW_ROOTS)", err)
		}
		dirs = []string{wd}
	} else if _, err := activities.NewRoots(dirs...); err != nil {
		return nil, fmt.Errorf("--roots: %w", err)
	}
	for _, d := range own {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("creating %s: %w", d, err)
		}
	}
	r, err := activities.NewRoots(append(dirs, own...)...)
	if err != nil {
		return nil, fmt.Errorf("the worker's own directories: %w", err)
	}
	return r, nil
}

// connectFlags bound a worker's wait for its Temporal frontend.
type connectFlags struct {
	timeout time.Duration
	// envErr is a malformed RLFLOW_CONNECT_TIMEOUT, reported when the
	// worker starts rather than replaced by the default.
	envErr error
}

func (f *connectFlags) register(cmd *cobra.Command) {
	def, err := envDuration("RLFLOW_CONNECT_TIMEOUT", 0)
	f.envErr = err
	cmd.Flags().DurationVar(&f.timeout, "connect-timeout", def, "how long a starting worker waits for Temporal to answer; 0 waits until it does (env RLFLOW_CONNECT_TIMEOUT)")
}

func (f connectFlags) check() error {
	if f.envErr != nil {
		return f.envErr
	}
	if f.timeout < 0 {
		return fmt.Errorf("--connect-timeout %s: must be 0 (wait until Temporal answers) or more", f.timeout)
	}
	return nil
}

// dialWorker connects a worker, waiting for Temporal; stopped (Ctrl-C)
// while it waits, it returns neither client nor error: the worker was
// asked to stop, and does.
func dialWorker(ctx context.Context, g *globalFlags, f connectFlags, m *metrics.Metrics, log *slog.Logger, watch ...grpc.UnaryClientInterceptor) (client.Client, error) {
	c, err := g.dial(ctx, runs.DialOptions{Log: log, MaxWait: f.timeout, MetricsHandler: m.SDKHandler(), GRPCInterceptors: watch})
	if err != nil && ctx.Err() != nil {
		log.Info("stopped while waiting for temporal", "address", g.address)
		return nil, nil
	}
	return c, err
}

// envDuration is the duration in the environment variable key, def where
// it is unset; a value that is not a non-negative duration is an error,
// never the default.
func envDuration(key string, def time.Duration) (time.Duration, error) {
	s := os.Getenv(key)
	if s == "" {
		return def, nil
	}
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return def, fmt.Errorf("%s=%q: not a duration such as 30s or 5m (0 waits forever)", key, s)
	}
	if v < 0 {
		return def, fmt.Errorf("%s=%q: must be 0 (wait forever) or more", key, s)
	}
	return v, nil
}
