package runs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/temporal"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// refused is the error a call gets while the frontend is down, as the SDK
// returns it (a serviceerror built from gRPC's status).
var refused = serviceerror.NewUnavailable(`connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:7233: connect: connection refused"`)

func TestTransient(t *testing.T) {
	live := context.Background()
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"no error", live, nil, false},
		// The frontend is down, restarting, or dropped the connection.
		{"unavailable", live, refused, true},
		{"unavailable wrapped by the SDK's dial", live, fmt.Errorf("failed reaching server: %w", refused), true},
		{"unavailable as a bare gRPC status", live, status.Error(codes.Unavailable, "error reading from server: EOF"), true},
		{"namespace unavailable", live, serviceerror.NewNamespaceUnavailable("default"), true},
		{"the call's own deadline", live, serviceerror.NewDeadlineExceeded("context deadline exceeded"), true},
		{"the call's own context deadline", live, fmt.Errorf("describing x: %w", context.DeadlineExceeded), true},
		{"a dropped connection's cancel", live, status.Error(codes.Canceled, "grpc: the client connection is closing"), true},
		{"a dropped connection's context cancel", live, context.Canceled, true},
		// The command's own context ended (Ctrl-C, --connect-timeout).
		{"unavailable after ctx ended", ended, refused, false},
		{"deadline after ctx ended", ended, serviceerror.NewDeadlineExceeded("context deadline exceeded"), false},
		{"cancel after ctx ended", ended, context.Canceled, false},
		// Answers: repeating the call cannot change them.
		{"workflow not found", live, serviceerror.NewNotFound("workflow execution not found"), false},
		{"namespace not found", live, serviceerror.NewNamespaceNotFound("nope"), false},
		{"invalid argument", live, serviceerror.NewInvalidArgument("bad id"), false},
		{"permission denied", live, serviceerror.NewPermissionDenied("no", ""), false},
		{"already started", live, serviceerror.NewWorkflowExecutionAlreadyStarted("exists", "", ""), false},
		{"query failed", live, serviceerror.NewQueryFailed("unknown query"), false},
		{"resource exhausted", live, serviceerror.NewResourceExhausted(enumspb.RESOURCE_EXHAUSTED_CAUSE_RPS_LIMIT, "busy"), false},
		{"internal", live, serviceerror.NewInternal("boom"), false},
		{"plain error", live, errors.New("boom"), false},
		// The run's own outcome.
		{"the run failed", live, fmt.Errorf("run: %w", &temporal.WorkflowExecutionError{}), false},
		{"the run was cancelled", live, temporal.NewCanceledError(), false},
		{"the run timed out", live, temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil), false},
		{"a step failed", live, temporal.NewApplicationError("exit 1", "ExecFailed"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, transient(tc.ctx, tc.err), "%v", tc.err)
		})
	}
}

func TestBackoffDelay(t *testing.T) {
	b := Backoff{Min: time.Second, Max: 30 * time.Second}
	var got []time.Duration
	for attempt := 1; attempt <= 8; attempt++ {
		got = append(got, b.delay(attempt))
	}
	s := time.Second
	assert.Equal(t, []time.Duration{s, 2 * s, 4 * s, 8 * s, 16 * s, 30 * s, 30 * s, 30 * s}, got)
	assert.Equal(t, 5*s, Backoff{Min: 5 * s, Max: 5 * s}.delay(100))
}

func TestShortReason(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{refused, "Unavailable: connection refused"},
		{fmt.Errorf("failed reaching server: %w", refused), "Unavailable: connection refused"},
		{status.Error(codes.Unavailable, "error reading from server: EOF"), "Unavailable: EOF"},
		{serviceerror.NewDeadlineExceeded("context deadline exceeded"), "DeadlineExceeded: context deadline exceeded"},
		{status.Error(codes.Unavailable, ""), "Unavailable"},
	} {
		assert.Equal(t, tc.want, shortReason(tc.err))
	}
}

// script is a call that returns errs in turn, then nil.
type script struct {
	errs  []error
	calls int
	// before runs before each call, e.g. to move a fake clock.
	before func(call int)
}

func (s *script) call(context.Context) error {
	s.calls++
	if s.before != nil {
		s.before(s.calls)
	}
	if s.calls <= len(s.errs) {
		return s.errs[s.calls-1]
	}
	return nil
}

func TestRetry(t *testing.T) {
	fast := Backoff{Min: time.Millisecond, Max: 2 * time.Millisecond}
	notFound := serviceerror.NewNotFound("workflow execution not found")
	for _, tc := range []struct {
		name      string
		errs      []error
		wantErr   error
		wantCalls int
		wantWaits []int // attempts that waited
	}{
		{"succeeds at once", nil, nil, 1, nil},
		{"waits out transient failures", []error{refused, serviceerror.NewDeadlineExceeded("x"), refused}, nil, 4, []int{1, 2, 3}},
		{"fails at once on an answer", []error{notFound}, notFound, 1, nil},
		{"fails on an answer after an outage", []error{refused, notFound}, notFound, 2, []int{1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &script{errs: tc.errs}
			var waits []int
			err := retry(context.Background(), fast, s.call, func(attempt int, err error, wait time.Duration) {
				waits = append(waits, attempt)
				assert.Equal(t, fast.delay(attempt), wait)
			})
			assert.Equal(t, tc.wantErr, err)
			assert.Equal(t, tc.wantCalls, s.calls)
			assert.Equal(t, tc.wantWaits, waits)
		})
	}
}

func TestRetryStopsWhenContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	s := &script{errs: []error{refused, refused, refused}}
	err := retry(ctx, Backoff{Min: time.Hour, Max: time.Hour}, s.call, func(int, error, time.Duration) { cancel() })
	require.ErrorIs(t, err, context.Canceled)
	assert.Contains(t, err.Error(), "connection refused", "the last failure is kept")
	assert.Equal(t, 1, s.calls)
}

// TestOutagesLines checks what a following command prints through an
// outage: one line when it starts, a reminder a minute later, one when the
// frontend answers again, and nothing for an outage's later failures or a
// second call's.
func TestOutagesLines(t *testing.T) {
	clock := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	var lines []string
	o := newOutages("127.0.0.1:7233", func(l string) { lines = append(lines, l) })
	o.backoff = Backoff{Min: time.Millisecond, Max: time.Millisecond}
	o.now = func() time.Time { return clock }
	ctx := context.Background()

	require.NoError(t, o.do(ctx, (&script{}).call))
	clock = clock.Add(3 * time.Second) // the outage begins after the last success
	s := &script{errs: []error{refused, refused, refused, refused}, before: func(call int) {
		clock = clock.Add(10 * time.Second) // the SDK retries inside each call
		if call == 4 {
			clock = clock.Add(30 * time.Second)
		}
	}}
	require.NoError(t, o.do(ctx, s.call))
	assert.Equal(t, []string{
		"temporal at 127.0.0.1:7233 unreachable (Unavailable: connection refused); retrying with backoff up to 1ms until it is back (Ctrl-C stops waiting)",
		"temporal at 127.0.0.1:7233 still unreachable after 1m10s (Unavailable: connection refused); retrying",
		"temporal reachable again after 1m20s",
	}, lines)

	// A call that fails with an answer reports no outage.
	lines = nil
	notFound := serviceerror.NewNotFound("workflow execution not found")
	assert.Equal(t, notFound, o.do(ctx, (&script{errs: []error{notFound}}).call))
	assert.Empty(t, lines)
}

// TestOutagesReasonProbesTheAddress: a call that ran out its deadline
// says nothing of why; the reason then comes from a TCP dial.
func TestOutagesReasonProbesTheAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	deadline := serviceerror.NewDeadlineExceeded("context deadline exceeded")
	for _, tc := range []struct {
		name, address string
		err           error
		want          string
	}{
		{"refused", closed.Addr().String(), deadline, "connection refused"},
		{"listening", ln.Addr().String(), deadline, "DeadlineExceeded: context deadline exceeded (the port accepts connections: the server does not answer)"},
		{"no address", "", deadline, "DeadlineExceeded: context deadline exceeded"},
		{"unavailable says why", closed.Addr().String(), refused, "Unavailable: connection refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, newOutages(tc.address, nil).reason(tc.err))
		})
	}
}

func TestSDKLoggerKeepsWarningsAndAbove(t *testing.T) {
	var buf bytes.Buffer
	h := slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})
	l := SDKLogger(h)
	l.Debug("poller started", "TaskQueue", "rlflow")
	l.Info("worker started", "TaskQueue", "rlflow")
	l.Warn("Failed to process workflow task.", "WorkflowID", "run-1", "Attempt", 7)
	l.Error("Worker received non-retriable error. Shutting down.", "Error", "namespace not found")
	out := buf.String()
	assert.NotContains(t, out, "poller started")
	assert.NotContains(t, out, "worker started")
	assert.Contains(t, out, `level=WARN msg="Failed to process workflow task." from=temporal-sdk WorkflowID=run-1 Attempt=7`)
	assert.Contains(t, out, `level=ERROR msg="Worker received non-retriable error. Shutting down." from=temporal-sdk Error="namespace not found"`)
	assert.Equal(t, 2, strings.Count(out, "\n"), out)
}

// TestDialWaitsAndGivesUp dials a port nobody listens on: Dial retries,
// logging each attempt with the address and reason, until MaxWait.
func TestDialWaitsAndGivesUp(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())

	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	_, err = Dial(context.Background(), DialOptions{Address: addr, Namespace: "default", Log: log,
		Backoff: Backoff{Min: 20 * time.Millisecond, Max: 50 * time.Millisecond}, MaxWait: 1500 * time.Millisecond})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "temporal at "+addr+" (namespace default) still unreachable after 1.5s")
	warns := strings.Count(buf.String(), `level=WARN msg="temporal unreachable; retrying" address=`+addr+" namespace=default attempt=")
	assert.GreaterOrEqual(t, warns, 2, buf.String())
	assert.Contains(t, buf.String(), `reason="Unavailable: connection refused"`)
}

func TestDialStopsWhenContextEnds(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = Dial(ctx, DialOptions{Address: addr, Namespace: "default", Backoff: Backoff{Min: time.Hour, Max: time.Hour}})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "connecting to Temporal at "+addr)
}
