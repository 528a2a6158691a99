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

	"github.com/spf13/cobra"
)

// exitError carries a process exit code through cobra.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }

type globalFlags struct {
	address   string
	namespace string
	taskQueue string
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
	pf := root.PersistentFlags()
	pf.StringVar(&g.address, "address", envOr("TEMPORAL_ADDRESS", "127.0.0.1:7233"), "Temporal frontend host:port (env TEMPORAL_ADDRESS)")
	pf.StringVar(&g.namespace, "namespace", envOr("TEMPORAL_NAMESPACE", "default"), "Temporal namespace (env TEMPORAL_NAMESPACE)")
	pf.StringVar(&g.taskQueue, "task-queue", envOr("RLFLOW_TASK_QUEUE", "rlflow"), "task queue of the control worker (env RLFLOW_TASK_QUEUE)")
	root.AddCommand(
		newValidateCmd(),
		newRunCmd(g),
		newStatusCmd(g),
		newCancelCmd(g),
		newSignalCmd(g, "pause", "Pause a run between steps (running steps finish; nothing new starts)"),
		newSignalCmd(g, "resume", "Resume a paused run"),
		newGraphCmd(),
		newScheduleCmd(g),
		newWorkerCmd(g),
		newDevCmd(g),
		newSchemaCmd(),
		newDoubleCmd(),
		newDemoTrainCmd(),
		newCodecServerCmd(),
	)
	return root
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
