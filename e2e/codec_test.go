package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/codec"
	"github.com/rlflow/rlflow/devserver"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/worker"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// codecPipeline generates from a prompts file of the pipeline's directory,
// wires the rollout path and a launch parameter into a noop step's outputs,
// and ends with a trainer that prints a marked line and fails, so that
// history holds arguments, results, paths and a failure. %[1]s is the mark.
const codecPipeline = `version: 1
name: codec
servers:
  - {url: %[2]q, api: C}
params:
  instruction: {type: string, default: unused}
defaults:
  timeout: 1m
  retry: {max_attempts: 1}
steps:
  - id: rollout
    uses: generate
    with: {prompts: prompts-%[1]s.jsonl, max_tokens: 4, n: 1}
  - id: report
    uses: noop
    needs: [rollout]
    with:
      outputs:
        answer: "reply-%[1]s"
        rollouts: "${{ steps.rollout.outputs.path }}"
        instruction: "${{ params.instruction }}"
  - id: train
    uses: exec
    needs: [report]
    with:
      command: [sh, -c, 'echo "trainer says failure-%[1]s"; exit 3']
`

// Issue 15's acceptance for payload encryption: with the codec on in the
// client and the worker, the history of a run (parent and iteration) holds
// no plaintext prompt, path, output or failure message, every payload in it
// is encrypted, and `rlflow codec-server` decodes them for a client with
// the key: its /decode endpoint and the temporal CLI's --codec-endpoint.
func TestCodecHidesPayloadsFromHistory(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	temporalCLI, err := devserver.FindTemporal("")
	require.NoError(t, err)
	d := startDouble(t, double.Faults{})

	mark := fmt.Sprintf("x%dx", time.Now().UnixNano())
	secrets := []string{
		"dir-" + mark,         // base_dir, the prompts path, the rollouts path, the exec log path
		"prompts-" + mark,     // a step argument
		"reply-" + mark,       // a step output
		"instruction-" + mark, // a launch parameter (a prompt to the pipeline)
		"failure-" + mark,     // the failed step's log tail in its error
	}
	work := filepath.Join(t.TempDir(), "dir-"+mark)
	require.NoError(t, os.MkdirAll(work, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(work, "prompts-"+mark+".jsonl"), []byte(`{"id": "p1", "prompt": "the cat "}`+"\n"), 0o644))
	specPath := filepath.Join(work, "codec.yaml")
	require.NoError(t, os.WriteFile(specPath, []byte(fmt.Sprintf(codecPipeline, mark, d.URL)), 0o644))
	spec, err := pipelines.LoadFile(specPath)
	require.NoError(t, err)
	params, err := spec.ResolveParams(map[string]string{"instruction": "instruction-" + mark})
	require.NoError(t, err)

	// Rotated keys: old is kept for older history, now encrypts.
	keyEnv := map[string]string{
		codec.EnvKeys:  "old:" + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{1}, 32)) + ",now:" + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{2}, 32)),
		codec.EnvKeyID: "now",
	}
	dc, err := codec.FromEnv(func(k string) string { return keyEnv[k] })
	require.NoError(t, err)
	require.NotNil(t, dc)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	keyed := dialWith(t, srv.Address, dc)
	queue := "codec-" + t.Name()
	w, err := worker.NewControl(keyed, worker.Options{TaskQueue: queue,
		Deps: activities.Deps{LogDir: filepath.Join(work, "logs"), DataDir: filepath.Join(work, "data")}})
	require.NoError(t, err)
	require.NoError(t, w.Start())
	t.Cleanup(w.Stop)

	run, err := runs.Start(ctx, keyed, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue})
	require.NoError(t, err)
	runErr := run.Get(ctx, nil)
	require.Error(t, runErr, "the train step exits 3")
	// The key holder's client decodes the failure: the message is whole.
	assert.Contains(t, runErr.Error(), "failure-"+mark)

	// What anyone with namespace access sees: no key.
	plain, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	t.Cleanup(plain.Close)
	ids := []string{run.GetID()}
	var payloads []*commonpb.Payload
	var wire []byte
	for i := 0; i < len(ids); i++ {
		events := history(ctx, t, plain, ids[i])
		for _, ev := range events {
			if a := ev.GetChildWorkflowExecutionStartedEventAttributes(); a != nil {
				ids = append(ids, a.GetWorkflowExecution().GetWorkflowId())
			}
			b, err := proto.Marshal(ev)
			require.NoError(t, err)
			wire = append(wire, b...)
			payloads = append(payloads, collectPayloads(ev.ProtoReflect())...)
		}
	}
	require.Len(t, ids, 2, "the run and its one iteration")
	require.NotEmpty(t, payloads)

	// Every payload is ciphertext (the codec's encoding names nothing else)
	// and no secret is anywhere in the events' bytes.
	for i, p := range payloads {
		assert.Equal(t, codec.Encoding, string(p.Metadata[converter.MetadataEncoding]), "payload %d", i)
		assert.Equal(t, "now", string(p.Metadata[codec.MetadataKeyID]), "payload %d", i)
	}
	for _, s := range secrets {
		assert.False(t, bytes.Contains(wire, []byte(s)), "the history's wire bytes hold %q", s)
	}
	// The history JSON an operator gets from the CLI, payload data decoded
	// from base64.
	for _, id := range ids {
		out := temporalShow(ctx, t, temporalCLI, srv.Address, id)
		for _, s := range secrets {
			assert.False(t, strings.Contains(out, s), "temporal workflow show %s holds %q", id, s)
		}
		assert.True(t, strings.Contains(out, `"message": "Encoded failure"`), "temporal workflow show %s: the failure messages are not encrypted", id)
	}

	// A key holder's codec server decodes them.
	const token = "codec-e2e-token"
	codecURL := startCodecServer(t, bin, keyEnv, token)
	decoded := decodeThrough(t, codecURL, token, payloads)
	var all strings.Builder
	for _, p := range decoded {
		require.NotEqual(t, codec.Encoding, string(p.Metadata[converter.MetadataEncoding]))
		all.Write(p.Data)
		all.WriteByte('\n')
	}
	for _, s := range secrets {
		assert.Contains(t, all.String(), s, "the decoded payloads")
	}
	// And the temporal CLI pointed at it shows the plaintext.
	var shown strings.Builder
	for _, id := range ids {
		shown.WriteString(temporalShow(ctx, t, temporalCLI, srv.Address, id, "--codec-endpoint", codecURL, "--codec-auth", "Bearer "+token))
	}
	for _, s := range secrets {
		assert.True(t, strings.Contains(shown.String(), s), "temporal workflow show --codec-endpoint lacks %q", s)
	}
}

func dialWith(t *testing.T, address string, dc converter.DataConverter) client.Client {
	t.Helper()
	c, err := client.Dial(client.Options{
		HostPort: address, Namespace: "default", Logger: runs.SDKLogger(slog.DiscardHandler),
		DataConverter: dc,
		// Failure messages and stack traces are not payloads: the failure
		// converter must put them through the data converter.
		FailureConverter: temporal.NewDefaultFailureConverter(temporal.DefaultFailureConverterOptions{DataConverter: dc, EncodeCommonAttributes: true}),
	})
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// collectPayloads returns every Payload in m, search attributes (plaintext
// by design) aside.
func collectPayloads(m protoreflect.Message) []*commonpb.Payload {
	if p, ok := m.Interface().(*commonpb.Payload); ok {
		return []*commonpb.Payload{p}
	}
	if _, ok := m.Interface().(*commonpb.SearchAttributes); ok {
		return nil
	}
	var out []*commonpb.Payload
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				out = append(out, collectPayloads(mv.Message())...)
				return true
			})
		case fd.IsList() && fd.Message() != nil:
			for i := 0; i < v.List().Len(); i++ {
				out = append(out, collectPayloads(v.List().Get(i).Message())...)
			}
		case !fd.IsMap() && !fd.IsList() && fd.Message() != nil:
			out = append(out, collectPayloads(v.Message())...)
		}
		return true
	})
	return out
}

// temporalShow is `temporal workflow show -o json` of id, as an operator
// runs it, followed by the payloads' data: the CLI prints it in base64.
func temporalShow(ctx context.Context, t *testing.T, cli, address, id string, extra ...string) string {
	t.Helper()
	args := append([]string{"workflow", "show", "--address", address, "--namespace", "default", "-w", id, "-o", "json"}, extra...)
	out, err := exec.CommandContext(ctx, cli, args...).Output()
	require.NoError(t, err, "temporal %s", strings.Join(args, " "))
	var doc any
	require.NoError(t, json.Unmarshal(out, &doc), "temporal %s printed no JSON", strings.Join(args, " "))
	var b strings.Builder
	b.Write(out)
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				if s, ok := e.(string); ok && k == "data" {
					data, err := base64.StdEncoding.DecodeString(s)
					require.NoError(t, err, "payload data %q", s)
					b.WriteByte('\n')
					b.Write(data)
					continue
				}
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	walk(doc)
	return b.String()
}

// startCodecServer runs `rlflow codec-server` with the keys and a token and
// returns its URL once it answers.
func startCodecServer(t *testing.T, bin string, keyEnv map[string]string, token string) string {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))
	cmd := exec.Command(bin, "codec-server", "--listen", addr, "--token-env", "RLFLOW_E2E_CODEC_TOKEN")
	cmd.Env = append(os.Environ(), "RLFLOW_E2E_CODEC_TOKEN="+token)
	for k, v := range keyEnv {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("codec-server log:\n%s", log.String())
		}
	})
	url := "http://" + addr
	testutil.Eventually(t, 20*time.Second, "rlflow codec-server to answer", func() bool {
		resp, err := http.Post(url+"/decode", "application/json", strings.NewReader(`{}`))
		if err != nil {
			return false
		}
		resp.Body.Close()
		return true
	})
	return url
}

// decodeThrough posts payloads to the codec server's /decode as the UI does.
func decodeThrough(t *testing.T, url, token string, payloads []*commonpb.Payload) []*commonpb.Payload {
	t.Helper()
	body, err := protojson.Marshal(&commonpb.Payloads{Payloads: payloads})
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, url+"/decode", bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Namespace", "default")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	var out commonpb.Payloads
	require.NoError(t, protojson.Unmarshal(b, &out))
	require.Len(t, out.Payloads, len(payloads))
	return out.Payloads
}

// The codec through the CLI: a worker and `rlflow run --wait` holding the
// key in their environment run a pipeline whose outputs the CLI prints in
// plain, while a client without the key finds none of them in history.
func TestCodecThroughTheCLI(t *testing.T) {
	srv := testutil.DevServer(t)
	bin := testutil.RlflowBinary(t)
	mark := fmt.Sprintf("cli%dx", time.Now().UnixNano())
	work := t.TempDir()
	specPath := filepath.Join(work, "cli.yaml")
	require.NoError(t, os.WriteFile(specPath, []byte(`version: 1
name: codec-cli
steps:
  - id: say
    uses: noop
    with: {outputs: {word: "`+mark+`"}}
`), 0o644))
	env := append(os.Environ(),
		codec.EnvKeys+"=k1:"+base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 32)), codec.EnvKeyID+"=k1")
	queue := "codec-cli-" + t.Name()
	w := exec.Command(bin, "worker", "--address", srv.Address, "--task-queue", queue, "--log-dir", filepath.Join(work, "logs"))
	w.Env = env
	var wout bytes.Buffer
	w.Stdout, w.Stderr = &wout, &wout
	require.NoError(t, w.Start())
	t.Cleanup(func() { _ = w.Process.Kill(); _, _ = w.Process.Wait() })

	run := exec.Command(bin, "run", specPath, "--address", srv.Address, "--task-queue", queue, "--wait", "--id", "codec-cli-run")
	run.Env = env
	out, err := run.CombinedOutput()
	require.NoError(t, err, "rlflow run:\n%s\nworker:\n%s", out, wout.String())

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	plain, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer plain.Close()
	require.Contains(t, string(out), mark, "the key holder's CLI prints the output in plain")
	for _, id := range []string{"codec-cli-run", workflows.IterationWorkflowID("codec-cli-run", 1)} {
		for _, ev := range history(ctx, t, plain, id) {
			b, err := proto.Marshal(ev)
			require.NoError(t, err)
			assert.NotContains(t, string(b), mark, "%s event %d holds the output in plain", id, ev.GetEventId())
		}
	}
}
