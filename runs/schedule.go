package runs

import (
	"context"
	"fmt"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/workflows"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"
)

// ScheduleOptions describe a Temporal Schedule that starts a pipeline.
type ScheduleOptions struct {
	ID     string
	Spec   *pipelines.Pipeline
	Params map[string]any
	// Cron expressions and/or a fixed interval; at least one is required.
	Cron      []string
	Every     time.Duration
	TaskQueue string
	// AllowOverlap lets a new run start while the previous one still runs;
	// by default it is skipped (two RLHF loops on one server set collide).
	AllowOverlap     bool
	Paused           bool
	SearchAttributes bool
}

// CreateSchedule creates a schedule whose runs use the spec frozen now.
func CreateSchedule(ctx context.Context, c client.Client, o ScheduleOptions) error {
	if len(o.Cron) == 0 && o.Every <= 0 {
		return fmt.Errorf("schedule %s: give --cron or --every", o.ID)
	}
	if o.TaskQueue == "" {
		o.TaskQueue = workflows.DefaultTaskQueue
	}
	spec := client.ScheduleSpec{CronExpressions: o.Cron}
	if o.Every > 0 {
		spec.Intervals = []client.ScheduleIntervalSpec{{Every: o.Every}}
	}
	overlap := enumspb.SCHEDULE_OVERLAP_POLICY_SKIP
	if o.AllowOverlap {
		overlap = enumspb.SCHEDULE_OVERLAP_POLICY_ALLOW_ALL
	}
	_, err := c.ScheduleClient().Create(ctx, client.ScheduleOptions{
		ID:      o.ID,
		Spec:    spec,
		Overlap: overlap,
		Paused:  o.Paused,
		Note:    fmt.Sprintf("rlflow pipeline %s", o.Spec.Name),
		Action: &client.ScheduleWorkflowAction{
			ID:        o.ID + "-run", // Temporal appends the scheduled time
			Workflow:  workflows.PipelineWorkflow,
			TaskQueue: o.TaskQueue,
			Args:      []any{workflows.PipelineInput{Spec: o.Spec, Params: o.Params, SearchAttributes: o.SearchAttributes}},
		},
	})
	if err != nil {
		return fmt.Errorf("creating schedule %s: %w", o.ID, err)
	}
	return nil
}

// ScheduleInfo is one line of `schedule list`.
type ScheduleInfo struct {
	ID      string
	Paused  bool
	Next    time.Time
	Recent  []string // workflow ids of recent runs
	Summary string
}

// ListSchedules lists every schedule in the namespace.
func ListSchedules(ctx context.Context, c client.Client) ([]ScheduleInfo, error) {
	it, err := c.ScheduleClient().List(ctx, client.ScheduleListOptions{PageSize: 100})
	if err != nil {
		return nil, fmt.Errorf("listing schedules: %w", err)
	}
	var out []ScheduleInfo
	for it.HasNext() {
		e, err := it.Next()
		if err != nil {
			return nil, fmt.Errorf("listing schedules: %w", err)
		}
		si := ScheduleInfo{ID: e.ID, Paused: e.Paused, Summary: e.Note}
		if len(e.NextActionTimes) > 0 {
			si.Next = e.NextActionTimes[0]
		}
		for _, r := range e.RecentActions {
			if r.StartWorkflowResult != nil {
				si.Recent = append(si.Recent, r.StartWorkflowResult.WorkflowID)
			}
		}
		out = append(out, si)
	}
	return out, nil
}

// DeleteSchedule deletes a schedule (runs it started go on).
func DeleteSchedule(ctx context.Context, c client.Client, id string) error {
	if err := c.ScheduleClient().GetHandle(ctx, id).Delete(ctx); err != nil {
		return fmt.Errorf("deleting schedule %s: %w", id, err)
	}
	return nil
}

// TriggerSchedule starts a run of the schedule now.
func TriggerSchedule(ctx context.Context, c client.Client, id string) error {
	if err := c.ScheduleClient().GetHandle(ctx, id).Trigger(ctx, client.ScheduleTriggerOptions{
		Overlap: enumspb.SCHEDULE_OVERLAP_POLICY_ALLOW_ALL,
	}); err != nil {
		return fmt.Errorf("triggering schedule %s: %w", id, err)
	}
	return nil
}
