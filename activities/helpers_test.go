package activities

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
)

// testDouble is a vLLM double served in-process.
type testDouble struct {
	*double.Server
	URL string
}

func newDouble(t testing.TB, cfg double.Config) *testDouble {
	t.Helper()
	d, err := double.New(cfg)
	require.NoError(t, err)
	hs := httptest.NewServer(d.Handler())
	t.Cleanup(func() {
		hs.Close()
		d.Close()
	})
	return &testDouble{Server: d, URL: hs.URL}
}

func servers(ds ...*testDouble) []pipelines.Server {
	out := make([]pipelines.Server, len(ds))
	for i, d := range ds {
		out[i] = pipelines.Server{URL: d.URL}
	}
	return out
}

func stepContext(t testing.TB, step string, ds ...*testDouble) pipelines.StepContext {
	return pipelines.StepContext{Pipeline: "p", RunID: "run-1", Iteration: 2, StepID: step, BaseDir: t.TempDir(), Servers: servers(ds...)}
}

func newActivities(t *testing.T) *Activities {
	return New(Deps{LogDir: t.TempDir(), DataDir: t.TempDir(), HeartbeatEvery: 20 * time.Millisecond,
		Getenv: func(string) string { return "" }})
}

// writeLines writes a file under dir and returns its name.
func writeLines(t testing.TB, dir, name string, lines ...string) string {
	t.Helper()
	require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(strings.Join(lines, "\n")+"\n"), 0o644))
	return name
}

// promptLines returns n plain prompts with ids p0..p(n-1).
func promptLines(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf(`{"id": "p%d", "prompt": "prompt number %d: "}`, i, i)
	}
	return out
}

func readRollouts(t *testing.T, path string) []Rollout {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var out []Rollout
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var r Rollout
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), sc.Text())
		out = append(out, r)
	}
	require.NoError(t, sc.Err())
	return out
}

// errType returns the ApplicationError type of err, failing if it has none.
func errType(t *testing.T, err error) string {
	t.Helper()
	require.Error(t, err)
	var app *temporal.ApplicationError
	require.ErrorAs(t, err, &app, "%v", err)
	return app.Type()
}

// statusServer answers every request to path with status and body; other
// paths go to next.
func statusServer(t *testing.T, path string, status int, body string, next http.Handler) string {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == path {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write([]byte(body))
			return
		}
		next.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)
	return hs.URL
}

func vllmTimeouts() vllm.Timeouts { return vllm.Timeouts{} }
