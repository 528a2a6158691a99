package workflows

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"
)

// TestReplayCheckedInHistories replays histories recorded from real runs on
// the dev server (pipelines/examples/until.yaml: 4 iterations stopped by
// until). A change to the interpreter that would break running workflows
// fails here; such a change belongs behind workflow.GetVersion. Re-record
// with: temporal workflow show -w ID --output json > testdata/...json
func TestReplayCheckedInHistories(t *testing.T) {
	const runID = "until-threshold-20261202T142329-b136cd"
	for file, id := range map[string]string{
		"testdata/history_pipeline_until.json":  runID,
		"testdata/history_iteration_until.json": runID + "/iter-2",
	} {
		t.Run(file, func(t *testing.T) {
			f, err := os.Open(file)
			require.NoError(t, err)
			defer f.Close()
			hist, err := client.HistoryFromJSON(f, client.HistoryJSONOptions{})
			require.NoError(t, err)
			r := worker.NewWorkflowReplayer()
			r.RegisterWorkflowWithOptions(Pipeline, workflow.RegisterOptions{Name: PipelineWorkflow})
			r.RegisterWorkflowWithOptions(Iteration, workflow.RegisterOptions{Name: IterationWorkflow})
			// Child ids derive from the workflow id, so replay under the original one.
			require.NoError(t, r.ReplayWorkflowHistoryWithOptions(nil, hist, worker.ReplayWorkflowHistoryOptions{
				OriginalExecution: workflow.Execution{ID: id},
			}))
		})
	}
}
