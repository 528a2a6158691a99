package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
)

// TestHostileSpecInputs starts rlflow.Pipeline (and rlflow.Iteration) the
// way the Temporal UI's start form and a schedule do, with the input as
// JSON rather than rlflow's typed struct, against a worker process that
// holds a secret in its environment and can read a secret file. Each
// hostile input fails the run with a non-retryable BadInput naming the
// problem, before any step: its history schedules no activity but the
// validation one, never fails a workflow task, and holds neither secret.
// Set RLFLOW_RECORD_HISTORY=DIR to write the histories of a validated run
// and a refused one for the replay test.
func TestHostileSpecInputs(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	dir := t.TempDir()
	envSecret, fileSecret := randomSecret(t, "sk-env-"), randomSecret(t, "sk-file-")
	secretFile := filepath.Join(dir, "trainer.env")
	require.NoError(t, os.WriteFile(secretFile, []byte("HF_TOKEN="+fileSecret+"\n"), 0o600))
	pwned := filepath.Join(dir, "pwned")
	// The worker inherits the test's environment.
	t.Setenv("RLFLOW_HOSTILE_SPEC_TOKEN", envSecret)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "hostile-spec"
	startWorker(t, bin, srv.Address, queue, filepath.Join(dir, "logs"))

	// spec writes a pipeline as the UI's form holds it: raw JSON.
	spec := func(steps string, extra ...string) json.RawMessage {
		return json.RawMessage(`{"version": 1, "name": "hostile", "base_dir": "` + dir + `",` + strings.Join(extra, "") + ` "steps": [` + steps + `]}`)
	}
	touch := `{"id": "pwn", "uses": "exec", "with": {"command": ["sh", "-c", "cat ` + secretFile + ` > ` + pwned + `"]}}`
	valid := spec(`{"id": "ok", "uses": "noop"}`)

	// The control: a valid spec from the form runs.
	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "hostile-spec-control", TaskQueue: queue}, workflows.PipelineWorkflow, map[string]any{"spec": valid})
	require.NoError(t, err)
	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	assert.Equal(t, 1, res.Iterations)
	events := history(ctx, t, c, run.GetID())
	assert.Equal(t, []string{workflows.ValidateSpecActivity}, scheduledActivities(events), "the steps run in the iteration's history")
	assert.Contains(t, historyWithPayloads(t, events), `"uses":"noop"`, "the payloads are searched decoded")
	recordHistory(t, "history_pipeline_validated.json", events)

	big := strings.Repeat("x", pipelines.MaxSpecBytes+64<<10)
	for _, tc := range []struct {
		name     string
		workflow string
		input    any
		want     []string
		// validated: the spec reached the worker's loader (else the
		// input's own check refused it with no activity at all).
		validated string
	}{
		{name: "empty spec", input: map[string]any{"spec": json.RawMessage(`{}`)}, validated: workflows.ValidateSpecActivity,
			want: []string{"spec:1:1: base_dir: is required", "spec:1:1: name: is required", "spec:1:1: steps: is required", "spec:1:1: version: is required"}},
		{name: "self-cycle", input: map[string]any{"spec": spec(touch + `, {"id": "a", "uses": "noop", "needs": ["a"]}`)}, validated: workflows.ValidateSpecActivity,
			want: []string{"steps[1].needs[0]: a step cannot need itself"}},
		{name: "missing need", input: map[string]any{"spec": spec(touch + `, {"id": "a", "uses": "noop", "needs": ["ghost"]}`)}, validated: workflows.ValidateSpecActivity,
			want: []string{`steps[1].needs[0]: unknown step "ghost"`}},
		{name: "unknown field at top level", input: map[string]any{"spec": valid, "run_as": "root"},
			want: []string{`"run_as": unknown field; the input takes spec, spec_path, params, search_attributes`}},
		{name: "unknown field in the spec", input: map[string]any{"spec": spec(touch, `"hooks": {"pre": "id"},`)}, validated: workflows.ValidateSpecActivity,
			want: []string{`hooks: unknown key "hooks"`}},
		{name: "unknown field in a step", input: map[string]any{"spec": spec(`{"id": "a", "uses": "noop", "shell": "cat ` + secretFile + `"}`)}, validated: workflows.ValidateSpecActivity,
			want: []string{`steps[0].shell: unknown key "shell"`}},
		{name: "spec as a string", input: map[string]any{"spec": "version: 1\nname: x"},
			want: []string{"spec: must be the pipeline as a JSON object", "got a string"}},
		{name: "steps as an object", input: map[string]any{"spec": json.RawMessage(`{"version": 1, "name": "h", "base_dir": "/tmp", "steps": {"pwn": {"uses": "exec"}}}`)},
			validated: workflows.ValidateSpecActivity, want: []string{"steps: must be a list, got a mapping"}},
		{name: "params as a list", input: map[string]any{"spec": valid, "params": []any{"n=1"}},
			want: []string{"params: must be a JSON object from param name to value, got a list"}},
		{name: "oversized spec", input: map[string]any{"spec": spec(touch, `"description": "`+big+`",`)}, validated: workflows.ValidateSpecActivity,
			want: []string{"description: the pipeline is", "over the limit of 1.5 MiB"}},
		{name: "exec step validation refuses", input: map[string]any{"spec": spec(`{"id": "pwn", "uses": "exec", "with": {"command": "cat ` + secretFile + `", "secrets": ["${{ params.which }}"]}}`)},
			validated: workflows.ValidateSpecActivity, want: []string{"steps[0].with.command: must be a list of strings"}},
		{name: "both spec and spec_path", input: map[string]any{"spec": valid, "spec_path": secretFile},
			want: []string{"give spec or spec_path, not both"}},
		{name: "neither spec nor spec_path", input: map[string]any{"params": map[string]any{"n": 1}},
			want: []string{"give spec (the pipeline as JSON) or spec_path"}},
		{name: "carried fields on a new run", input: map[string]any{"spec": valid, "next_iteration": 2,
			"weights": map[string]any{"version": "v1", "checkpoint": secretFile}},
			want: []string{"next_iteration: is carried by rlflow", "weights: is carried by rlflow"}},
		{name: "a field twice", input: json.RawMessage(`{"spec_path": "/data/p.yaml", "spec": ` + string(valid) + `, "spec_path": "` + secretFile + `"}`),
			want: []string{`"spec_path": given twice`}},
		{name: "input not an object", input: secretFile, want: []string{"the input must be a JSON object with spec or spec_path"}},
		{name: "no input", input: nil, want: []string{"the input is empty"}},
		// The worker's path rules and the loader's masking decide its message.
		{name: "spec_path to a secret file", input: map[string]any{"spec_path": secretFile}, validated: workflows.LoadPipelineActivity},
		{name: "param of the wrong type", input: map[string]any{"spec": spec(touch, `"params": {"n": {"type": "int"}},`), "params": map[string]any{"n": "$RLFLOW_HOSTILE_SPEC_TOKEN"}},
			validated: workflows.ValidateSpecActivity, want: []string{`params: param "n": must be an integer`}},
		{name: "direct start of rlflow.Iteration", workflow: workflows.IterationWorkflow,
			input: map[string]any{"spec": json.RawMessage(`{"version": 1, "name": "h", "base_dir": "/", "steps": [` + touch + `]}`), "iteration": 1, "run_id": "x"},
			want:  []string{"rlflow.Iteration runs only as a child of rlflow.Pipeline; start rlflow.Pipeline"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wf := tc.workflow
			if wf == "" {
				wf = workflows.PipelineWorkflow
			}
			id := "hostile-spec-" + strings.ReplaceAll(tc.name, " ", "-")
			run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: id, TaskQueue: queue, WorkflowExecutionTimeout: 2 * time.Minute}, wf, tc.input)
			require.NoError(t, err)
			checkRefused(ctx, t, c, run, tc.want, tc.validated, envSecret, fileSecret)
			if tc.name == "self-cycle" {
				recordHistory(t, "history_pipeline_refused.json", history(ctx, t, c, id))
			}
		})
	}

	// A schedule starts the run with its own input: the same checks.
	t.Run("schedule-started run", func(t *testing.T) {
		id := "hostile-spec-schedule"
		h, err := c.ScheduleClient().Create(ctx, client.ScheduleOptions{
			ID:                 id,
			Spec:               client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: 24 * time.Hour}}},
			TriggerImmediately: true,
			Action: &client.ScheduleWorkflowAction{ID: id + "-run", Workflow: workflows.PipelineWorkflow, TaskQueue: queue,
				Args: []any{map[string]any{"spec": spec(touch + `, {"id": "a", "uses": "noop", "needs": ["a"]}`)}}},
		})
		require.NoError(t, err)
		defer func() { _ = h.Delete(context.Background()) }()
		var started string
		testutil.Eventually(t, time.Minute, "the schedule to start its run", func() bool {
			d, err := h.Describe(ctx)
			if err != nil || len(d.Info.RecentActions) == 0 || d.Info.RecentActions[0].StartWorkflowResult == nil {
				return false
			}
			started = d.Info.RecentActions[0].StartWorkflowResult.WorkflowID
			return true
		})
		checkRefused(ctx, t, c, c.GetWorkflow(ctx, started, ""), []string{"steps[1].needs[0]: a step cannot need itself"},
			workflows.ValidateSpecActivity, envSecret, fileSecret)
	})

	_, err = os.Stat(pwned)
	assert.True(t, os.IsNotExist(err), "a refused exec step ran")
}

// checkRefused waits for run to fail and checks how: a non-retryable
// BadInput with every want in its message, the validation activity (if
// any) the only one scheduled, no iteration started (steps run in
// iterations), no workflow task failed, and no secret anywhere in its
// history.
func checkRefused(ctx context.Context, t *testing.T, c client.Client, run client.WorkflowRun, want []string, validated string, secrets ...string) {
	t.Helper()
	err := run.Get(ctx, nil)
	require.Error(t, err, "the run succeeded")
	var app *temporal.ApplicationError
	require.True(t, errors.As(err, &app), "%v", err)
	assert.Equal(t, pipelines.ErrTypeBadInput, app.Type(), "%v", err)
	assert.True(t, app.NonRetryable(), "%v", err)
	for _, w := range want {
		assert.Contains(t, app.Message(), w)
	}
	events := history(ctx, t, c, run.GetID())
	var wantActs []string
	if validated != "" {
		wantActs = []string{validated}
	}
	assert.Equal(t, wantActs, scheduledActivities(events), "nothing but the validation ran")
	for _, ev := range events {
		assert.NotEqual(t, enumspb.EVENT_TYPE_WORKFLOW_TASK_FAILED, ev.GetEventType(), "a workflow task failed: %v", ev)
		assert.NotEqual(t, enumspb.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED, ev.GetEventType(), "an iteration started")
	}
	text := historyWithPayloads(t, events)
	for _, s := range secrets {
		assert.NotContains(t, text, s, "the history holds a planted secret")
		assert.NotContains(t, app.Message(), s)
	}
}

// recordHistory writes a history for the replay test of package workflows
// when RLFLOW_RECORD_HISTORY names a directory.
func recordHistory(t *testing.T, name string, events []*historypb.HistoryEvent) {
	t.Helper()
	dir := os.Getenv("RLFLOW_RECORD_HISTORY")
	if dir == "" {
		return
	}
	b, err := protojson.Marshal(&historypb.History{Events: events})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, name), b, 0o644))
	t.Logf("recorded %s", filepath.Join(dir, name))
}

// scheduledActivities lists the activity types a history scheduled.
func scheduledActivities(events []*historypb.HistoryEvent) []string {
	var out []string
	for _, ev := range events {
		if a := ev.GetActivityTaskScheduledEventAttributes(); a != nil {
			out = append(out, a.GetActivityType().GetName())
		}
	}
	return out
}

var payloadDataRe = regexp.MustCompile(`"data":\s*"([A-Za-z0-9+/=_-]*)"`)

// historyWithPayloads is a history as protojson writes it, followed by
// every payload's data decoded (protojson writes them in base64).
func historyWithPayloads(t *testing.T, events []*historypb.HistoryEvent) string {
	t.Helper()
	b, err := protojson.Marshal(&historypb.History{Events: events})
	require.NoError(t, err)
	var sb strings.Builder
	sb.Write(b)
	for _, m := range payloadDataRe.FindAllSubmatch(b, -1) {
		data, err := base64.StdEncoding.DecodeString(string(m[1]))
		if err != nil {
			data, err = base64.URLEncoding.DecodeString(string(m[1]))
		}
		require.NoError(t, err, "payload data %.40s", m[1])
		sb.WriteByte('\n')
		sb.Write(data)
	}
	return sb.String()
}
