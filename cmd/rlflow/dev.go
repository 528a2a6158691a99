package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/devserver"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/worker"
	"github.com/spf13/cobra"
)

// defaultDevExample is the example `rlflow dev` runs without a FILE.
const defaultDevExample = "rlhf-demo"

func newDevCmd(g *globalFlags) *cobra.Command {
	var params []string
	var uiPort int
	var exit, noBuild, useDouble bool
	var temporalPath, stateDir, example, roots, metricsAddr string
	cmd := &cobra.Command{
		Use:   "dev [FILE]",
		Short: "All in one: local Temporal dev server + UI, a worker, a vLLM double, and the RLHF demo",
		Long: `Dev starts a local Temporal dev server with its web UI (the Temporal CLI from
./bin/temporal; built from the Go module proxy on first use), a control worker
in this process, and runs FILE or an embedded example (--example, default
` + defaultDevExample + `), printing each step as it runs and the UI link of the run.
It then keeps the server and worker up for the UI until Ctrl-C, unless --exit
is given.

The default example, rlhf-demo, is vLLM's rlhf_http.py as a pipeline: for 3
iterations it generates, trains with the DEMO TRAINER (rlflow demo-train),
pauses, broadcasts the checkpoint (disk backend), resumes, generates again and
evaluates. Its server is a vLLM TEST AND DEMO DOUBLE (not an inference engine)
started in this process on a random loopback port; dev prints, per iteration,
a sample from before and after the update and the eval score. With
--vllm-double, a FILE's servers are replaced by such a double too; --example
hello runs the shell-only example.

If something already listens on --address, dev uses that server instead of
starting one. State persists in --state-dir, so the UI keeps listing runs.

Its worker serves files from FILE's directory and --state-dir only (--roots
replaces FILE's directory; see rlflow worker --help): a run started from the
UI cannot reach the rest of the machine through a path.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			out := cmd.OutOrStdout()
			state, err := filepath.Abs(stateDir)
			if err != nil {
				return err
			}
			if err := os.MkdirAll(state, 0o755); err != nil {
				return fmt.Errorf("creating %s: %w", state, err)
			}
			spec, values, err := devPipeline(args, example, params, state)
			if err != nil {
				return &exitError{code: 1, err: err}
			}
			if !cmd.Flags().Changed("vllm-double") {
				useDouble = len(args) == 0 && len(spec.Servers) > 0
			}
			if useDouble {
				// Stock vLLM of the newest API generation (checkpoints load
				// through /collective_rpc), the untrained model of seed 0
				// (demo-train's random:0), on random loopback ports.
				addrs := make([]string, len(spec.Servers))
				for i := range addrs {
					addrs[i] = "127.0.0.1:0"
				}
				d, err := startDoubles(context.WithoutCancel(ctx), double.Config{Generation: double.GenE, Backend: double.BackendNCCL, DevMode: true}, addrs)
				if err != nil {
					return err
				}
				defer d.stop()
				for i := range spec.Servers {
					spec.Servers[i] = pipelines.Server{URL: d.urls[i]}
				}
				fmt.Fprintf(out, "vLLM TEST AND DEMO DOUBLE (not an inference engine; stock vLLM of API generation E: checkpoints reload through /collective_rpc) at %s\n", strings.Join(d.urls, ", "))
			}
			if exe, err := os.Executable(); err == nil && hasParam(spec, "rlflow") && !hasFlagParam(params, "rlflow") {
				values["rlflow"] = exe // the demo's exec step runs this very binary
			}

			ui := fmt.Sprintf("http://localhost:%d", uiPort)
			if devserver.Reachable(g.address) {
				fmt.Fprintf(out, "using the Temporal server already listening on %s\n", g.address)
			} else {
				srv, err := startDevServer(ctx, g, temporalPath, uiPort, state, noBuild, out)
				if err != nil {
					return err
				}
				defer srv.Stop()
				fmt.Fprintf(out, "Temporal dev server on %s, UI at %s\n", srv.Address, srv.UIURL)
			}
			// FILE's directory, or the state dir that holds an example's
			// work dir; the state dir holds the worker's logs and data.
			list := roots
			switch {
			case list != "":
			case len(args) == 1:
				if list, err = filepath.Abs(filepath.Dir(args[0])); err != nil {
					return err
				}
			default:
				list = state
			}
			r, err := workerRoots(list, state)
			if err != nil {
				return err
			}
			c, err := runs.Connect(ctx, g.address, g.namespace)
			if err != nil {
				return err
			}
			defer c.Close()
			m, metricsURL, stopMetrics, err := startMetrics(metricsAddr, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
			if err != nil {
				return err
			}
			defer stopMetrics()
			if m != nil {
				fmt.Fprintf(out, "worker metrics (Prometheus) at %s\n", metricsURL)
			}
			w, err := worker.NewControl(c, worker.Options{TaskQueue: g.taskQueue, Metrics: m,
				Deps: activities.Deps{LogDir: filepath.Join(state, "logs"), DataDir: filepath.Join(state, "data"), Roots: r}})
			if err != nil {
				return err
			}
			if err := w.Start(); err != nil {
				return fmt.Errorf("starting worker: %w", err)
			}
			defer w.Stop()
			sum := &demoSummary{out: out}
			runErr := startAndFollowWith(ctx, c, g, spec, values, "", ui, true, out, sum.iteration)
			sum.finish()
			if exit || ctx.Err() != nil {
				return runErr
			}
			if runErr != nil {
				fmt.Fprintln(os.Stderr, "rlflow:", runErr)
			}
			fmt.Fprintf(out, "\nThe Temporal UI lists the run at %s/namespaces/%s/workflows\nServer and worker stay up; press Ctrl-C to stop.\n", ui, g.namespace)
			<-ctx.Done()
			return runErr
		},
	}
	f := cmd.Flags()
	f.StringArrayVarP(&params, "param", "p", nil, "parameter name=value (repeatable)")
	f.IntVar(&uiPort, "ui-port", 8233, "port of the Temporal web UI")
	f.BoolVar(&exit, "exit", false, "stop the server and worker once the run ends (exit status = the run's)")
	f.BoolVar(&noBuild, "no-build", false, "fail instead of building the Temporal CLI when it is missing")
	f.StringVar(&temporalPath, "temporal", "", "path of the Temporal CLI binary (default: $RLFLOW_TEMPORAL, ./bin/temporal, PATH)")
	f.StringVar(&stateDir, "state-dir", ".rlflow", "directory for the dev server's database, step logs and the example's work files")
	f.StringVar(&example, "example", defaultDevExample, "embedded example to run without FILE: "+strings.Join(exampleNames(), ", "))
	addRootsFlag(cmd, &roots, "FILE's directory")
	// A free loopback port: a dev run beside a worker on 9464 still starts.
	addMetricsFlag(cmd, &metricsAddr, envOr("RLFLOW_METRICS_ADDRESS", "127.0.0.1:0"))
	f.BoolVar(&useDouble, "vllm-double", false, "serve the pipeline's servers with in-process vLLM test doubles (default: on for embedded examples with servers)")
	return cmd
}

// devPipeline loads FILE, or an embedded example with its base_dir set to
// a work directory under the state dir, where its data files are copied.
func devPipeline(args []string, example string, params []string, state string) (*pipelines.Pipeline, map[string]any, error) {
	if len(args) == 1 {
		return loadWithParams(args[0], params)
	}
	name := "examples/" + example + ".yaml"
	data, err := pipelines.Examples.ReadFile(name)
	if err != nil {
		return nil, nil, fmt.Errorf("--example %q: no such embedded example (have %s)", example, strings.Join(exampleNames(), ", "))
	}
	work := filepath.Join(state, "work")
	if err := pipelines.CopyExampleData(work); err != nil {
		return nil, nil, err
	}
	p, err := pipelines.Load("(embedded) pipelines/"+name, data)
	if err != nil {
		return nil, nil, err
	}
	p.BaseDir = work
	raw, err := pipelines.ParseParamFlags(params)
	if err != nil {
		return nil, nil, err
	}
	values, err := p.ResolveParams(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("params: %w", err)
	}
	return p, values, nil
}

func exampleNames() []string {
	entries, _ := pipelines.Examples.ReadDir("examples")
	var names []string
	for _, e := range entries {
		if n, ok := strings.CutSuffix(e.Name(), ".yaml"); ok {
			names = append(names, n)
		}
	}
	return names
}

func hasParam(p *pipelines.Pipeline, name string) bool {
	for _, q := range p.Params {
		if q.Name == name {
			return true
		}
	}
	return false
}

func hasFlagParam(flags []string, name string) bool {
	for _, f := range flags {
		if k, _, _ := strings.Cut(f, "="); k == name {
			return true
		}
	}
	return false
}

func startDevServer(ctx context.Context, g *globalFlags, temporalPath string, uiPort int, state string, noBuild bool, out io.Writer) (*devserver.Server, error) {
	bin, err := devserver.FindTemporal(temporalPath)
	if err != nil {
		if noBuild {
			return nil, err
		}
		fmt.Fprintf(out, "Temporal CLI not found: building %s into ./bin (once; a few minutes)...\n", devserver.TemporalCLIModule)
		start := time.Now()
		if bin, err = devserver.BuildTemporal(ctx, "bin", out); err != nil {
			return nil, err
		}
		fmt.Fprintf(out, "built %s in %s\n", bin, time.Since(start).Round(time.Second))
	}
	logf, err := os.OpenFile(filepath.Join(state, "temporal.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return devserver.Start(ctx, devserver.Options{
		TemporalPath: bin, Address: g.address, UIPort: uiPort, Namespace: g.namespace,
		DBFile: filepath.Join(state, "temporal.db"), Log: logf,
	})
}
