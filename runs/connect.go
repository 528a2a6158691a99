package runs

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"google.golang.org/grpc"

	"github.com/rlflow/rlflow/codec"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/log"
	"go.temporal.io/sdk/temporal"
)

// Target is a Temporal frontend and how to reach it. Every client rlflow
// makes is built from one, by clientOptions.
type Target struct {
	Address, Namespace string
	// Security is the connection's TLS and credentials; the zero value
	// is plaintext without credentials (a dev server).
	Security Security
}

// Security is the TLS, API key and gRPC metadata of a connection, as
// Resolve read them from Temporal's client configuration. It holds key
// material, so it prints only the settings' names and paths.
type Security struct {
	// base holds the TLS and authority (ConnectionOptions), the API key
	// (Credentials) and the gRPC metadata (HeadersProvider); nothing else.
	base client.Options
	// clientCert says a client certificate is configured (mTLS).
	clientCert bool
	// settings lists the settings in effect and where each came from,
	// for messages (Security.String).
	settings string
}

// String lists the settings in effect and where each came from, never
// key material: "plaintext, no client certificate or API key" for the zero Security.
func (s Security) String() string {
	if s.settings == "" {
		return "plaintext, no client certificate or API key"
	}
	return s.settings
}

// GoString is String, so that %#v cannot print key material either.
func (s Security) GoString() string { return s.String() }

// clientOptions are the options of every client rlflow makes: the one
// place where they are built.
func clientOptions(t Target, logger log.Logger) (client.Options, error) {
	opts := t.Security.base
	opts.HostPort = t.Address
	opts.Namespace = t.Namespace
	opts.Logger = logger
	dc, err := payloadCodec()
	if err != nil {
		return opts, err
	}
	if dc != nil {
		// Failure messages (exec log tails, paths) are not payloads: the
		// failure converter encodes them too, or they stay plaintext.
		opts.DataConverter = dc
		opts.FailureConverter = temporal.NewDefaultFailureConverter(temporal.DefaultFailureConverterOptions{DataConverter: dc, EncodeCommonAttributes: true})
	}
	return opts, nil
}

// payloadCodec is the payload encryption of every client rlflow makes, from
// the environment (codec.FromEnv); nil when it is off.
func payloadCodec() (converter.DataConverter, error) { return codec.FromEnv(os.Getenv) }

// Connect dials a dev server (plaintext, no credentials) at address: see
// ConnectTarget.
func Connect(ctx context.Context, address, namespace string) (client.Client, error) {
	return ConnectTarget(ctx, Target{Address: address, Namespace: namespace})
}

// ConnectTarget dials a Temporal frontend for a command: it fails at once
// when the frontend cannot be reached (a TLS handshake that failed says
// why, as a *TLSError), and the SDK's own log is dropped (the command
// reports what matters through the errors it returns).
func ConnectTarget(ctx context.Context, t Target) (client.Client, error) {
	opts, err := clientOptions(t, quietLogger{})
	if err != nil {
		return nil, fmt.Errorf("connecting to Temporal at %s (namespace %s): %w", t.Address, t.Namespace, err)
	}
	c, err := client.DialContext(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("connecting to Temporal at %s (namespace %s): %w", t.Address, t.Namespace, diagnose(ctx, t, err))
	}
	return c, nil
}

// DialOptions configure Dial.
type DialOptions struct {
	Address, Namespace string
	// Security is the connection's TLS and credentials (Resolve); the
	// zero value is plaintext without credentials.
	Security Security
	// Log is the worker's log: it gets a warning per failed attempt and
	// the SDK's own lines at warn and above (SDKLogger). Nil discards both.
	Log *slog.Logger
	// Backoff between attempts (default 1s doubling up to 30s).
	Backoff Backoff
	// MaxWait bounds the wait for the frontend; 0 waits until ctx ends.
	MaxWait time.Duration
	// MetricsHandler receives the SDK's metrics (a worker's
	// metrics.Metrics.SDKHandler); nil drops them.
	MetricsHandler client.MetricsHandler
	// GRPCInterceptors see every call on the connection (a worker's
	// activities.Reports.Watch).
	GRPCInterceptors []grpc.UnaryClientInterceptor
}

// workerBackoff is how a worker waits for its frontend: quickly at first
// (a server being restarted), then every 30s (a cluster being repaired).
var workerBackoff = Backoff{Min: time.Second, Max: 30 * time.Second}

// Dial connects a worker to its frontend, waiting for the frontend to
// answer as long as it takes (or MaxWait): a worker started before its
// server, or during an outage, starts once the server is back. An answer
// that is an error (the namespace does not exist, permission denied) and
// a TLS handshake that failed (*TLSError: an untrusted certificate, a
// refused client certificate) fail at once: waiting cannot fix them.
//
// Why not client.NewLazyClient: it only moves the failure into the SDK
// worker's Start, which is memoized (a Start that failed cannot be
// retried), so the wait must happen before the worker is built. Once
// connected, the SDK's pollers ride out later outages by themselves.
func Dial(ctx context.Context, o DialOptions) (client.Client, error) {
	if o.Backoff == (Backoff{}) {
		o.Backoff = workerBackoff
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	wctx := ctx
	if o.MaxWait > 0 {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, o.MaxWait)
		defer cancel()
	}
	t := Target{Address: o.Address, Namespace: o.Namespace, Security: o.Security}
	opts, err := clientOptions(t, SDKLogger(log.Handler()))
	if err != nil {
		return nil, fmt.Errorf("connecting to Temporal at %s (namespace %s): %w", o.Address, o.Namespace, err)
	}
	opts.MetricsHandler = o.MetricsHandler
	if len(o.GRPCInterceptors) > 0 {
		opts.ConnectionOptions.DialOptions = append(opts.ConnectionOptions.DialOptions, grpc.WithChainUnaryInterceptor(o.GRPCInterceptors...))
	}
	start := time.Now()
	var c client.Client
	failed := 0
	err = retry(wctx, o.Backoff, func(ctx context.Context) error {
		var err error
		if c, err = client.DialContext(ctx, opts); err != nil {
			return diagnose(ctx, t, err)
		}
		// The SDK worker's Start describes the namespace; asking here
		// first tells a missing namespace (fail now) from a server
		// still starting (wait).
		if _, err = c.WorkflowService().DescribeNamespace(ctx, &workflowservice.DescribeNamespaceRequest{Namespace: o.Namespace}); err != nil {
			c.Close()
			c = nil
			return fmt.Errorf("describing namespace %s: %w", o.Namespace, err)
		}
		return nil
	}, func(attempt int, err error, wait time.Duration) {
		failed = attempt
		log.Warn("temporal unreachable; retrying", "address", o.Address, "namespace", o.Namespace,
			"attempt", attempt, "reason", shortReason(err), "retry_in", wait, "waited", time.Since(start).Round(time.Second))
	})
	switch {
	case err == nil:
		if failed > 0 {
			log.Info("temporal reachable", "address", o.Address, "namespace", o.Namespace,
				"attempts", failed+1, "waited", time.Since(start).Round(time.Second))
		}
		return c, nil
	case ctx.Err() == nil && wctx.Err() != nil:
		return nil, fmt.Errorf("temporal at %s (namespace %s) still unreachable after %s, the longest wait allowed: %w", o.Address, o.Namespace, o.MaxWait, err)
	default:
		return nil, fmt.Errorf("connecting to Temporal at %s (namespace %s): %w", o.Address, o.Namespace, err)
	}
}
