package activities

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm/double"
)

func TestGenerateTwoServers(t *testing.T) {
	ctx := context.Background()
	d1 := newDouble(t, double.Config{DevMode: true, Seed: 1})
	d2 := newDouble(t, double.Config{DevMode: true, Seed: 1}) // the same weights, as in a real fleet
	// The weight version comes from GET /weight_info.
	for _, d := range []*testDouble{d1, d2} {
		c, err := New(Deps{}).client(pipelines.Server{URL: d.URL}, vllmTimeouts())
		require.NoError(t, err)
		require.NoError(t, c.UpdateWeightVersion(ctx, "v7"))
	}
	a := newActivities(t)
	sc := stepContext(t, "rollout", d1, d2)
	writeLines(t, sc.BaseDir, "prompts.jsonl", promptLines(10)...)
	seed := 5
	out, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: "prompts.jsonl", N: 3, MaxTokens: 8, Seed: &seed, Logprobs: 2, Concurrency: 4})
	require.NoError(t, err)

	assert.Equal(t, filepath.Join(a.DataDir, "run-1", "iter-2", "rollout", "rollouts.jsonl"), out.Path)
	assert.Equal(t, 10, out.Prompts)
	assert.Equal(t, 30, out.Samples)
	assert.Equal(t, "v7", out.WeightVersion)
	assert.Equal(t, WeightCheckVersion, out.WeightCheck)
	assert.Zero(t, out.Resumed)
	assert.Positive(t, out.TokensPerS)
	rows := readRollouts(t, out.Path)
	require.Len(t, rows, 30)
	var tokens int64
	for i, r := range rows {
		assert.Equal(t, fmt.Sprintf("p%d", i/3), r.PromptID, "prompt order")
		if assert.NotNil(t, r.Prompt, "the row carries its prompt") {
			assert.Equal(t, fmt.Sprintf("prompt number %d: ", i/3), *r.Prompt)
		}
		assert.Nil(t, r.Messages)
		assert.Equal(t, i%3, r.Sample)
		assert.NotEmpty(t, r.FinishReason)
		assert.Equal(t, len(fmt.Sprintf("prompt number %d: ", i/3)), r.PromptTokens)
		assert.Len(t, r.Logprobs, r.CompletionTokens, "one logprob per token")
		assert.Equal(t, "v7", r.WeightVersion)
		tokens += int64(r.CompletionTokens)
	}
	assert.Equal(t, tokens, out.CompletionTokens)
	// Round robin: both servers served half the samples.
	assert.Equal(t, 15, d1.Stats().Completions)
	assert.Equal(t, 15, d2.Stats().Completions)
	_, err = os.Stat(out.Path + ".partial")
	assert.True(t, os.IsNotExist(err), "the partial file is removed")

	// Seeds are per sample: the same step again gives the same texts.
	again, err := a.Generate(ctx, GenerateInput{Context: sc, Prompts: "prompts.jsonl", N: 3, MaxTokens: 8, Seed: &seed, Output: "again.jsonl"})
	require.NoError(t, err)
	for i, r := range readRollouts(t, again.Path) {
		assert.Equal(t, rows[i].Text, r.Text)
		assert.Nil(t, r.Logprobs)
	}
}

func TestGenerateBadPrompts(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	cases := []struct {
		name  string
		lines []string
		want  string
	}{
		{"not json", []string{`{"prompt": "a"}`, `{"prompt": `}, "prompts.jsonl:2: not a JSON object"},
		{"no prompt", []string{`{"id": 1, "text": "a"}`}, `prompts.jsonl:1: needs "prompt" (a string) or "messages"`},
		{"both", []string{`{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}`}, "prompts.jsonl:1: has both prompt and messages"},
		{"prompt not string", []string{``, `{"prompt": 3}`}, "prompts.jsonl:2: prompt must be a string, got 3"},
		{"empty prompt", []string{`{"prompt": ""}`}, "prompts.jsonl:1: prompt is empty"},
		{"bad messages", []string{`{"messages": []}`}, "prompts.jsonl:1: messages must be a non-empty list"},
		{"bad role", []string{`{"messages": [{"content": "x"}]}`}, "prompts.jsonl:1: messages[0].role must be a non-empty string"},
		{"bad content", []string{`{"messages": [{"role": "user", "content": [1]}]}`}, "prompts.jsonl:1: messages[0].content must be a string"},
		{"bad id", []string{`{"id": {}, "prompt": "a"}`}, "prompts.jsonl:1: id must be a non-empty string or a number"},
		{"duplicate id", []string{`{"id": "x", "prompt": "a"}`, `{"id": "x", "prompt": "b"}`}, `prompts.jsonl:2: id "x" repeats line 1`},
		{"implicit id clash", []string{`{"id": "2", "prompt": "a"}`, `{"prompt": "b"}`}, `prompts.jsonl:2: id "2" repeats line 1`},
		{"empty", []string{``}, "prompts.jsonl: no prompts"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sc := stepContext(t, "g", d)
			writeLines(t, sc.BaseDir, "prompts.jsonl", c.lines...)
			_, err := newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: "prompts.jsonl"})
			assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
			assert.Contains(t, err.Error(), filepath.Join(sc.BaseDir, c.want))
		})
	}
	assert.Zero(t, d.Stats().Requests["POST /v1/completions"], "nothing is sent for a bad file")

	sc := stepContext(t, "g", d)
	_, err := newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: "missing.jsonl"})
	assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
	assert.ErrorContains(t, err, "missing.jsonl: no such file")
}

func TestGenerateChatAndImplicitIDs(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	sc := stepContext(t, "g", d)
	writeLines(t, sc.BaseDir, "chat.jsonl",
		`{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], "meta": {"ignored": true}}`,
		``,
		`{"id": 42, "prompt": "plain"}`)
	out, err := newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: "chat.jsonl", MaxTokens: 4, Logprobs: 1})
	require.NoError(t, err)
	rows := readRollouts(t, out.Path)
	require.Len(t, rows, 2)
	assert.Equal(t, "1", rows[0].PromptID, "no id: the line number")
	assert.Equal(t, "42", rows[1].PromptID)
	// Each row carries its prompt as the prompts file gave it.
	assert.Nil(t, rows[0].Prompt)
	assert.Equal(t, []ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hello"}}, rows[0].Messages)
	if assert.NotNil(t, rows[1].Prompt) {
		assert.Equal(t, "plain", *rows[1].Prompt)
	}
	assert.Nil(t, rows[1].Messages)
	assert.Equal(t, len("be brief\nhello\n"), rows[0].PromptTokens, "the double's chat template")
	assert.Len(t, rows[0].Logprobs, rows[0].CompletionTokens)
	st := d.Stats()
	assert.Equal(t, 1, st.Requests["POST /v1/chat/completions"])
	assert.Equal(t, 1, st.Requests["POST /v1/completions"])
}

func TestGenerateErrors(t *testing.T) {
	ok := newDouble(t, double.Config{DevMode: true})
	keyed := newDouble(t, double.Config{DevMode: true, APIKey: "sekret"})
	short := newDouble(t, double.Config{DevMode: true, MaxModelLen: 20})
	failing := newDouble(t, double.Config{DevMode: true, Faults: double.Faults{ErrorRate: map[string]float64{"/v1/completions": 1}}})
	conflict := statusServer(t, "/v1/completions", 409, `{"detail": "busy"}`, ok.Handler())
	cases := []struct {
		name    string
		servers []pipelines.Server
		env     map[string]string
		in      GenerateInput
		typ     string
		want    []string
	}{
		{name: "no servers", typ: pipelines.ErrTypeBadInput, want: []string{"generate: the pipeline has no servers"}},
		{name: "api key unset", servers: []pipelines.Server{{URL: keyed.URL, APIKeyEnv: "VLLM_KEY"}}, typ: pipelines.ErrTypeBadInput,
			want: []string{"servers[0] (" + keyed.URL + "): api_key_env names VLLM_KEY, which is not set"}},
		{name: "api key wrong", servers: []pipelines.Server{{URL: keyed.URL, APIKeyEnv: "VLLM_KEY"}}, env: map[string]string{"VLLM_KEY": "nope"},
			typ: pipelines.ErrTypeServerRejected, want: []string{keyed.URL, "GET /v1/models", "HTTP 401", "Unauthorized"}},
		{name: "bad api pin", servers: []pipelines.Server{{URL: ok.URL, API: "Z"}}, typ: pipelines.ErrTypeBadInput, want: []string{`unknown vLLM API generation "Z"`}},
		{name: "400 context length", servers: servers(short), in: GenerateInput{MaxTokens: 16}, typ: pipelines.ErrTypeServerRejected,
			want: []string{"prompts.jsonl:", "sample 0 (type: ServerRejected, retryable: false): vllm " + short.URL, "POST /v1/completions: HTTP 400", "maximum context length is 20"}},
		{name: "404 model", servers: servers(ok), in: GenerateInput{Model: "nope"}, typ: pipelines.ErrTypeServerRejected,
			want: []string{"POST /v1/completions: HTTP 404", "The model `nope` does not exist"}},
		{name: "500", servers: servers(failing), typ: pipelines.ErrTypeServerError,
			want: []string{failing.URL, "POST /v1/completions: HTTP 500", "injected fault"}},
		{name: "409", servers: []pipelines.Server{{URL: conflict}}, typ: pipelines.ErrTypeServerError, want: []string{"HTTP 409: busy"}},
		{name: "bad n", servers: servers(ok), in: GenerateInput{N: -1}, typ: pipelines.ErrTypeBadInput, want: []string{"generate: n: -1 is out of range 1..1024"}},
		{name: "bad concurrency", servers: servers(ok), in: GenerateInput{Concurrency: pipelines.MaxConcurrency + 1}, typ: pipelines.ErrTypeBadInput, want: []string{"generate: concurrency: 1025 is out of range 1..1024"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := newActivities(t)
			a.Getenv = func(k string) string { return c.env[k] }
			in := c.in
			in.Context = pipelines.StepContext{RunID: "r", StepID: "g", BaseDir: t.TempDir(), Servers: c.servers}
			in.Prompts = writeLines(t, in.Context.BaseDir, "prompts.jsonl", promptLines(2)...)
			_, err := a.Generate(context.Background(), in)
			assert.Equal(t, c.typ, errType(t, err), "%v", err)
			for _, w := range c.want {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
	// A transient failure is retried within the attempt before it fails it
	// (two prompts in flight: each is tried at most 1+transientRetries times).
	faults := failing.Stats().Faults["error"]
	assert.GreaterOrEqual(t, faults, 1+transientRetries)
	assert.LessOrEqual(t, faults, 2*(1+transientRetries))
}

func TestGenerateAPIKeyFromWorkerEnv(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true, APIKey: "sekret"})
	a := newActivities(t)
	a.Getenv = func(k string) string { return map[string]string{"VLLM_KEY": "sekret"}[k] }
	sc := pipelines.StepContext{RunID: "r", StepID: "g", BaseDir: t.TempDir(), Servers: []pipelines.Server{{URL: d.URL, APIKeyEnv: "VLLM_KEY", API: "d"}}}
	out, err := a.Generate(context.Background(), GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(3)...)})
	require.NoError(t, err)
	assert.Equal(t, 3, out.Samples)
}

// Servers without weight versions: generation B (no /weight_info) and a
// server without dev mode (no RLHF routes at all) report none; they are
// checked by their process start time (GET /metrics), and a server that
// exports none cannot be checked at all.
func TestGenerateWithoutWeightVersions(t *testing.T) {
	b := newDouble(t, double.Config{DevMode: true, Generation: double.GenB})
	plain := newDouble(t, double.Config{})
	c := newDouble(t, double.Config{DevMode: true, Generation: double.GenC})
	sc := stepContext(t, "g", b, plain, c)
	out, err := newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(6)...), MaxTokens: 4})
	require.NoError(t, err)
	assert.Equal(t, "", out.WeightVersion)
	assert.Equal(t, WeightCheckStartTime, out.WeightCheck, "B and the plain server give only their start time")
	for _, d := range []*testDouble{b, plain, c} {
		assert.Equal(t, 2, d.Stats().Completions, "round robin over three servers")
		assert.GreaterOrEqual(t, d.Stats().Requests["GET /metrics"], 2, "checked at the start and the end")
	}
	assert.GreaterOrEqual(t, c.Stats().Requests["GET /weight_info"], 2, "C has versions (none yet): checked at the start and the end")
	assert.Zero(t, b.Stats().Requests["GET /weight_info"], "B has no route: not asked")

	blind := statusServer(t, "/metrics", 404, `{"detail":"Not Found"}`, plain.Handler())
	sc.Servers = []pipelines.Server{{URL: blind}, {URL: c.URL}}
	out, err = newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: "p.jsonl", MaxTokens: 4})
	require.NoError(t, err)
	assert.Equal(t, WeightCheckNone, out.WeightCheck, "a server without versions or /metrics cannot be checked")
	sc.Servers = servers(c)
	out, err = newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: "p.jsonl", MaxTokens: 4})
	require.NoError(t, err)
	assert.Equal(t, WeightCheckVersion, out.WeightCheck)
}

func TestGenerateOutputNotWritable(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	sc := stepContext(t, "g", d)
	writeLines(t, sc.BaseDir, "file.txt", "x")
	_, err := newActivities(t).Generate(context.Background(), GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(1)...), Output: "file.txt/out.jsonl"})
	assert.Equal(t, pipelines.ErrTypeIO, errType(t, err))
	assert.ErrorContains(t, err, "generate: creating the output dir")

	a := New(Deps{})
	_, err = a.Generate(context.Background(), GenerateInput{Context: sc, Prompts: "p.jsonl"})
	assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
	assert.ErrorContains(t, err, "no output path: set with.output, or give the worker a data dir")
}
