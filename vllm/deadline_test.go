package vllm_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm"
)

// A hung server's call ends before the caller's deadline (an activity's
// StartToClose), with an error that names the server, the route and the
// step's deadline, and that is not retried: the caller can still report
// it. The calls' own timeouts (10 minutes) are far longer than the step.
func TestHungCallEndsBeforeTheCallersDeadline(t *testing.T) {
	release := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(func() { close(release); hung.Close() })
	c, err := vllm.New(hung.URL, vllm.Options{Generation: vllm.GenD,
		Timeouts: vllm.Timeouts{Control: 10 * time.Minute, Generate: 10 * time.Minute}})
	require.NoError(t, err)
	for name, tc := range map[string]struct {
		route string
		call  func(ctx context.Context) error
	}{
		"pause":     {"POST /pause", func(ctx context.Context) error { return c.Pause(ctx, vllm.PauseKeep) }},
		"is_paused": {"GET /is_paused", func(ctx context.Context) error { _, err := c.IsPaused(ctx); return err }},
		"completions": {"POST /v1/completions", func(ctx context.Context) error {
			_, err := c.Completions(ctx, vllm.CompletionRequest{Model: "m", Prompts: []string{"hi"}, MaxTokens: 1})
			return err
		}},
		"chat": {"POST /v1/chat/completions", func(ctx context.Context) error {
			_, err := c.Chat(ctx, vllm.ChatRequest{Model: "m", Messages: []vllm.Message{{Role: "user", Content: "hi"}}, MaxTokens: 1})
			return err
		}},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			err := tc.call(ctx)
			require.Error(t, err)
			assert.NoError(t, ctx.Err(), "the call ended at or after the caller's deadline: nothing could report it")
			var e *vllm.Error
			require.True(t, errors.As(err, &e), "%T %v", err, err)
			assert.Equal(t, hung.URL, e.Server)
			assert.Equal(t, tc.route, e.Call)
			assert.ErrorIs(t, err, vllm.ErrStepDeadline)
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.Contains(t, err.Error(), hung.URL)
			assert.Contains(t, err.Error(), tc.route)
			assert.Contains(t, err.Error(), "the step's deadline")
		})
	}
}
