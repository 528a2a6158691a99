package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
)

// hostileSecret is what a .env file outside the worker's roots holds.
const hostileSecret = "sk-hostile-Zq81bQ"

// TestHostilePaths starts runs the way a user of the Temporal UI can (the
// workflow's input as a JSON object) against a worker process started with
// --roots, each naming a path outside the roots. Each run fails naming the
// field, writes nothing outside the roots, and leaves no file content, no
// secret and no hint of whether an outside path exists in any history.
func TestHostilePaths(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	tmp, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	root, outside, state := filepath.Join(tmp, "root"), filepath.Join(tmp, "outside"), filepath.Join(tmp, "state")
	for _, d := range []string{filepath.Join(root, "data"), filepath.Join(root, "ckpt"), outside} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	envFile := filepath.Join(outside, ".env")
	require.NoError(t, os.WriteFile(envFile, []byte("OPENAI_API_KEY="+hostileSecret+"\n"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(root, "data", "p.jsonl"), []byte(`{"id": "a", "prompt": "hi"}`+"\n"), 0o644))
	require.NoError(t, os.Symlink(envFile, filepath.Join(root, "innocent.yaml")))
	require.NoError(t, syscall.Mkfifo(filepath.Join(root, "fifo.yaml"), 0o644))

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()
	queue := "hostile-paths"
	startWorker(t, bin, srv.Address, queue, filepath.Join(state, "logs"), "--data-dir", filepath.Join(state, "data"), "--roots", root)

	// Inline specs are valid pipelines (loaded as the CLI loads them), sent
	// as the JSON objects the UI's start form takes.
	spec := func(baseDir, steps string) map[string]any {
		t.Helper()
		y := "version: 1\nname: hostile\nbase_dir: " + baseDir + "\n" +
			"servers: [{url: \"http://127.0.0.1:9\"}]\nweight_transfer: {backend: disk}\n" +
			"defaults: {timeout: 1m, retry: {max_attempts: 1}}\nsteps:\n" + steps
		p, err := pipelines.Load("hostile.yaml", []byte(y))
		require.NoError(t, err, "%s", y)
		b, err := json.Marshal(p)
		require.NoError(t, err)
		var m map[string]any
		require.NoError(t, json.Unmarshal(b, &m))
		return m
	}
	// The control: a pipeline inside the root runs, and its exec step
	// writes there.
	ok := "version: 1\nname: ok\nsteps:\n  - {id: e, uses: exec, with: {command: [touch, made]}}\n"
	require.NoError(t, os.WriteFile(filepath.Join(root, "ok.yaml"), []byte(ok), 0o644))
	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{TaskQueue: queue}, workflows.PipelineWorkflow,
		map[string]any{"spec_path": filepath.Join(root, "ok.yaml")})
	require.NoError(t, err)
	require.NoError(t, run.Get(ctx, nil))
	require.FileExists(t, filepath.Join(root, "made"))

	pwned := filepath.Join(outside, "pwned")
	msgs := map[string]string{}
	for _, tc := range []struct {
		name  string
		input map[string]any
		field string
	}{
		{"spec_path /etc/passwd", map[string]any{"spec_path": "/etc/passwd"}, "spec_path: "},
		{"spec_path a .env outside", map[string]any{"spec_path": envFile}, "spec_path: "},
		{"spec_path a missing file outside", map[string]any{"spec_path": filepath.Join(outside, ".envx")}, "spec_path: "},
		{"spec_path climbing out", map[string]any{"spec_path": root + "/../outside/.env"}, "spec_path: "},
		{"spec_path a symlink in the root pointing out", map[string]any{"spec_path": filepath.Join(root, "innocent.yaml")}, "spec_path: "},
		{"spec_path /proc/self/environ", map[string]any{"spec_path": "/proc/self/environ"}, "spec_path: "},
		{"spec_path a FIFO", map[string]any{"spec_path": filepath.Join(root, "fifo.yaml")}, "a named pipe (FIFO), not a regular file"},
		{"spec_path a directory", map[string]any{"spec_path": filepath.Join(root, "data")}, "a directory, not a regular file"},
		{"base_dir /", map[string]any{"spec": spec("/",
			"  - {id: g, uses: generate, with: {prompts: etc/passwd, output: x.jsonl}}\n")}, `base_dir "/"`},
		{"generate output ../../x", map[string]any{"spec": spec(root,
			"  - {id: g, uses: generate, with: {prompts: data/p.jsonl, output: ../../x.jsonl}}\n")}, "with.output: "},
		{"generate prompts outside", map[string]any{"spec": spec(root,
			"  - {id: g, uses: generate, with: {prompts: "+envFile+"}}\n")}, "with.prompts: "},
		{"exec dir outside", map[string]any{"spec": spec(root,
			"  - {id: e, uses: exec, with: {command: [touch, pwned], dir: "+outside+"}}\n")}, "with.dir: "},
		{"exec at base_dir /", map[string]any{"spec": spec("/",
			"  - {id: e, uses: exec, with: {command: [touch, "+strings.TrimPrefix(pwned, "/")+"]}}\n")}, `base_dir "/"`},
		{"broadcast a checkpoint outside", map[string]any{"spec": spec(root,
			"  - {id: b, uses: broadcast, with: {checkpoint: "+outside+"}}\n")}, "with.checkpoint: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{TaskQueue: queue, WorkflowExecutionTimeout: 2 * time.Minute},
				workflows.PipelineWorkflow, tc.input)
			require.NoError(t, err)
			err = run.Get(ctx, nil)
			require.Error(t, err, "the run succeeded")
			var app *temporal.ApplicationError
			require.True(t, errors.As(err, &app), "%v", err)
			msg := err.Error()
			msgs[tc.name] = msg
			assert.Contains(t, msg, tc.field)
			assert.Contains(t, msg, "(type: "+pipelines.ErrTypeBadInput+", retryable: false)", "fails at once as bad input")
			hist := historyText(ctx, t, c, run.GetID())
			for _, leak := range []string{hostileSecret, "Zq81", "root:x:0:0", "no such file", "PATH="} {
				assert.NotContains(t, hist, leak, "the history holds %q", leak)
				assert.NotContains(t, msg, leak)
			}
		})
	}

	// The refusal reads the same whether the file outside exists or not.
	there, gone := msgs["spec_path a .env outside"], msgs["spec_path a missing file outside"]
	assert.Equal(t, cutRunIDs(there), cutRunIDs(strings.ReplaceAll(gone, ".envx", ".env")))

	// Outside the roots: the .env file and nothing else, here and above.
	entries, err := os.ReadDir(outside)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the .env file is outside")
	for _, p := range []string{pwned, filepath.Join(filepath.Dir(tmp), "x.jsonl"), "/x.jsonl", "/pwned"} {
		_, err := os.Lstat(p)
		assert.True(t, os.IsNotExist(err), "%s was written", p)
	}
	above, err := os.ReadDir(tmp)
	require.NoError(t, err)
	var names []string
	for _, e := range above {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	assert.Equal(t, []string{"outside", "root", "state"}, names)
}

var runIDsRe = regexp.MustCompile(`(workflowID|runID): [0-9a-f-]+`)

// cutRunIDs drops the ids a workflow's error message starts with.
func cutRunIDs(msg string) string { return runIDsRe.ReplaceAllString(msg, "$1") }

// historyText is the JSON of a run's history and of its child workflows'.
func historyText(ctx context.Context, t *testing.T, c client.Client, id string) string {
	t.Helper()
	events := history(ctx, t, c, id)
	b, err := protojson.Marshal(&historypb.History{Events: events})
	require.NoError(t, err)
	text := string(b)
	for _, ev := range events {
		if a := ev.GetChildWorkflowExecutionStartedEventAttributes(); a != nil {
			text += historyText(ctx, t, c, a.GetWorkflowExecution().GetWorkflowId())
		}
	}
	return text
}

// TestHostilePathsRootRefused: a worker told to serve the whole file
// system refuses to start, before it connects to anything.
func TestHostilePathsRootRefused(t *testing.T) {
	bin := testutil.RlflowBinary(t)
	for _, args := range [][]string{{"worker"}, {"worker", "--gpu", "--fake-nccl"}} {
		cmd := exec.Command(bin, append(args, "--roots", "/", "--address", "127.0.0.1:1", "--connect-timeout", "1s")...)
		cmd.Dir = t.TempDir()
		out, err := cmd.CombinedOutput()
		require.Error(t, err, "%s", out)
		assert.Contains(t, string(out), `--roots: root "/": the whole file system cannot be a root`, "%v", args)
		assert.NotContains(t, string(out), "unreachable", "refused before connecting")
	}
}
