// Command rlflow validates, runs and watches RLHF pipelines on Temporal.
// This package holds flags and wiring only.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/rlflow/rlflow/runs"
	"github.com/spf13/cobra"
)

// exitError carries a process exit code through cobra.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }

// globalFlags are the flags of every command. address and namespace hold
// the flags until the command runs, then the connection resolved from
// them (resolveConnection); security and connErr are set with them.
type globalFlags struct {
	address    string
	namespace  string
	taskQueue  string
	configFile string
	profile    string
	security   runs.Security
	// connErr is why the connection could not be resolved, reported by
	// the commands that connect (target, withClient, dial), not by
	// those that never do.
	connErr error
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := newRoot()
	err := root.ExecuteContext(ctx)
	if err == nil {
		return
	}
	var ee *exitError
	if errors.As(err, &ee) {
		if ee.err != nil && ee.err.Error() != "" {
			fmt.Fprintln(os.Stderr, "rlflow:", ee.err)
		}
		os.Exit(ee.code)
	}
	fmt.Fprintln(os.Stderr, "rlflow:", err)
	os.Exit(1)
}

func newRoot() *cobra.Command {
	g := &globalFlags{}
	root := &cobra.Command{
		Use:   "rlflow",
		Short: "Durable RLHF pipelines on Temporal",
		Long: `rlflow runs RLHF iterations as durable Temporal workflows. A pipeline is a
YAML DAG of steps (generate, exec, pause, broadcast, resume, evaluate, ...);
each iteration is a workflow whose steps are activities, so a crashed worker
or node loses nothing.

Start with "rlflow dev": a local Temporal dev server with its web UI, a worker
and an example pipeline.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	// Every command resolves its connection here; a subcommand with a
	// PersistentPreRun of its own would skip this one (cobra runs the
	// nearest only), so none has one.
	root.PersistentPreRun = func(cmd *cobra.Command, _ []string) { g.resolveConnection(cmd) }
	pf := root.PersistentFlags()
	pf.StringVar(&g.address, "address", "", "Temporal frontend host:port (default: env TEMPORAL_ADDRESS, else the profile's address, else "+runs.DefaultAddress+")")
	pf.StringVar(&g.namespace, "namespace", "", "Temporal namespace (default: env TEMPORAL_NAMESPACE, else the profile's namespace, else "+runs.DefaultNamespace+")")
	pf.StringVar(&g.configFile, "config-file", "", "Temporal client config file (TOML) as the Temporal CLI reads it (default: env TEMPORAL_CONFIG_FILE, else <user config dir>/temporalio/temporal.toml)")
	pf.StringVar(&g.profile, "profile", "", "profile of the config file (default: env TEMPORAL_PROFILE, else default)")
	pf.StringVar(&g.taskQueue, "task-queue", envOr("RLFLOW_TASK_QUEUE", "rlflow"), "task queue of the control worker (env RLFLOW_TASK_QUEUE)")
	root.AddCommand(
		newValidateCmd(),
		newRunCmd(g),
		newStatusCmd(g),
		newReportCmd(g),
		newCancelCmd(g),
		newSignalCmd(g, "pause", "Pause a run between steps (running steps finish; nothing new starts)"),
		newSignalCmd(g, "resume", "Resume a paused run"),
		newGraphCmd(),
		newScheduleCmd(g),
		newWorkerCmd(g),
		localConnection(newDevCmd(g)),
		newSchemaCmd(),
		newDoubleCmd(),
		newDemoTrainCmd(),
		newCodecServerCmd(),
		newFakeTrainerCmd(),
	)
	return root
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
