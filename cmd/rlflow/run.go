package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
	"github.com/spf13/cobra"
	"go.temporal.io/sdk/client"
	"golang.org/x/term"
)

func loadWithParams(path string, flags []string) (*pipelines.Pipeline, map[string]any, error) {
	p, err := pipelines.LoadFile(path)
	if err != nil {
		return nil, nil, err
	}
	raw, err := pipelines.ParseParamFlags(flags)
	if err != nil {
		return nil, nil, err
	}
	params, err := p.ResolveParams(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: params: %w", path, err)
	}
	return p, params, nil
}

func newRunCmd(g *globalFlags) *cobra.Command {
	var params []string
	var wait bool
	var id, ui string
	cmd := &cobra.Command{
		Use:   "run FILE",
		Short: "Start a pipeline run (with --wait: follow it live and exit with its outcome)",
		Long: `Run validates FILE, resolves -p name=value parameters against its params, and
starts a run on the Temporal cluster (--address). The spec is frozen into the
run's input: editing the file later does not change the run. A control worker
(rlflow worker, or rlflow dev) must serve --task-queue, on a host that sees the
same paths as the pipeline's base_dir.

With --wait it follows the run until it ends and exits with its outcome. It
waits out Temporal outages of any length, printing a line when the frontend
stops answering and one when it is back; Ctrl-C stops following, not the run, and prints how to cancel it.
A worker must poll --task-queue: if none does after a few seconds, it says so.
A failed run ends with one sentence (the step, the attempt, what happened) and
the step's log tail.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			spec, values, err := loadWithParams(args[0], params)
			if err != nil {
				return &exitError{code: 1, err: err}
			}
			return g.withClient(ctx, func(c client.Client) error {
				return startAndFollow(ctx, c, g, spec, values, id, ui, wait, cmd.OutOrStdout())
			})
		},
	}
	f := cmd.Flags()
	f.StringArrayVarP(&params, "param", "p", nil, "parameter name=value (repeatable)")
	f.BoolVar(&wait, "wait", false, "follow the run until it ends, waiting out Temporal outages; exit 1 if it fails")
	f.StringVar(&id, "id", "", "workflow id for the run (default: <name>-<time>-<random>)")
	f.StringVar(&ui, "ui", envOr("RLFLOW_UI", "http://localhost:8233"), "Temporal UI base URL for printed links (env RLFLOW_UI)")
	return cmd
}

func startAndFollow(ctx context.Context, c client.Client, g *globalFlags, spec *pipelines.Pipeline, params map[string]any, id, ui string, wait bool, out io.Writer) error {
	return startAndFollowWith(ctx, c, g, spec, params, id, ui, wait, out, nil)
}

// startAndFollowWith is startAndFollow with a hook called with each finished
// iteration's result while it follows the run.
func startAndFollowWith(ctx context.Context, c client.Client, g *globalFlags, spec *pipelines.Pipeline, params map[string]any, id, ui string, wait bool, out io.Writer, onIteration func(workflows.IterationResult)) error {
	sa, saErr := runs.EnsureSearchAttributes(ctx, c, g.namespace)
	if saErr != nil {
		fmt.Fprintf(os.Stderr, "warning: search attributes unavailable, runs will not be filterable by pipeline: %v\n", saErr)
	}
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: g.taskQueue, ID: id, SearchAttributes: sa})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "started %s\n  workflow id: %s\n  run id:      %s\n  ui:          %s\n", spec.Name, run.GetID(), run.GetRunID(),
		runs.UIURL(ui, g.namespace, run.GetID(), run.GetRunID()))
	if !wait {
		return nil
	}
	var bar io.Writer
	if term.IsTerminal(int(os.Stderr.Fd())) {
		bar = os.Stderr
	}
	total := spec.Loop.Iterations
	if spec.Loop.Until != "" {
		total = spec.Loop.MaxIterations
	}
	res, err := runs.Watch(ctx, c, run, runs.WatchOptions{Out: out, Bar: bar, Total: total, OnIteration: onIteration, Address: g.address})
	if err != nil && ctx.Err() != nil {
		// Interrupted: the run itself goes on, on the cluster.
		return &exitError{code: exitRunUnsuccessful, err: detached(run.GetID())}
	}
	if err != nil {
		var re *runs.RunError
		if errors.As(err, &re) {
			return &exitError{code: exitRunUnsuccessful, err: err}
		}
		return &exitError{code: exitRunUnsuccessful, err: fmt.Errorf("following run %s: %s", run.GetID(), runs.ExplainError(err))}
	}
	fmt.Fprintf(out, "run %s succeeded: %d iteration(s), stopped by %s\n", run.GetID(), res.Iterations, res.StoppedBy)
	return nil
}

// detached is what Ctrl-C during run --wait says: the run is not
// cancelled, and how to look at it or cancel it.
func detached(id string) error {
	return fmt.Errorf("stopped following %s (the run goes on; rlflow status %s); to cancel it: rlflow cancel %s", id, id, id)
}

// statusIterations is how many finished iterations' outputs status prints
// (--json lists every one).
const statusIterations = workflows.RecentIterations

func newStatusCmd(g *globalFlags) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status RUN_ID",
		Short: "Show a run's iteration, each step's state, attempts and last error",
		Long: `Status shows a run: its Temporal state, the outputs of its last finished
iterations (--json: of every one), each step of the running (or last)
iteration, and, for a run that did not succeed, why: one sentence and the
failed step's log tail. It exits 1 when the run failed, was cancelled,
terminated or timed out, 0 while it runs and when it succeeded.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			// A Temporal outage is waited out, saying so on stderr, as
			// run --wait does: Ctrl-C stops waiting.
			ctx := cmd.Context()
			errOut := cmd.ErrOrStderr()
			c, err := g.dial(ctx, runs.DialOptions{
				Log: slog.New(slog.NewTextHandler(errOut, &slog.HandlerOptions{Level: slog.LevelWarn})), Backoff: runs.Backoff{Min: time.Second, Max: 5 * time.Second}})
			if err != nil {
				return err
			}
			defer c.Close()
			st, err := runs.WaitStatus(ctx, c, g.address, args[0], "", func(line string) { fmt.Fprintln(errOut, line) })
			if err != nil {
				return &exitError{code: 1, err: err}
			}
			if asJSON {
				runs.FillIterations(ctx, c, st, 0)
				if err := writeJSON(cmd.OutOrStdout(), st); err != nil {
					return err
				}
			} else {
				runs.FillIterations(ctx, c, st, statusIterations)
				runs.PrintStatus(cmd.OutOrStdout(), st)
			}
			if st.Unsuccessful() {
				return &exitError{code: exitRunUnsuccessful, err: errShown}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newCancelCmd(g *globalFlags) *cobra.Command {
	return idCommand(g, "cancel RUN_ID", "Cancel a run: running steps are cancelled, `always` steps still run",
		func(ctx context.Context, c client.Client, id string) error {
			if err := c.CancelWorkflow(ctx, id, ""); err != nil {
				return fmt.Errorf("cancelling %s: %w", id, err)
			}
			return nil
		}, "cancellation requested for %s")
}

func newSignalCmd(g *globalFlags, name, short string) *cobra.Command {
	signal := map[string]string{"pause": workflows.SignalPause, "resume": workflows.SignalResume}[name]
	return idCommand(g, name+" RUN_ID", short,
		func(ctx context.Context, c client.Client, id string) error {
			if err := c.SignalWorkflow(ctx, id, "", signal, nil); err != nil {
				return fmt.Errorf("%s %s: %w", name, id, err)
			}
			return nil
		}, name+" sent to %s")
}
