package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/devserver"
	"github.com/rlflow/rlflow/launch"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/worker"
	"github.com/spf13/cobra"
)

// defaultDevPipeline is the example `rlflow dev` runs without a FILE.
const defaultDevPipeline = "examples/hello.yaml"

func newDevCmd(g *globalFlags) *cobra.Command {
	var params []string
	var uiPort int
	var exit, noBuild bool
	var temporalPath, stateDir string
	cmd := &cobra.Command{
		Use:   "dev [FILE]",
		Short: "All in one: local Temporal dev server + UI, a worker, and a pipeline run",
		Long: `Dev starts a local Temporal dev server with its web UI (the Temporal CLI from
./bin/temporal; built from the Go module proxy on first use), a control worker
in this process, and runs FILE (default: the embedded ` + defaultDevPipeline + `),
printing each step as it runs and the UI link of the run. It then keeps the
server and worker up for the UI until Ctrl-C, unless --exit is given.

If something already listens on --address, dev uses that server instead of
starting one. State persists in --state-dir, so the UI keeps listing runs.`,
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
			spec, values, err := devPipeline(args, params, state)
			if err != nil {
				return &exitError{code: 1, err: err}
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
			c, err := launch.Connect(ctx, g.address, g.namespace)
			if err != nil {
				return err
			}
			defer c.Close()
			w, err := worker.NewControl(c, worker.Options{TaskQueue: g.taskQueue, Deps: activities.Deps{LogDir: filepath.Join(state, "logs")}})
			if err != nil {
				return err
			}
			if err := w.Start(); err != nil {
				return fmt.Errorf("starting worker: %w", err)
			}
			defer w.Stop()
			runErr := startAndFollow(ctx, c, g, spec, values, "", ui, true, out)
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
	return cmd
}

// devPipeline loads FILE, or the embedded default example with its base_dir
// set to a work directory under the state dir.
func devPipeline(args, params []string, state string) (*pipelines.Pipeline, map[string]any, error) {
	if len(args) == 1 {
		return loadWithParams(args[0], params)
	}
	data, err := pipelines.Examples.ReadFile(defaultDevPipeline)
	if err != nil {
		return nil, nil, fmt.Errorf("embedded %s: %w", defaultDevPipeline, err)
	}
	work := filepath.Join(state, "work")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return nil, nil, err
	}
	p, err := pipelines.Load("(embedded) pipelines/"+defaultDevPipeline, data)
	if err != nil {
		return nil, nil, err
	}
	p.BaseDir = work
	raw, err := parseParamFlags(params)
	if err != nil {
		return nil, nil, err
	}
	values, err := p.ResolveParams(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("params: %w", err)
	}
	return p, values, nil
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
