package runs

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/rlflow/rlflow/workflows"
	enumspb "go.temporal.io/api/enums/v1"
	taskqueuepb "go.temporal.io/api/taskqueue/v1"
	workflowpb "go.temporal.io/api/workflow/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
)

// fakeTemporal is a test double of the Temporal client for one pipeline
// run: each query of the run's progress returns the next of progress (the
// last one repeats), the run's Get returns result or runErr once every
// progress was seen, and each iteration workflow answers with
// iterations[n]. Methods it does not model are the nil embedded
// client's: calling one panics, a test bug.
type fakeTemporal struct {
	client.Client
	id        string
	queue     string
	pollers   int
	progress  []workflows.Progress
	child     map[string]workflows.Progress
	iteration map[int]workflows.IterationResult
	result    workflows.PipelineResult
	runErr    error
	// noQuery makes every query fail, as when no worker answers.
	noQuery bool
	// queueDescribed counts DescribeTaskQueue calls.
	queueDescribed atomic.Int32

	mu       sync.Mutex
	next     int
	finished chan struct{}
	once     sync.Once
}

func newFakeTemporal(id string) *fakeTemporal {
	return &fakeTemporal{id: id, queue: "q", child: map[string]workflows.Progress{}, iteration: map[int]workflows.IterationResult{}, finished: make(chan struct{})}
}

func (f *fakeTemporal) closed() bool {
	select {
	case <-f.finished:
		return true
	default:
		return false
	}
}

func (f *fakeTemporal) DescribeWorkflow(_ context.Context, id, _ string) (*client.WorkflowExecutionDescription, error) {
	status := enumspb.WORKFLOW_EXECUTION_STATUS_RUNNING
	if id == f.id && f.closed() {
		status = enumspb.WORKFLOW_EXECUTION_STATUS_COMPLETED
		if f.runErr != nil {
			status = enumspb.WORKFLOW_EXECUTION_STATUS_FAILED
		}
	}
	return &client.WorkflowExecutionDescription{RawResponse: &workflowservice.DescribeWorkflowExecutionResponse{
		ExecutionConfig: &workflowpb.WorkflowExecutionConfig{TaskQueue: &taskqueuepb.TaskQueue{Name: f.queue}},
		WorkflowExecutionInfo: &workflowpb.WorkflowExecutionInfo{
			Status: status, TaskQueue: f.queue,
		},
	}}, nil
}

func (f *fakeTemporal) DescribeTaskQueue(_ context.Context, queue string, _ enumspb.TaskQueueType) (*workflowservice.DescribeTaskQueueResponse, error) {
	f.queueDescribed.Add(1)
	var ps []*taskqueuepb.PollerInfo
	for i := 0; i < f.pollers; i++ {
		ps = append(ps, &taskqueuepb.PollerInfo{Identity: fmt.Sprintf("worker-%d@%s", i, queue)})
	}
	return &workflowservice.DescribeTaskQueueResponse{Pollers: ps}, nil
}

func (f *fakeTemporal) QueryWorkflow(_ context.Context, id, _ string, _ string, _ ...any) (converter.EncodedValue, error) {
	if f.noQuery {
		return nil, fmt.Errorf("context deadline exceeded")
	}
	if p, ok := f.child[id]; ok {
		return jsonValue{p}, nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.progress) == 0 {
		return jsonValue{workflows.Progress{}}, nil
	}
	p := f.progress[min(f.next, len(f.progress)-1)]
	f.next++
	if f.next >= len(f.progress) {
		f.once.Do(func() { close(f.finished) })
	}
	return jsonValue{p}, nil
}

func (f *fakeTemporal) GetWorkflow(_ context.Context, id, runID string) client.WorkflowRun {
	if id == f.id {
		return fakeRun{f: f}
	}
	for n, ir := range f.iteration {
		if workflows.IterationWorkflowID(f.id, n) == id {
			return doneRun{id: id, value: ir}
		}
	}
	return doneRun{id: id, err: fmt.Errorf("workflow %s not found", id)}
}

// fakeRun is the pipeline run of a fakeTemporal.
type fakeRun struct{ f *fakeTemporal }

func (r fakeRun) GetID() string                  { return r.f.id }
func (r fakeRun) GetRunID() string               { return "run-" + r.f.id }
func (r fakeRun) GetFirstExecutionRunID() string { return r.GetRunID() }
func (r fakeRun) Get(ctx context.Context, v any) error {
	select {
	case <-r.f.finished:
	case <-ctx.Done():
		return ctx.Err()
	}
	if r.f.runErr != nil {
		return r.f.runErr
	}
	if v == nil {
		return nil
	}
	return jsonValue{r.f.result}.Get(v)
}
func (r fakeRun) GetWithOptions(ctx context.Context, v any, _ client.WorkflowRunGetOptions) error {
	return r.Get(ctx, v)
}

// doneRun is a closed workflow: its result or its error.
type doneRun struct {
	id    string
	value any
	err   error
}

func (r doneRun) GetID() string                  { return r.id }
func (r doneRun) GetRunID() string               { return "run-" + r.id }
func (r doneRun) GetFirstExecutionRunID() string { return r.GetRunID() }
func (r doneRun) Get(_ context.Context, v any) error {
	if r.err != nil {
		return r.err
	}
	return jsonValue{r.value}.Get(v)
}
func (r doneRun) GetWithOptions(ctx context.Context, v any, _ client.WorkflowRunGetOptions) error {
	return r.Get(ctx, v)
}

// jsonValue is an EncodedValue that round-trips through JSON, as
// Temporal's default converter does.
type jsonValue struct{ v any }

func (j jsonValue) HasValue() bool { return j.v != nil }
func (j jsonValue) Get(ptr any) error {
	b, err := json.Marshal(j.v)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, ptr)
}
