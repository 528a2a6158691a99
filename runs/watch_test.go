package runs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
)

// longPath pushes a step's outputs past any fixed line width before the
// score (keys print in name order: a_path < score).
var longPath = "/data/" + strings.Repeat("rollouts/", 14) + "iteration.jsonl"

func demoIteration(n int) workflows.IterationResult {
	return workflows.IterationResult{Iteration: n, Steps: []workflows.StepResult{
		{ID: "train", Uses: "exec", Status: workflows.StatusSucceeded, Outputs: map[string]any{"loss": 0.30000000000000004 / float64(n), "reward": 1.5, "log": "/logs/train.log"}},
		{ID: "eval", Uses: "evaluate", Status: workflows.StatusSucceeded, Outputs: map[string]any{"a_path": longPath, "score": 0.6000000000000001}},
	}}
}

// syncBuffer is a bytes.Buffer safe for Watch's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Iterations that pass between two polls still get their header, before
// their steps and in order; outputs are whole and rounded; an until loop
// that stops before max_iterations ends its bar full.
func TestWatchPrintsEveryIteration(t *testing.T) {
	f := newFakeTemporal("pipe")
	f.pollers = 1
	child := func(n int) string { return workflows.IterationWorkflowID("pipe", n) }
	f.progress = []workflows.Progress{
		{Iteration: 1, IterationsDone: 0, Child: child(1), Status: workflows.StatusRunning},
		// Iterations 2 and 3 ran between two polls.
		{Iteration: 4, IterationsDone: 3, Child: child(4), Status: workflows.StatusRunning},
		{Iteration: 5, IterationsDone: 5, Child: child(5), Status: workflows.StatusSucceeded},
	}
	for n := 1; n <= 5; n++ {
		f.iteration[n] = demoIteration(n)
		f.child[child(n)] = workflows.Progress{Iteration: n, Steps: demoIteration(n).Steps}
	}
	f.result = workflows.PipelineResult{Iterations: 5, StoppedBy: "until"}
	var out, bar syncBuffer
	var seen []int
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := Watch(ctx, f, fakeRun{f: f}, WatchOptions{Out: &out, Bar: &bar, Total: 10, Interval: time.Millisecond,
		OnIteration: func(ir workflows.IterationResult) { seen = append(seen, ir.Iteration) }})
	require.NoError(t, err)
	assert.Equal(t, 5, res.Iterations)
	assert.Equal(t, []int{1, 2, 3, 4, 5}, seen)

	text := out.String()
	headers := regexp.MustCompile(`(?m)^iteration (\d+)`).FindAllStringSubmatch(text, -1)
	var got []string
	for _, h := range headers {
		got = append(got, h[1])
	}
	assert.Equal(t, []string{"1", "2", "3", "4", "5"}, got, "every header once, in order:\n%s", text)
	// Each iteration's step lines sit under its own header.
	for n := 1; n <= 5; n++ {
		section := text[strings.Index(text, fmt.Sprintf("iteration %d ", n)):]
		if next := strings.Index(section, fmt.Sprintf("iteration %d ", n+1)); next >= 0 {
			section = section[:next]
		}
		loss := FormatValue(0.30000000000000004 / float64(n))
		assert.Contains(t, section, "loss="+loss+" reward=1.5", "iteration %d:\n%s", n, text)
		assert.Contains(t, section, "a_path="+longPath+" score=0.6", "iteration %d: outputs whole:\n%s", n, text)
	}
	assert.NotContains(t, text, "0.6000000000000001")
	assert.NotContains(t, text, "...")

	frames := strings.Split(bar.String(), "\r")
	last := frames[len(frames)-1]
	assert.Contains(t, last, "100%", "the bar's last frame: %q", last)
	assert.Contains(t, last, "(5/5", "the bar counts what ran: %q", last)
}

// A failed run's error is one sentence with the attempt, then the step's
// log tail; no SDK type names.
func TestWatchFailedRunError(t *testing.T) {
	f := newFakeTemporal("pipe")
	f.pollers = 1
	c1 := workflows.IterationWorkflowID("pipe", 1)
	f.progress = []workflows.Progress{{Iteration: 1, Child: c1, Status: workflows.StatusFailed}}
	failed := workflows.StepResult{ID: "train", Uses: "exec", Status: workflows.StatusFailed, Attempts: 3, Error: execStepError}
	f.child[c1] = workflows.Progress{Iteration: 1, Steps: []workflows.StepResult{failed}}
	f.runErr = fmt.Errorf("workflow execution error (type: RunPipeline): %w",
		temporal.NewNonRetryableApplicationError("iteration 1: step train (exec) failed: "+execStepError, "StepFailed", nil))
	var out syncBuffer
	_, err := Watch(context.Background(), f, fakeRun{f: f}, WatchOptions{Out: &out, Interval: time.Millisecond})
	var re *RunError
	require.True(t, errors.As(err, &re), "%T: %v", err, err)
	assert.Equal(t, "run pipe: iteration 1: step train (exec) failed on attempt 3: exec: python exited with code 1 (log /runs/r1/1/train.log)\n"+
		"  log tail:\n    epoch 1\n    Traceback (most recent call last):\n    ValueError: loss is nan", err.Error())
	assert.Contains(t, out.String(), "train          exec       failed  exec: python exited with code 1 (log /runs/r1/1/train.log)\n")
}

// With no worker on the run's task queue, Watch says so once and keeps
// waiting.
func TestWatchReportsNoWorker(t *testing.T) {
	f := newFakeTemporal("pipe")
	f.queue = "gpu-box"
	f.noQuery = true
	var out syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := Watch(ctx, f, fakeRun{f: f}, WatchOptions{Out: &out, Interval: time.Millisecond, NoWorkerAfter: 5 * time.Millisecond})
		errc <- err
	}()
	want := "no worker is polling task queue gpu-box; start one with `rlflow worker --task-queue gpu-box`\n"
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), want) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case err := <-errc:
		t.Fatalf("Watch returned while the run is open: %v", err)
	default:
	}
	cancel()
	assert.ErrorIs(t, <-errc, context.Canceled)
	assert.Equal(t, 1, strings.Count(out.String(), "no worker"), "said once:\n%s", out.String())
}

// A worker on the queue: nothing is said.
func TestWatchQuietWithWorker(t *testing.T) {
	f := newFakeTemporal("pipe")
	f.pollers = 1
	f.noQuery = true
	var out syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := Watch(ctx, f, fakeRun{f: f}, WatchOptions{Out: &out, Interval: time.Millisecond, NoWorkerAfter: time.Millisecond})
		errc <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for f.queueDescribed.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	require.NotZero(t, f.queueDescribed.Load(), "the task queue was never described")
	cancel()
	<-errc
	assert.NotContains(t, out.String(), "no worker")
}
