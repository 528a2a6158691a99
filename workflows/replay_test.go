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
// the dev server. A change to the interpreter that would break running
// workflows fails here; such a change belongs behind workflow.GetVersion.
//
//   - *_until: pipelines/examples/until.yaml, 4 iterations stopped by until,
//     recorded before the GPU routing existed. Re-record with:
//     temporal workflow show -w ID --output json > testdata/...json
//   - *_nccl_pre_routing: an nccl pipeline (noop -> broadcast, 2 iterations)
//     run by the interpreter of commit 78ab4f7, before the GPU routing, with
//     broadcast on the control queue: the gpu-routing GetVersion must keep
//     such runs on their old path.
//   - *_gpu*: e2e TestGPURoutingOnDevServer (nccl routing, gpu-routing
//     version 1): iteration 1 loses its GPU worker mid-step (heartbeat
//     timeout), iteration 2 finds its carried-over worker gone (ScheduleToStart
//     timeout); both re-acquire. Re-record with:
//     RLFLOW_RECORD_HISTORY=DIR go test ./e2e/ -run TestGPURoutingOnDevServer
//     (then indent the JSON and update gpuRunID).
//   - *_validated, *_refused: e2e TestHostileSpecInputs (input validation,
//     validate-input version 1): an inline spec validated on the worker
//     then run, and one refused (a self-cycle). Re-record with:
//     RLFLOW_RECORD_HISTORY=DIR go test ./e2e/ -run TestHostileSpecInputs
func TestReplayCheckedInHistories(t *testing.T) {
	const runID = "until-threshold-20261202T142329-b136cd"
	const gpuRunID = "gpu-routing-20261202T163032-374ee4"
	const preRunID = "pre-routing-nccl"
	for file, id := range map[string]string{
		"testdata/history_pipeline_until.json":               runID,
		"testdata/history_iteration_until.json":              runID + "/iter-2",
		"testdata/history_pipeline_nccl_pre_routing.json":    preRunID,
		"testdata/history_iteration_nccl_pre_routing.json":   preRunID + "/iter-2",
		"testdata/history_pipeline_gpu.json":                 gpuRunID,
		"testdata/history_iteration_gpu_heartbeat_lost.json": gpuRunID + "/iter-1",
		"testdata/history_iteration_gpu_schedule_lost.json":  gpuRunID + "/iter-2",
		"testdata/history_pipeline_validated.json":           "hostile-spec-control",
		"testdata/history_pipeline_refused.json":             "hostile-spec-self-cycle",
	} {
		t.Run(file, func(t *testing.T) {
			f, err := os.Open(file)
			require.NoError(t, err)
			defer f.Close()
			hist, err := client.HistoryFromJSON(f, client.HistoryJSONOptions{})
			require.NoError(t, err)
			r := worker.NewWorkflowReplayer()
			r.RegisterWorkflowWithOptions(RunPipeline, workflow.RegisterOptions{Name: PipelineWorkflow})
			r.RegisterWorkflowWithOptions(RunIteration, workflow.RegisterOptions{Name: IterationWorkflow})
			// Child ids derive from the workflow id, so replay under the original one.
			require.NoError(t, r.ReplayWorkflowHistoryWithOptions(nil, hist, worker.ReplayWorkflowHistoryOptions{
				OriginalExecution: workflow.Execution{ID: id},
			}))
		})
	}
}
