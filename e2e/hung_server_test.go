package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hungServerPipeline: one step against a server that never answers it,
// with a step timeout far shorter than the call's own (10 minutes).
const hungServerPipeline = `version: 1
name: hung-%s
servers:
  - {url: %q, api: B}
defaults:
  timeout: 6s
  retry: {max_attempts: 1}
steps:
  - id: call
    uses: %s
    with: %s
`

// Issue 14's acceptance: a hung /v1/completions and a hung /pause fail the
// step within the step's timeout, and the error names the server and the
// route, not a bare Temporal timeout.
func TestHungServerFailsTheStepNamingServerAndRoute(t *testing.T) {
	release := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/pause", "/v1/completions":
			select {
			case <-r.Context().Done():
			case <-release:
			}
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(func() { close(release); hung.Close() })
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	work := t.TempDir()
	queue := "hung-" + t.Name()
	startWorker(t, bin, srv.Address, queue, filepath.Join(work, "logs"), "--data-dir", filepath.Join(work, "data"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, os.WriteFile(filepath.Join(work, "prompts.jsonl"), []byte(`{"prompt": "hello"}`+"\n"), 0o644))

	for _, tc := range []struct{ uses, with, route string }{
		{"pause", "{mode: keep}", "POST /pause"},
		{"generate", "{prompts: prompts.jsonl, model: m, max_tokens: 4}", "POST /v1/completions"},
	} {
		t.Run(tc.uses, func(t *testing.T) {
			spec, params := loadWithParams(t, work, tc.uses+".yaml", fmt.Sprintf(hungServerPipeline, tc.uses, hung.URL, tc.uses, tc.with), nil)
			start := time.Now()
			run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
			require.NoError(t, err)
			var res workflows.PipelineResult
			err = run.Get(ctx, &res)
			require.Error(t, err)
			t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
			msg := err.Error()
			assert.Contains(t, msg, hung.URL)
			assert.Contains(t, msg, tc.route)
			assert.Contains(t, msg, "the step's deadline")
			assert.NotContains(t, msg, "StartToClose")
		})
	}
}
