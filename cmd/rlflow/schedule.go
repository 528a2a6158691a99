package main

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/rlflow/rlflow/runs"
	"github.com/spf13/cobra"
	"go.temporal.io/sdk/client"
)

func newScheduleCmd(g *globalFlags) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "schedule",
		Short: "Manage Temporal Schedules that start pipeline runs (visible in the Temporal UI)",
	}
	var params, cron []string
	var every time.Duration
	var allowOverlap, paused bool
	create := &cobra.Command{
		Use:   "create SCHEDULE_ID FILE",
		Short: "Create a schedule; its runs use the spec and params frozen now",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			spec, values, err := loadWithParams(args[1], params)
			if err != nil {
				return &exitError{code: 1, err: err}
			}
			return g.withClient(ctx, func(c client.Client) error {
				sa, _ := runs.EnsureSearchAttributes(ctx, c, g.namespace)
				if err := runs.CreateSchedule(ctx, c, runs.ScheduleOptions{
					ID: args[0], Spec: spec, Params: values, Cron: cron, Every: every, TaskQueue: g.taskQueue,
					AllowOverlap: allowOverlap, Paused: paused, SearchAttributes: sa,
				}); err != nil {
					return &exitError{code: 1, err: err}
				}
				fmt.Fprintf(cmd.OutOrStdout(), "schedule %s created for pipeline %s\n", args[0], spec.Name)
				return nil
			})
		},
	}
	f := create.Flags()
	f.StringArrayVarP(&params, "param", "p", nil, "parameter name=value (repeatable)")
	f.StringArrayVar(&cron, "cron", nil, `cron expression, e.g. "0 3 * * *" (repeatable)`)
	f.DurationVar(&every, "every", 0, "start a run at this interval, e.g. 6h")
	f.BoolVar(&allowOverlap, "allow-overlap", false, "start a run even while the previous one still runs (default: skip)")
	f.BoolVar(&paused, "paused", false, "create the schedule paused")

	list := &cobra.Command{
		Use:   "list",
		Short: "List schedules",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.withClient(cmd.Context(), func(c client.Client) error {
				items, err := runs.ListSchedules(cmd.Context(), c)
				if err != nil {
					return &exitError{code: 1, err: err}
				}
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 2, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tPAUSED\tNEXT\tRECENT RUNS\tNOTE")
				for _, s := range items {
					next := "-"
					if !s.Next.IsZero() {
						next = s.Next.UTC().Format(time.RFC3339)
					}
					fmt.Fprintf(tw, "%s\t%v\t%s\t%s\t%s\n", s.ID, s.Paused, next, strings.Join(s.Recent, ","), s.Summary)
				}
				return tw.Flush()
			})
		},
	}
	del := idCommand(g, "delete SCHEDULE_ID", "Delete a schedule (runs it started go on)",
		func(ctx context.Context, c client.Client, id string) error { return runs.DeleteSchedule(ctx, c, id) },
		"schedule %s deleted")
	trigger := idCommand(g, "trigger SCHEDULE_ID", "Start a run of the schedule now",
		func(ctx context.Context, c client.Client, id string) error { return runs.TriggerSchedule(ctx, c, id) },
		"schedule %s triggered")
	cmd.AddCommand(create, list, del, trigger)
	return cmd
}
