package activities

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"go.temporal.io/api/serviceerror"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/interceptor"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A step that finished is never run again because Temporal was briefly
// away (the rule README.md states for users):
//
// The worker keeps each successful activity result, by task token, until
// the server acknowledged it: the SDK's RespondActivityTaskCompleted call,
// which Reports.Watch sees on the worker's client connection, answered.
// When that report fails for good (the server or its database is down, and
// the SDK gives up after its own retries), the result is written to
// <LogDir>/.attempts/ beside the exec attempt records and reported again
// by activity id (CompleteActivityByID) as soon as the server answers, so
// the run goes on within seconds of the server's return instead of after
// the attempt's timeout. A later attempt of the same activity that starts
// on this host meanwhile (the server gave the attempt up first) returns
// the kept result instead of running the step again. A restarted worker
// reports the kept results its predecessor left (ResumeKept).
//
// The one case this cannot cover is a later attempt on another host whose
// log dir is not this one: it runs the step again, as before.

// keptPrefix starts the file names of kept results under the attempts
// directory, apart from the exec attempt records.
const keptPrefix = "result~"

// keptRetention bounds how long a kept result is offered to the server:
// no attempt of a step outlives a day by default, and a result nobody
// takes must not be retried forever.
const keptRetention = 24 * time.Hour

// keptUnseen drops a result from memory when no report of it was seen
// this long after the activity returned (the SDK reports at once; only a
// worker without Reports.Watch on its connection never shows one).
const keptUnseen = 2 * time.Minute

// keptSettle is how long after a failed report the SDK may still be
// retrying it: a kept result is reported by id only after this quiet.
const keptSettle = 12 * time.Second

// keptResult is a finished activity attempt's result, kept until the
// server has it.
type keptResult struct {
	Namespace     string          `json:"namespace"`
	WorkflowID    string          `json:"workflow_id"`
	WorkflowRunID string          `json:"workflow_run_id"`
	ActivityID    string          `json:"activity_id"`
	ActivityType  string          `json:"activity_type"`
	Attempt       int             `json:"attempt"`
	Result        json.RawMessage `json:"result"`
	Finished      time.Time       `json:"finished"`

	token     string    // the attempt's task token (memory only)
	path      string    // the file, once persisted
	failedAt  time.Time // the last failed report
	reporting bool      // a goroutine reports it by id
}

func (k *keptResult) sameActivity(o *keptResult) bool {
	return k.Namespace == o.Namespace && k.WorkflowID == o.WorkflowID && k.WorkflowRunID == o.WorkflowRunID && k.ActivityID == o.ActivityID
}

func (k *keptResult) String() string {
	return fmt.Sprintf("%s (workflow %s, activity %s, attempt %d)", k.ActivityType, k.WorkflowID, k.ActivityID, k.Attempt)
}

// KeptReporter is the part of a Temporal client that reports kept results
// (client.Client has it).
type KeptReporter interface {
	DescribeWorkflow(ctx context.Context, workflowID, runID string) (*client.WorkflowExecutionDescription, error)
	CompleteActivityByID(ctx context.Context, namespace, workflowID, runID, activityID string, result any, err error) error
}

// KeptEvent is something Reports did that the worker's log should say.
type KeptEvent struct {
	What  string // "kept", "reported", "returned to a later attempt", "dropped"
	Step  string // the activity, as keptResult.String
	Error error  // the failure that made it keep or drop the result
}

// Reports keeps activity results until the server acknowledged them and
// reports the ones it did not get (see the rule above). Create it before
// dialing (its Watch goes on the client's connection), then Bind it to the
// client and the activities. Safe for concurrent use.
type Reports struct {
	mu       sync.Mutex
	byToken  map[string]*keptResult
	reporter KeptReporter
	dir      string
	onEvent  func(KeptEvent)
	settle   time.Duration // keptSettle; shorter in tests
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

// NewReports returns an unbound Reports.
func NewReports() *Reports {
	ctx, cancel := context.WithCancel(context.Background())
	return &Reports{byToken: map[string]*keptResult{}, settle: keptSettle, ctx: ctx, cancel: cancel}
}

// Bind gives r the client that reports kept results, the activities whose
// log dir keeps them, and a log of what it does (nil: none).
func (r *Reports) Bind(c KeptReporter, a *Activities, onEvent func(KeptEvent)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reporter, r.onEvent = c, onEvent
	if a != nil && a.LogDir != "" {
		r.dir = a.attemptsDir()
	}
}

// Close stops reporting (kept results on disk stay for the next worker).
func (r *Reports) Close() {
	r.cancel()
	r.wg.Wait()
}

func (r *Reports) event(e KeptEvent) {
	if r.onEvent != nil {
		r.onEvent(e)
	}
}

// respondCompleted is the gRPC method whose answer tells that the server
// has an activity's result.
const respondCompleted = "/temporal.api.workflowservice.v1.WorkflowService/RespondActivityTaskCompleted"

// Watch is a gRPC client interceptor for the worker's connection
// (runs.DialOptions.GRPCInterceptors): it sees whether each completion
// report reached the server.
func (r *Reports) Watch(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if method == respondCompleted {
		if rq, ok := req.(*workflowservice.RespondActivityTaskCompletedRequest); ok {
			r.outcome(string(rq.GetTaskToken()), err)
		}
	}
	return err
}

// outcome records a completion report's answer.
func (r *Reports) outcome(token string, err error) {
	r.mu.Lock()
	k := r.byToken[token]
	if k == nil {
		r.mu.Unlock()
		return
	}
	if err == nil {
		delete(r.byToken, token)
		path := k.path
		r.mu.Unlock()
		if path != "" {
			_ = removeRecordFile(path)
		}
		return
	}
	if notFound(err) {
		// The server no longer has this attempt (it timed it out and
		// retried): the result can still complete the activity by id.
		k.failedAt = time.Time{}
	} else {
		k.failedAt = time.Now()
	}
	start := !k.reporting
	k.reporting = true
	r.mu.Unlock()
	if start {
		r.persist(k, err)
		r.wg.Go(func() { r.report(k) })
	}
}

// persist writes k to the attempts directory, so a restarted worker can
// report it.
func (r *Reports) persist(k *keptResult, cause error) {
	r.event(KeptEvent{What: "kept", Step: k.String(), Error: cause})
	if r.dir == "" {
		return
	}
	path := filepath.Join(r.dir, keptFileName(k))
	b, err := json.Marshal(k)
	if err == nil {
		err = writeFileSync(path, b)
	}
	if err != nil {
		r.event(KeptEvent{What: "not written to disk (kept in memory only)", Step: k.String(), Error: err})
		return
	}
	r.mu.Lock()
	k.path = path
	r.mu.Unlock()
}

// keptFileName names k's file by its activity: a later attempt finds it.
func keptFileName(k *keptResult) string {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s\x00%s\x00%s\x00%s", k.Namespace, k.WorkflowID, k.WorkflowRunID, k.ActivityID)
	return fmt.Sprintf("%s%s~%s~%016x.json", keptPrefix, safeName(k.WorkflowID), safeName(k.ActivityID), h.Sum64())
}

// report completes k's activity by id once the server answers; it ends
// when the server has the result, no longer waits for it, or keptRetention
// passed.
func (r *Reports) report(k *keptResult) {
	backoff := time.Second
	for {
		r.mu.Lock()
		wait := time.Until(k.failedAt.Add(r.settle))
		r.mu.Unlock()
		if wait <= 0 {
			done, err := r.reportOnce(k)
			if done {
				r.forget(k, err)
				return
			}
			if time.Since(k.Finished) > keptRetention {
				r.forget(k, fmt.Errorf("the server did not take it within %v: %w", keptRetention, err))
				return
			}
			wait = backoff
			backoff = min(2*backoff, 5*time.Second)
		}
		t := time.NewTimer(wait)
		select {
		case <-r.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// reportOnce asks the server whether the activity still waits for a result
// and gives it k's; done is false when the server could not be asked.
func (r *Reports) reportOnce(k *keptResult) (done bool, err error) {
	r.mu.Lock()
	c := r.reporter
	r.mu.Unlock()
	if c == nil {
		return false, errors.New("no client bound")
	}
	ctx, cancel := context.WithTimeout(r.ctx, 10*time.Second)
	defer cancel()
	desc, err := c.DescribeWorkflow(ctx, k.WorkflowID, k.WorkflowRunID)
	if notFound(err) {
		return true, nil // the run is gone: nothing waits for the result
	}
	if err != nil {
		return false, err
	}
	pending := false
	for _, pa := range desc.RawResponse.GetPendingActivities() {
		if pa.GetActivityId() == k.ActivityID {
			pending = true
		}
	}
	if !pending {
		return true, nil // the server has the result (or the run moved on)
	}
	err = c.CompleteActivityByID(ctx, k.Namespace, k.WorkflowID, k.WorkflowRunID, k.ActivityID, k.Result, nil)
	if err == nil {
		r.event(KeptEvent{What: "reported", Step: k.String()})
		return true, nil
	}
	if notFound(err) {
		return true, nil
	}
	return false, err
}

// notFound reports whether err says the server does not know the thing
// asked about, as a Temporal service error or a raw gRPC status (what a
// connection interceptor may see).
func notFound(err error) bool {
	return err != nil && (isAny[*serviceerror.NotFound](err) || status.Code(err) == codes.NotFound)
}

// forget drops k from memory and disk.
func (r *Reports) forget(k *keptResult, cause error) {
	r.mu.Lock()
	if r.byToken[k.token] == k {
		delete(r.byToken, k.token)
	}
	path := k.path
	r.mu.Unlock()
	if path != "" {
		_ = removeRecordFile(path)
	}
	if cause != nil {
		r.event(KeptEvent{What: "dropped", Step: k.String(), Error: cause})
	}
}

// keep holds a successful result until its report is answered.
func (r *Reports) keep(info activity.Info, res any) {
	raw, err := json.Marshal(res)
	if err != nil {
		return // not JSON: the SDK's converter will fail to report it too
	}
	k := &keptResult{Namespace: info.Namespace, WorkflowID: info.WorkflowExecution.ID, WorkflowRunID: info.WorkflowExecution.RunID,
		ActivityID: info.ActivityID, ActivityType: info.ActivityType.Name, Attempt: int(info.Attempt), Result: raw,
		Finished: time.Now(), token: string(info.TaskToken)}
	r.mu.Lock()
	defer r.mu.Unlock()
	for tok, o := range r.byToken {
		if !o.reporting && time.Since(o.Finished) > keptUnseen {
			delete(r.byToken, tok)
		}
	}
	r.byToken[k.token] = k
}

// taken finds a result kept from an earlier attempt of info's activity, in
// memory or on disk, and hands it to this attempt: its report now clears it.
func (r *Reports) taken(info activity.Info) *keptResult {
	want := &keptResult{Namespace: info.Namespace, WorkflowID: info.WorkflowExecution.ID,
		WorkflowRunID: info.WorkflowExecution.RunID, ActivityID: info.ActivityID}
	r.mu.Lock()
	defer r.mu.Unlock()
	var found *keptResult
	for tok, k := range r.byToken {
		if k.sameActivity(want) && k.Attempt < int(info.Attempt) {
			found = k
			delete(r.byToken, tok)
			break
		}
	}
	if found == nil && r.dir != "" {
		if k, err := readKept(filepath.Join(r.dir, keptFileName(want))); err == nil && k.sameActivity(want) && k.Attempt < int(info.Attempt) {
			found = k
		}
	}
	if found == nil {
		return nil
	}
	// This attempt reports it; a report-by-id goroutine may still run,
	// and whichever answer comes first ends the other.
	found.token = string(info.TaskToken)
	r.byToken[found.token] = found
	return found
}

func readKept(path string) (*keptResult, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var k keptResult
	if err := json.Unmarshal(b, &k); err != nil || k.WorkflowID == "" || k.ActivityID == "" {
		return nil, fmt.Errorf("kept result %s is not one (%v)", path, err)
	}
	k.path = path
	return &k, nil
}

// ResumeKept reports the results a previous worker on this log dir kept
// and could not report; a worker calls it once as it starts.
func (r *Reports) ResumeKept() error {
	if r.dir == "" {
		return nil
	}
	entries, err := os.ReadDir(r.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("listing kept results: %w", err)
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), keptPrefix) || !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		k, err := readKept(filepath.Join(r.dir, e.Name()))
		if err != nil {
			r.event(KeptEvent{What: "unreadable", Step: e.Name(), Error: err})
			continue
		}
		r.mu.Lock()
		k.token = "resumed:" + e.Name()
		k.reporting = true
		r.byToken[k.token] = k
		r.mu.Unlock()
		r.wg.Go(func() { r.report(k) })
	}
	return nil
}

// Interceptor returns the worker interceptor that keeps results and hands
// a kept one to a later attempt; install it first (outermost), so what it
// keeps is what the others made of the result (masked).
func (r *Reports) Interceptor() interceptor.WorkerInterceptor { return &keptInterceptor{r: r} }

type keptInterceptor struct {
	interceptor.WorkerInterceptorBase
	r *Reports
}

func (i *keptInterceptor) InterceptActivity(ctx context.Context, next interceptor.ActivityInboundInterceptor) interceptor.ActivityInboundInterceptor {
	in := &keptInbound{r: i.r}
	in.Next = next
	return in
}

type keptInbound struct {
	interceptor.ActivityInboundInterceptorBase
	r *Reports
}

func (i *keptInbound) ExecuteActivity(ctx context.Context, in *interceptor.ExecuteActivityInput) (any, error) {
	info := activity.GetInfo(ctx)
	if info.IsLocalActivity {
		return i.Next.ExecuteActivity(ctx, in)
	}
	if k := i.r.taken(info); k != nil {
		i.r.event(KeptEvent{What: "returned to a later attempt", Step: k.String() + fmt.Sprintf(", now attempt %d", info.Attempt)})
		return k.Result, nil
	}
	res, err := i.Next.ExecuteActivity(ctx, in)
	if err == nil {
		i.r.keep(info, res)
	}
	return res, err
}

// writeFileSync writes b to path durably (temporary file, fsync, rename,
// directory fsync), as writeRecord does for attempt records.
func writeFileSync(path string, b []byte) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
