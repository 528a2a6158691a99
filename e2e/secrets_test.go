package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// secretsPipeline: a step writes the secret it was given, URL-encoded and
// in base64 too, and the server's API key (which only an inheriting
// command sees) to its outputs and succeeds; the next prints its
// environment, the secret and the first step's output, and fails.
const secretsPipeline = `version: 1
name: secrets
servers:
  - url: http://127.0.0.1:9
    api_key_env: OPENAI_API_KEY
loop: {iterations: 1}
defaults:
  timeout: 1m
  retry: {max_attempts: 1}
steps:
  - id: leak
    uses: exec
    outputs: [token, key, url, b64]
    with:
      command:
        - sh
        - -c
        - |
          echo "token=$MY_SECRET" >> "$RLFLOW_OUTPUTS"
          echo "key=$OPENAI_API_KEY" >> "$RLFLOW_OUTPUTS"
          echo "url=https://hub.example/?t=$(printf %s "$MY_SECRET" | sed 's|/|%2F|g')" >> "$RLFLOW_OUTPUTS"
          echo "b64=$(printf %s "$MY_SECRET" | base64)" >> "$RLFLOW_OUTPUTS"
      secrets: [MY_SECRET]
  - id: fail
    uses: exec
    needs: [leak]
    with:
      command: [sh, -c, 'env; echo "$MY_SECRET"; echo "token ${{ steps.leak.outputs.token }}"; exit 3']
      secrets: [MY_SECRET]
`

func randomSecret(t *testing.T, prefix string) string {
	b := make([]byte, 12)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return prefix + hex.EncodeToString(b)
}

// A worker whose environment holds an OpenAI-like server key and a secret
// an exec step requests: the failing step prints its environment and the
// secret, yet neither appears in the run's history, the iteration's, what
// `rlflow run --wait` prints or the outputs files. The attempt logs on the
// worker's disk are the commands' own (the secret is there: the command
// had it).
func TestSecretsNeverReachHistoryOrCLI(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	for _, mode := range []string{"minimal", "inherit"} {
		t.Run(mode, func(t *testing.T) {
			secret, apiKey := randomSecret(t, "hf/e2e-"), randomSecret(t, "sk-e2e-")
			dir := t.TempDir()
			file := filepath.Join(dir, "secrets.yaml")
			require.NoError(t, os.WriteFile(file, []byte(secretsPipeline), 0o644))
			logDir := filepath.Join(dir, "logs")
			queue := "secrets-" + mode
			common := []string{"--address", srv.Address, "--task-queue", queue}
			env := append(os.Environ(), "MY_SECRET="+secret, "OPENAI_API_KEY="+apiKey, "RLFLOW_EXEC_ENV="+mode)

			w := exec.Command(bin, append([]string{"worker", "--log-dir", logDir, "--data-dir", filepath.Join(dir, "data")}, common...)...)
			w.Dir, w.Env = dir, env // the working directory is the worker's default root
			var wout bytes.Buffer
			w.Stdout, w.Stderr = &wout, &wout
			w.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
			require.NoError(t, w.Start())
			t.Cleanup(func() {
				_ = syscall.Kill(-w.Process.Pid, syscall.SIGKILL)
				_, _ = w.Process.Wait()
				if t.Failed() {
					t.Logf("worker output:\n%s", wout.String())
				}
			})

			id := "secrets-" + mode
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			run := exec.CommandContext(ctx, bin, append([]string{"run", file, "--wait", "--id", id}, common...)...)
			run.Dir, run.Env = dir, env
			cli, err := run.CombinedOutput()
			require.Error(t, err, "the run fails:\n%s", cli)
			require.Contains(t, string(cli), "exited with code 3", "the CLI reports the failing step:\n%s", cli)

			secrets := map[string]string{"the exec secret": secret, "the exec secret URL-encoded": url.QueryEscape(secret),
				"the exec secret in base64": base64.StdEncoding.EncodeToString([]byte(secret)), "the server's API key": apiKey}
			for what, s := range secrets {
				assert.NotContains(t, string(cli), s, "rlflow run --wait printed %s:\n%s", what, cli)
			}

			c, err := runs.Connect(ctx, srv.Address, "default")
			require.NoError(t, err)
			defer c.Close()
			var texts []string
			for _, wid := range []string{id, workflows.IterationWorkflowID(id, 1)} {
				for _, ev := range history(ctx, t, c, wid) {
					texts = append(texts, protoTexts(ev)...)
				}
			}
			all := strings.Join(texts, "\n")
			for what, s := range secrets {
				assert.NotContains(t, all, s, "history holds %s", what)
			}
			assert.Contains(t, all, "token ***", "the failing step's log tail, masked, is in history")
			assert.Contains(t, all, "https://hub.example/?t=***", "the URL-encoded secret in an output is masked")
			assert.Contains(t, all, `"b64":"***"`, "the secret in base64 in an output is masked")
			if mode == "inherit" {
				assert.Contains(t, all, "OPENAI_API_KEY=***", "the inherited API key, printed by env, is masked")
			}

			outputs, err := filepath.Glob(filepath.Join(logDir, "*", "*", "*", "attempt-*.outputs"))
			require.NoError(t, err)
			require.Len(t, outputs, 2, "an outputs file per step")
			logs, err := filepath.Glob(filepath.Join(logDir, "*", "*", "*", "attempt-*.log"))
			require.NoError(t, err)
			var logText strings.Builder
			for _, p := range logs {
				b, err := os.ReadFile(p)
				require.NoError(t, err)
				logText.Write(b)
			}
			require.Contains(t, logText.String(), secret, "the command got the secret (its log on the worker's disk is its own)")
			if mode == "inherit" {
				require.Contains(t, logText.String(), apiKey, "an inheriting command sees the worker's API key")
			} else {
				require.NotContains(t, logText.String(), apiKey, "a minimal environment holds no API key")
				require.NotContains(t, logText.String(), "OPENAI_API_KEY", "a minimal environment holds no API key")
			}
			for _, p := range outputs {
				b, err := os.ReadFile(p)
				require.NoError(t, err)
				for what, s := range secrets {
					assert.NotContains(t, string(b), s, "%s holds %s", p, what)
				}
			}
		})
	}
}

// protoTexts lists every string and bytes field of m, recursively: the
// history's messages, failures and stack traces, and its payloads' data.
func protoTexts(m proto.Message) []string {
	var out []string
	var walk func(protoreflect.Message)
	value := func(fd protoreflect.FieldDescriptor, v protoreflect.Value) {
		switch fd.Kind() {
		case protoreflect.StringKind:
			out = append(out, v.String())
		case protoreflect.BytesKind:
			out = append(out, string(v.Bytes()))
		case protoreflect.MessageKind, protoreflect.GroupKind:
			walk(v.Message())
		}
	}
	walk = func(m protoreflect.Message) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			switch {
			case fd.IsList():
				for i := 0; i < v.List().Len(); i++ {
					value(fd, v.List().Get(i))
				}
			case fd.IsMap():
				v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
					out = append(out, k.String())
					value(fd.MapValue(), mv)
					return true
				})
			default:
				value(fd, v)
			}
			return true
		})
	}
	walk(m.ProtoReflect())
	return out
}
