package activities

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/serviceerror"
	workflowpb "go.temporal.io/api/workflow/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"google.golang.org/grpc"
)

// fakeServer plays the Temporal server for Reports: down until up, the
// activity pending until completed.
type fakeServer struct {
	mu        sync.Mutex
	up        bool
	pending   bool
	runGone   bool
	completed []json.RawMessage
}

func (f *fakeServer) DescribeWorkflow(ctx context.Context, workflowID, runID string) (*client.WorkflowExecutionDescription, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case !f.up:
		return nil, serviceerror.NewUnavailable("connection refused")
	case f.runGone:
		return nil, serviceerror.NewNotFound("workflow not found")
	}
	resp := &workflowservice.DescribeWorkflowExecutionResponse{}
	if f.pending {
		resp.PendingActivities = []*workflowpb.PendingActivityInfo{{ActivityId: "train", Attempt: 1}}
	}
	return &client.WorkflowExecutionDescription{RawResponse: resp}, nil
}

func (f *fakeServer) CompleteActivityByID(ctx context.Context, namespace, workflowID, runID, activityID string, result any, err error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.up {
		return serviceerror.NewUnavailable("connection refused")
	}
	f.completed = append(f.completed, result.(json.RawMessage))
	f.pending = false
	return nil
}

func (f *fakeServer) set(up, pending bool) {
	f.mu.Lock()
	f.up, f.pending = up, pending
	f.mu.Unlock()
}

func (f *fakeServer) done() []json.RawMessage {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]json.RawMessage(nil), f.completed...)
}

func keptInfo(attempt int32, token string) activity.Info {
	info := activity.Info{Namespace: "default", ActivityID: "train", Attempt: attempt, TaskToken: []byte(token)}
	info.WorkflowExecution.ID, info.WorkflowExecution.RunID = "run-1/iter-1", "r1"
	info.ActivityType.Name = "exec"
	return info
}

// report plays the SDK's completion report of token through Watch.
func report(r *Reports, token string, err error) {
	req := &workflowservice.RespondActivityTaskCompletedRequest{TaskToken: []byte(token)}
	_ = r.Watch(context.Background(), respondCompleted, req, nil, nil,
		func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return err })
}

func keptFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(dir, keptPrefix+"*.json"))
	return m
}

func newTestReports(t *testing.T, srv *fakeServer) (*Reports, *Activities, *[]KeptEvent) {
	t.Helper()
	a := New(Deps{LogDir: t.TempDir()})
	r := NewReports()
	r.settle = 50 * time.Millisecond
	var mu sync.Mutex
	events := &[]KeptEvent{}
	r.Bind(srv, a, func(e KeptEvent) { mu.Lock(); *events = append(*events, e); mu.Unlock() })
	t.Cleanup(r.Close)
	return r, a, events
}

func TestKeptResultReportedOnceTheServerIsBack(t *testing.T) {
	srv := &fakeServer{}
	r, a, _ := newTestReports(t, srv)
	result := map[string]any{"exit_code": 0, "values": map[string]any{"checkpoint": "/ckpt/1"}}
	r.keep(keptInfo(1, "tok-1"), result)

	// The report fails: the result is written beside the attempt records.
	report(r, "tok-1", serviceerror.NewUnavailable("connection refused"))
	require.Eventually(t, func() bool { return len(keptFiles(t, a.attemptsDir())) == 1 }, 5*time.Second, 10*time.Millisecond)
	time.Sleep(200 * time.Millisecond)
	assert.Empty(t, srv.done(), "nothing reaches a server that is down")

	// A worker restarted now would report it too: the file is one.
	k, err := readKept(keptFiles(t, a.attemptsDir())[0])
	require.NoError(t, err)
	assert.Equal(t, 1, k.Attempt)

	// The server is back and still waits for the activity: the kept
	// result completes it, and the file goes.
	srv.set(true, true)
	require.Eventually(t, func() bool { return len(srv.done()) == 1 }, 10*time.Second, 10*time.Millisecond)
	assert.JSONEq(t, `{"exit_code":0,"values":{"checkpoint":"/ckpt/1"}}`, string(srv.done()[0]))
	require.Eventually(t, func() bool { return len(keptFiles(t, a.attemptsDir())) == 0 }, 5*time.Second, 10*time.Millisecond)
}

func TestKeptResultAcknowledgedIsForgotten(t *testing.T) {
	srv := &fakeServer{up: true, pending: true}
	r, a, _ := newTestReports(t, srv)
	r.keep(keptInfo(1, "tok-1"), map[string]any{"x": 1})
	report(r, "tok-1", nil)
	r.mu.Lock()
	n := len(r.byToken)
	r.mu.Unlock()
	assert.Zero(t, n)
	time.Sleep(150 * time.Millisecond)
	assert.Empty(t, srv.done(), "an acknowledged result is not reported again")
	assert.Empty(t, keptFiles(t, a.attemptsDir()))
	assert.Nil(t, r.taken(keptInfo(2, "tok-2")), "nothing is handed to a later attempt")
}

func TestKeptResultGoesToALaterAttempt(t *testing.T) {
	srv := &fakeServer{} // down throughout
	r, a, events := newTestReports(t, srv)
	r.keep(keptInfo(1, "tok-1"), map[string]any{"attempt": 1})
	report(r, "tok-1", errors.New("rpc error: code = Unavailable"))
	require.Eventually(t, func() bool { return len(keptFiles(t, a.attemptsDir())) == 1 }, 5*time.Second, 10*time.Millisecond)

	assert.Nil(t, r.taken(keptInfo(1, "tok-1b")), "the same attempt number is not a later attempt")
	other := keptInfo(2, "tok-x")
	other.ActivityID = "eval"
	assert.Nil(t, r.taken(other), "another step's attempt gets nothing")
	k := r.taken(keptInfo(2, "tok-2"))
	require.NotNil(t, k)
	assert.JSONEq(t, `{"attempt":1}`, string(k.Result))
	// The later attempt's own report, acknowledged, clears it everywhere.
	report(r, "tok-2", nil)
	assert.Empty(t, keptFiles(t, a.attemptsDir()))

	// From disk, for a worker that did not keep it itself (restarted).
	r2 := NewReports()
	t.Cleanup(r2.Close)
	r2.Bind(srv, a, nil)
	require.NoError(t, writeFileSync(filepath.Join(a.attemptsDir(), keptFileName(&keptResult{Namespace: "default", WorkflowID: "run-1/iter-1", WorkflowRunID: "r1", ActivityID: "train"})),
		[]byte(`{"namespace":"default","workflow_id":"run-1/iter-1","workflow_run_id":"r1","activity_id":"train","activity_type":"exec","attempt":1,"result":{"from":"disk"},"finished":"2026-12-03T10:00:00Z"}`)))
	k = r2.taken(keptInfo(3, "tok-3"))
	require.NotNil(t, k)
	assert.JSONEq(t, `{"from":"disk"}`, string(k.Result))
	var whats []string
	for _, e := range *events {
		whats = append(whats, e.What)
	}
	assert.Contains(t, whats, "kept")
}

func TestResumeKeptReportsAndForgetsAGoneRun(t *testing.T) {
	srv := &fakeServer{up: true, pending: true}
	a := New(Deps{LogDir: t.TempDir()})
	write := func(id string) {
		k := &keptResult{Namespace: "default", WorkflowID: "wf-" + id, WorkflowRunID: "r", ActivityID: "train", Attempt: 1, Result: json.RawMessage(`{"id":"` + id + `"}`), Finished: time.Now()}
		b, _ := json.Marshal(k)
		require.NoError(t, writeFileSync(filepath.Join(a.attemptsDir(), keptFileName(k)), b))
	}
	write("a")
	// An exec attempt record next to it is not a kept result, and the
	// attempt sweep does not read kept results as records.
	require.NoError(t, os.WriteFile(filepath.Join(a.attemptsDir(), "x.json"), []byte(`{"tag":"t"}`), 0o644))
	recs, err := readRecords(a.attemptsDir(), "")
	require.NoError(t, err)
	assert.Len(t, recs, 1)

	r := NewReports()
	t.Cleanup(r.Close)
	r.Bind(srv, a, nil)
	require.NoError(t, r.ResumeKept())
	require.Eventually(t, func() bool { return len(srv.done()) == 1 }, 5*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return len(keptFiles(t, a.attemptsDir())) == 0 }, 5*time.Second, 10*time.Millisecond)

	// A run the server no longer has: dropped without a report.
	srv.mu.Lock()
	srv.runGone = true
	srv.mu.Unlock()
	write("b")
	require.NoError(t, r.ResumeKept())
	require.Eventually(t, func() bool { return len(keptFiles(t, a.attemptsDir())) == 0 }, 5*time.Second, 10*time.Millisecond)
	assert.Len(t, srv.done(), 1)
	assert.True(t, strings.HasPrefix(filepath.Base(keptFileName(&keptResult{WorkflowID: "w/x", ActivityID: "a"})), keptPrefix))
}
