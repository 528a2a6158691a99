package runs

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
)

// status prints a step's outputs whole and rounded, and an error's log
// tail, where the cause is, rather than its first line.
func TestPrintStatusShowsWholeOutputsAndTail(t *testing.T) {
	st := &RunStatus{WorkflowID: "pipe", RunID: "r1", Execution: "Running",
		Progress: workflows.Progress{Pipeline: "demo", Iteration: 2, IterationsDone: 1,
			LastError: "iteration 2: step train (exec) failed: " + execStepError},
		Steps: []StepView{
			{StepResult: workflows.StepResult{ID: "eval", Uses: "evaluate", Status: workflows.StatusSucceeded,
				Outputs: map[string]any{"a_path": longPath, "score": 0.6000000000000001}}},
			{StepResult: workflows.StepResult{ID: "train", Uses: "exec", Status: workflows.StatusFailed, Attempts: 3, Error: execStepError}},
		}}
	var b bytes.Buffer
	PrintStatus(&b, st)
	out := b.String()
	assert.Contains(t, out, "a_path="+longPath+" score=0.6\n", out)
	assert.Contains(t, out, "ValueError: loss is nan", "the log tail:\n%s", out)
	assert.Contains(t, out, "exec: python exited with code 1 (log /runs/r1/1/train.log)\n", out)
	assert.NotContains(t, out, "(type:", out)
	assert.NotContains(t, out, "0.6000000000000001", out)
}

// A failed run's status carries its failure, from its failed step (with
// the attempt) when a worker answers the query, else from Temporal's error.
func TestGetStatusFailedRun(t *testing.T) {
	stepFailed := temporal.NewNonRetryableApplicationError("iteration 1: step train (exec) failed: "+execStepError, "StepFailed", nil)
	for _, tc := range []struct {
		name    string
		noQuery bool
		want    string
	}{
		{"worker answers", false, "iteration 1: step train (exec) failed on attempt 3: exec: python exited with code 1 (log /runs/r1/1/train.log)"},
		{"no worker", true, "iteration 1: step train (exec) failed: exec: python exited with code 1 (log /runs/r1/1/train.log)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeTemporal("pipe")
			c1 := workflows.IterationWorkflowID("pipe", 1)
			f.progress = []workflows.Progress{{Iteration: 1, Child: c1, Status: workflows.StatusFailed}}
			f.child[c1] = workflows.Progress{Iteration: 1, Steps: []workflows.StepResult{
				{ID: "train", Uses: "exec", Status: workflows.StatusFailed, Attempts: 3, Error: execStepError}}}
			f.runErr = fmt.Errorf("workflow execution error: %w", stepFailed)
			f.noQuery = tc.noQuery
			f.once.Do(func() { close(f.finished) })
			st, err := GetStatus(context.Background(), f, "pipe", "")
			require.NoError(t, err)
			assert.Equal(t, "Failed", st.Execution)
			assert.True(t, st.Unsuccessful())
			require.NotNil(t, st.Failure)
			assert.Equal(t, tc.want, st.Failure.Sentence)
			assert.Equal(t, "epoch 1\nTraceback (most recent call last):\nValueError: loss is nan", st.Failure.LogTail)
			var b bytes.Buffer
			PrintStatus(&b, st)
			assert.Contains(t, b.String(), "error:      "+tc.want+"\n  log tail:\n    epoch 1\n", b.String())
		})
	}
}

// status --json lists every finished iteration, not the last one only,
// past the parent's RecentIterations; an unreadable one is named.
func TestFillIterations(t *testing.T) {
	f := newFakeTemporal("pipe")
	done := workflows.RecentIterations + 5
	for n := 1; n <= done; n++ {
		if n != 3 {
			f.iteration[n] = demoIteration(n)
		}
	}
	st := &RunStatus{WorkflowID: "pipe", Progress: workflows.Progress{Iteration: done, IterationsDone: done}}
	FillIterations(context.Background(), f, st, 0)
	require.Len(t, st.Iterations, done-1)
	assert.Equal(t, 1, st.Iterations[0].Iteration)
	assert.Equal(t, 4, st.Iterations[2].Iteration)
	assert.Equal(t, done, st.Iterations[done-2].Iteration)
	assert.Equal(t, 0.6000000000000001, st.Iterations[5].Outputs["eval"]["score"])
	assert.Equal(t, workflows.IterationWorkflowID("pipe", 6), st.Iterations[4].WorkflowID)
	assert.Contains(t, st.IterationsErr, "results of iteration(s) 3 unavailable: ")
	b, err := json.Marshal(st)
	require.NoError(t, err)
	assert.Equal(t, done-1, strings.Count(string(b), `"score":`), "%s", b)

	last := &RunStatus{WorkflowID: "pipe", Progress: workflows.Progress{Iteration: done, IterationsDone: done}}
	FillIterations(context.Background(), f, last, 4)
	require.Len(t, last.Iterations, 4)
	assert.Equal(t, done-3, last.Iterations[0].Iteration)
	assert.Empty(t, last.IterationsErr)
	var p bytes.Buffer
	PrintStatus(&p, last)
	assert.Contains(t, p.String(), fmt.Sprintf("%d         succeeded  eval.a_path=%s eval.score=0.6 train.loss=", done, longPath), p.String())
}
