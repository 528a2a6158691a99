package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker"
	"github.com/spf13/cobra"
)

func newWorkerCmd(g *globalFlags) *cobra.Command {
	var logDir, dataDir string
	var maxActivities int
	var gf gpuFlags
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
--advertise is the address the servers reach it at for the NCCL rendezvous.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if gf.enabled {
				return runGPUWorker(ctx, g, gf)
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
			c, err := runs.Connect(ctx, g.address, g.namespace)
			if err != nil {
				return err
			}
			defer c.Close()
			w, err := worker.NewControl(c, worker.Options{
				TaskQueue: g.taskQueue, Deps: activities.Deps{LogDir: abs, DataDir: data}, MaxConcurrentActivities: maxActivities,
			})
			if err != nil {
				return err
			}
			if err := w.Start(); err != nil {
				return fmt.Errorf("starting worker: %w", err)
			}
			slog.New(slog.NewTextHandler(os.Stderr, nil)).Info("rlflow worker running",
				"address", g.address, "namespace", g.namespace, "task_queue", g.taskQueue, "log_dir", abs, "data_dir", data, "pid", os.Getpid())
			<-ctx.Done()
			w.Stop()
			return nil
		},
	}
	cmd.Flags().StringVar(&logDir, "log-dir", envOr("RLFLOW_LOG_DIR", ".rlflow/logs"), "directory for per-attempt step logs (env RLFLOW_LOG_DIR)")
	cmd.Flags().StringVar(&dataDir, "data-dir", envOr("RLFLOW_DATA_DIR", ".rlflow/data"), "directory for generate and evaluate output files that steps do not place (env RLFLOW_DATA_DIR)")
	cmd.Flags().IntVar(&maxActivities, "max-concurrent-steps", 0, "steps this worker runs at once (0 = Temporal's default)")
	gf.register(cmd)
	return cmd
}
