package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/workflow/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
)

// The demo started as the Temporal UI's start form starts it (the raw
// client API, no search_attributes in the input) is found by the README's
// filter, reads Paused while paused, and ends Completed with its last eval
// score as RlflowHeadline.
func TestVisibilityOfARunStartedFromTheUI(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	d := startDouble(t, double.Faults{})
	spec, params, work := demoSpec(t, bin, 2, d.URL)
	require.NotNil(t, spec.Metrics, "rlhf-demo declares its headline metric")

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	t.Cleanup(c.Close)
	queue := "visibility"
	startWorker(t, bin, srv.Address, queue, filepath.Join(work, "logs"), "--data-dir", filepath.Join(work, "data"))

	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "rlhf-demo-ui", TaskQueue: queue},
		workflows.PipelineWorkflow, map[string]any{"spec": spec, "params": params})
	require.NoError(t, err)

	byPipeline := `RlflowPipeline = "rlhf-demo"`
	found := waitListed(ctx, t, c, byPipeline)
	assert.Equal(t, run.GetID(), found.GetExecution().GetWorkflowId())

	require.NoError(t, c.SignalWorkflow(ctx, run.GetID(), "", workflows.SignalPause, nil))
	paused := waitListed(ctx, t, c, byPipeline+` AND RlflowStatus = "Paused"`)
	assert.Equal(t, run.GetID(), paused.GetExecution().GetWorkflowId())
	require.NoError(t, c.SignalWorkflow(ctx, run.GetID(), "", workflows.SignalResume, nil))

	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	require.Len(t, res.Recent, 2)
	lastScore, ok := res.Recent[1].Outputs["eval"]["score"].(float64)
	require.True(t, ok, "eval outputs %v", res.Recent[1].Outputs["eval"])

	done := waitListed(ctx, t, c, byPipeline+` AND RlflowStatus = "Completed"`)
	var headline float64
	p := done.GetSearchAttributes().GetIndexedFields()["RlflowHeadline"]
	require.NotNil(t, p, "RlflowHeadline set")
	require.NoError(t, converter.GetDefaultDataConverter().FromPayload(p, &headline))
	assert.Equal(t, lastScore, headline, "the last iteration's eval score")
	var iteration int64
	require.NoError(t, converter.GetDefaultDataConverter().FromPayload(done.GetSearchAttributes().GetIndexedFields()["RlflowIteration"], &iteration))
	assert.Equal(t, int64(2), iteration)
}

// waitListed polls the visibility store (eventually consistent) until query
// matches exactly one run, and returns it.
func waitListed(ctx context.Context, t *testing.T, c client.Client, query string) *workflow.WorkflowExecutionInfo {
	t.Helper()
	var last string
	for {
		resp, err := c.ListWorkflow(ctx, &workflowservice.ListWorkflowExecutionsRequest{Query: query})
		switch {
		case err != nil:
			last = err.Error()
		case len(resp.GetExecutions()) == 1:
			return resp.GetExecutions()[0]
		default:
			last = fmt.Sprintf("%d runs", len(resp.GetExecutions()))
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no run listed by %s: %s", query, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
