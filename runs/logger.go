package runs

import (
	"context"
	"log/slog"

	"go.temporal.io/sdk/log"
)

// quietLogger drops the SDK's client-side logs; the CLI reports what matters.
type quietLogger struct{}

func (quietLogger) Debug(string, ...any) {}
func (quietLogger) Info(string, ...any)  {}
func (quietLogger) Warn(string, ...any)  {}
func (quietLogger) Error(string, ...any) {}

// SDKLogger is the Temporal SDK's log for a worker: its lines at warn and
// above (a workflow task failing, a poll failing, a worker shutting down
// on a fatal error) go to h, the worker's own log handler, tagged
// from=temporal-sdk; below warn the SDK chatters about every poller start
// and stop and nothing goes anywhere.
func SDKLogger(h slog.Handler) log.Logger {
	return log.NewStructuredLogger(slog.New(minLevel{Handler: h, min: slog.LevelWarn}).With("from", "temporal-sdk"))
}

// minLevel passes on only the records at min and above.
type minLevel struct {
	slog.Handler
	min slog.Level
}

func (h minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

func (h minLevel) WithAttrs(attrs []slog.Attr) slog.Handler {
	return minLevel{Handler: h.Handler.WithAttrs(attrs), min: h.min}
}

func (h minLevel) WithGroup(name string) slog.Handler {
	return minLevel{Handler: h.Handler.WithGroup(name), min: h.min}
}
