package runs

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/temporal"
	"google.golang.org/grpc/codes"
)

// Backoff is a capped exponential delay between attempts: Min, 2*Min, ...
// up to Max.
type Backoff struct {
	Min, Max time.Duration
}

// delay is the wait after the attempt-th failed attempt (1-based).
func (b Backoff) delay(attempt int) time.Duration {
	d := b.Min
	for i := 1; i < attempt && d < b.Max; i++ {
		d *= 2
	}
	return min(d, b.Max)
}

// transient reports whether err, returned by a Temporal call made under ctx,
// says the frontend could not be reached (or did not answer in time) while
// ctx itself is alive: the call is worth repeating once the frontend is
// back. A workflow's own outcome (failed, cancelled, timed out) and every
// answer the server gave (not found, invalid argument, permission denied,
// ...) are not transient: repeating the call cannot change them.
func transient(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil {
		return false
	}
	var outcome *temporal.WorkflowExecutionError
	if errors.As(err, &outcome) {
		return false
	}
	switch serviceerror.ToStatus(err).Code() {
	case codes.Unavailable:
		return true
	case codes.DeadlineExceeded, codes.Canceled:
		// With ctx alive, the deadline that fired is the call's own
		// (the SDK's per-RPC timeout, or the long poll's), and a
		// cancellation is a dropped connection, not the user.
		return true
	}
	return false
}

// retry calls fn until it returns nil or an error that is not transient, or
// until ctx ends; then it returns ctx's error wrapping the last failure's.
// Before each wait it calls waiting (when set) with the attempt number,
// the failure and the wait. Every call to Temporal that waits out outages
// goes through here.
func retry(ctx context.Context, b Backoff, fn func(context.Context) error, waiting func(attempt int, err error, wait time.Duration)) error {
	for attempt := 1; ; attempt++ {
		err := fn(ctx)
		if !transient(ctx, err) {
			return err
		}
		wait := b.delay(attempt)
		if waiting != nil {
			waiting(attempt, err, wait)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (while temporal was unreachable: %s)", ctx.Err(), shortReason(err))
		}
	}
}

// shortReason is a one-line reason for a transient failure, for the user:
// the gRPC code and the innermost cause, e.g. "Unavailable: connection
// refused" out of gRPC's nested "connection error: desc = ...: connect:
// connection refused".
func shortReason(err error) string {
	st := serviceerror.ToStatus(err)
	msg := strings.TrimRight(st.Message(), "\" ")
	if i := strings.LastIndex(msg, ": "); i >= 0 {
		msg = msg[i+2:]
	}
	msg = strings.Trim(msg, "\" ")
	if msg == "" {
		return st.Code().String()
	}
	return truncate(st.Code().String()+": "+msg, 100)
}

// outages waits out Temporal outages for the calls of one command that
// follows a run, and tells the user: one line when an outage starts, a
// reminder every remind while it lasts, one line when the frontend answers
// again. The calls of one command share one outages, so an outage that
// several of them wait out is reported once.
type outages struct {
	address string
	say     func(string)
	backoff Backoff
	remind  time.Duration
	now     func() time.Time

	mu sync.Mutex
	// since is when the outage began as best seen: the start of its first
	// failed call, or the last success if later (a long poll that began
	// before the outage fails long after it began); zero while reachable.
	since    time.Time
	lastOK   time.Time
	lastSaid time.Time
}

// cliBackoff is how often a following command retries: often enough that
// progress resumes within seconds of the frontend's return, and the SDK
// already retries inside each call (for up to its RPC timeout).
var cliBackoff = Backoff{Min: time.Second, Max: 5 * time.Second}

func newOutages(address string, say func(string)) *outages {
	return &outages{address: address, say: say, backoff: cliBackoff, remind: time.Minute, now: time.Now}
}

// do calls fn, waiting out outages of any length; it fails at once on an
// error that is not transient and when ctx ends.
func (o *outages) do(ctx context.Context, fn func(context.Context) error) error {
	return retry(ctx, o.backoff, func(ctx context.Context) error {
		start := o.now()
		err := fn(ctx)
		switch {
		case err == nil:
			o.reachable()
		case transient(ctx, err):
			o.unreachable(start, err)
		}
		return err
	}, nil)
}

func (o *outages) where() string {
	if o.address == "" {
		return "temporal"
	}
	return "temporal at " + o.address
}

func (o *outages) unreachable(start time.Time, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now()
	switch {
	case o.since.IsZero():
		o.since, o.lastSaid = start, now
		if o.lastOK.After(start) {
			o.since = o.lastOK
		}
		o.say(fmt.Sprintf("%s unreachable (%s); retrying with backoff up to %s until it is back (Ctrl-C stops waiting)",
			o.where(), o.reason(err), o.backoff.Max))
	case now.Sub(o.lastSaid) >= o.remind:
		o.lastSaid = now
		o.say(fmt.Sprintf("%s still unreachable after %s (%s); retrying", o.where(), now.Sub(o.since).Round(time.Second), o.reason(err)))
	}
}

// reason is err's short reason. The SDK retries a refused connection
// inside each call until the call's deadline and then reports only the
// deadline; a TCP dial to the frontend then tells the user why (refused,
// no route, timeout) when it fails.
func (o *outages) reason(err error) string {
	r := shortReason(err)
	if o.address == "" || serviceerror.ToStatus(err).Code() != codes.DeadlineExceeded {
		return r
	}
	conn, derr := net.DialTimeout("tcp", o.address, 2*time.Second)
	if derr != nil {
		msg := derr.Error()
		if i := strings.LastIndex(msg, ": "); i >= 0 {
			msg = msg[i+2:]
		}
		return msg
	}
	conn.Close()
	return r + " (the port accepts connections: the server does not answer)"
}

func (o *outages) reachable() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.lastOK = o.now()
	if o.since.IsZero() {
		return
	}
	o.say(fmt.Sprintf("temporal reachable again after %s", o.lastOK.Sub(o.since).Round(time.Second)))
	o.since = time.Time{}
}
