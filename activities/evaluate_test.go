package activities

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/testsuite"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm/double"
)

func TestScorers(t *testing.T) {
	ctx := context.Background()
	type sample struct {
		answer, text string
		want         float64
	}
	cases := []struct {
		scorer  string
		samples []sample
	}{
		{`{"type": "exact_match"}`, []sample{{`"42"`, " 42\n", 1}, {`"Paris"`, "paris", 0}, {`7`, "7", 1}, {`"a"`, "a b", 0}}},
		{`{"type": "exact_match", "ignore_case": true}`, []sample{{`"Paris"`, " PARIS ", 1}, {`"Paris"`, "Lyon", 0}}},
		{`{"type": "contains"}`, []sample{{`"Paris"`, "It is Paris.", 1}, {`"Paris"`, "it is paris", 0}, {`12`, "x=123", 1}}},
		{`{"type": "contains", "ignore_case": true}`, []sample{{`"Paris"`, "it is paris", 1}}},
		{`{"type": "regex", "pattern": "answer: (\\w+)"}`, []sample{{`"B"`, "so the answer: B", 1}, {`"B"`, "answer: C", 0}, {`"B"`, "no idea", 0}}},
		{`{"type": "regex", "pattern": "ANSWER: (\\w+)", "ignore_case": true}`, []sample{{`"b"`, "answer: B", 1}}},
		{`{"type": "regex", "pattern": "^\\d+$"}`, []sample{{`"x"`, "123", 1}, {`"x"`, "12a", 0}}},
		{`{"type": "numeric"}`, []sample{{`42`, "first 7, then 42", 1}, {`"42"`, "42.0", 1}, {`42`, "41.9", 0}, {`1234.5`, "total 1,234.5 units", 1}, {`-3`, "x = -3", 1}, {`5`, "none", 0}, {`0.5`, "half is .5", 1}}},
		{`{"type": "numeric", "tolerance": 0.2}`, []sample{{`42`, "41.9", 1}, {`42`, "41.7", 0}, {`6e2`, "600", 1}}},
	}
	for _, c := range cases {
		t.Run(c.scorer, func(t *testing.T) {
			spec, err := pipelines.ParseScorer(json.RawMessage(c.scorer))
			require.NoError(t, err)
			g := &genRun{set: &promptSet{path: "e.jsonl"}}
			for i, s := range c.samples {
				g.set.prompts = append(g.set.prompts, prompt{line: i + 1, id: fmt.Sprint(i), text: "q", answer: json.RawMessage(s.answer)})
			}
			score, err := newActivities(t).newScorer(ctx, g, spec)
			require.NoError(t, err)
			for i, s := range c.samples {
				r := Rollout{Text: s.text}
				require.NoError(t, score(ctx, &g.set.prompts[i], &r))
				require.NotNil(t, r.Score)
				assert.Equal(t, s.want, *r.Score, "answer %s, text %q", s.answer, s.text)
			}
		})
	}
}

// evalSet writes an eval set whose answers are the double's greedy
// completions for p0 and p1 (so exact_match scores them 1) and wrong for
// p2 and p3.
func evalSet(t *testing.T, a *Activities, sc pipelines.StepContext) string {
	t.Helper()
	zero := 0.0
	writeLines(t, sc.BaseDir, "q.jsonl", promptLines(4)...)
	out, err := a.Generate(context.Background(), GenerateInput{Context: sc, Prompts: "q.jsonl", MaxTokens: 6, Temperature: &zero, Output: "greedy.jsonl"})
	require.NoError(t, err)
	rows := readRollouts(t, out.Path)
	lines := make([]string, 4)
	for i, r := range rows {
		answer, _ := json.Marshal(r.Text)
		if i >= 2 {
			answer = []byte(`"not this"`)
		}
		lines[i] = fmt.Sprintf(`{"id": "p%d", "prompt": "prompt number %d: ", "answer": %s}`, i, i, answer)
	}
	return writeLines(t, sc.BaseDir, "eval.jsonl", lines...)
}

func TestEvaluateExactMatch(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	a := newActivities(t)
	sc := stepContext(t, "eval", d)
	zero := 0.0
	in := EvaluateInput{GenerateInput: GenerateInput{Context: sc, Prompts: evalSet(t, a, sc), MaxTokens: 6, Temperature: &zero, N: 2},
		Scorer: json.RawMessage(`{"type": "exact_match"}`)}
	out, err := a.Evaluate(context.Background(), in)
	require.NoError(t, err)
	assert.Equal(t, 0.5, out.Score)
	assert.Equal(t, 8, out.Samples)
	assert.Equal(t, 0.0, out.Min)
	assert.Equal(t, 1.0, out.Max)
	assert.Zero(t, out.Unparsed)
	assert.Equal(t, a.DataDir+"/run-1/iter-2/eval/scores.jsonl", out.Path)
	rows := readRollouts(t, out.Path)
	require.Len(t, rows, 8)
	for i, r := range rows {
		assert.Equal(t, fmt.Sprintf("p%d", i/2), r.PromptID)
		require.NotNil(t, r.Score)
		assert.Equal(t, float64(boolInt(i < 4)), *r.Score)
		assert.NotEmpty(t, r.Answer)
	}
	// The output is JSON numbers `when` and `until` can compare.
	b, err := json.Marshal(out)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"score":0.5`)
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestEvaluateBadInput(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	cases := []struct {
		name, scorer string
		lines        []string
		want         string
	}{
		{"no scorer", ``, []string{`{"prompt": "a", "answer": "b"}`}, "evaluate: scorer: is required"},
		{"unknown type", `{"type": "bleu"}`, []string{`{"prompt": "a", "answer": "b"}`}, `unknown scorer type "bleu"`},
		{"bad regex", `{"type": "regex", "pattern": "(("}`, []string{`{"prompt": "a", "answer": "b"}`}, "bad regular expression"},
		{"no answer", `{"type": "exact_match"}`, []string{`{"prompt": "a", "answer": "b"}`, `{"prompt": "c"}`}, `e.jsonl:2: has no "answer"`},
		{"answer object", `{"type": "exact_match"}`, []string{`{"prompt": "a", "answer": {"x": 1}}`}, `e.jsonl:1: answer must be a string or a number`},
		{"numeric answer not a number", `{"type": "numeric"}`, []string{`{"prompt": "a", "answer": 3}`, `{"prompt": "b", "answer": "three"}`}, `e.jsonl:2: answer "three" is not a number`},
		{"http key unset", `{"type": "http", "url": "http://127.0.0.1:1/score", "api_key_env": "SCORER_KEY"}`, []string{`{"prompt": "a", "answer": "b"}`}, "api_key_env names SCORER_KEY, which is not set"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sc := stepContext(t, "eval", d)
			in := EvaluateInput{GenerateInput: GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "e.jsonl", c.lines...)}, Scorer: json.RawMessage(c.scorer)}
			_, err := newActivities(t).Evaluate(context.Background(), in)
			assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
			assert.ErrorContains(t, err, c.want)
		})
	}
	assert.Zero(t, d.Stats().Requests["POST /v1/completions"], "nothing generated for a bad step")
}

// scoreServer is an http scorer: score = len(completion) / 100, checking
// the request's shape and bearer token; fail answers the first calls with it.
func scoreServer(t *testing.T, key string, fail func(n int64) (int, string)) (string, *atomic.Int64) {
	var calls atomic.Int64
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		if status, body := fail(n); status != 0 {
			w.WriteHeader(status)
			_, _ = io.WriteString(w, body)
			return
		}
		if key != "" && r.Header.Get("Authorization") != "Bearer "+key {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		var req struct {
			Prompt, Completion, ID string
			Answer                 json.RawMessage
		}
		dec := json.NewDecoder(r.Body)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil || req.ID == "" || len(req.Answer) == 0 || !strings.HasPrefix(req.Prompt, "prompt number") {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, "bad request %v", err)
			return
		}
		fmt.Fprintf(w, `{"score": %v}`, float64(len(req.Completion))/100)
	}))
	t.Cleanup(hs.Close)
	return hs.URL + "/score", &calls
}

func TestEvaluateHTTPScorer(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	never := func(int64) (int, string) { return 0, "" }
	flaky := func(n int64) (int, string) {
		if n <= 2 {
			return http.StatusServiceUnavailable, "warming up"
		}
		return 0, ""
	}
	cases := []struct {
		name string
		fail func(int64) (int, string)
		typ  string
		want string
	}{
		{"ok", never, "", ""},
		{"transient 503s are retried", flaky, "", ""},
		{"500", func(int64) (int, string) { return 500, "boom" }, pipelines.ErrTypeServerError, "HTTP 500: boom"},
		{"400 is final", func(int64) (int, string) { return 400, "no" }, pipelines.ErrTypeServerRejected, "HTTP 400: no"},
		{"no score", func(int64) (int, string) { return 200, `{"value": 1}` }, pipelines.ErrTypeServerRejected, `has no numeric "score"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			url, calls := scoreServer(t, "k", c.fail)
			a := newActivities(t)
			a.Getenv = func(string) string { return "k" }
			sc := stepContext(t, "eval", d)
			lines := []string{`{"id": "a", "prompt": "prompt number 1", "answer": 1}`, `{"id": "b", "prompt": "prompt number 2", "answer": "x"}`}
			in := EvaluateInput{GenerateInput: GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "e.jsonl", lines...), MaxTokens: 5, N: 2},
				Scorer: json.RawMessage(fmt.Sprintf(`{"type": "http", "url": %q, "api_key_env": "SCORER_KEY", "concurrency": 2, "timeout": "5s"}`, url))}
			out, err := a.Evaluate(context.Background(), in)
			if c.typ != "" {
				assert.Equal(t, c.typ, errType(t, err))
				assert.ErrorContains(t, err, "evaluate: http scorer "+url+": prompt ")
				assert.ErrorContains(t, err, c.want)
				return
			}
			require.NoError(t, err)
			rows := readRollouts(t, out.Path)
			sum := 0.0
			for _, r := range rows {
				assert.Equal(t, float64(len(r.Text))/100, *r.Score)
				sum += *r.Score
			}
			assert.InDelta(t, sum/4, out.Score, 1e-12)
			assert.GreaterOrEqual(t, calls.Load(), int64(4))
		})
	}
}

// judgeServer is an OpenAI chat server whose reply depends on the prompt id
// in the rubric.
func judgeServer(t *testing.T, replies map[string]string) string {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/models":
			_, _ = io.WriteString(w, `{"object": "list", "data": [{"id": "judge-model", "object": "model"}]}`)
		case "/v1/chat/completions":
			var req struct {
				Model    string
				Messages []struct{ Content string }
			}
			_ = json.NewDecoder(r.Body).Decode(&req)
			reply := "?"
			for k, v := range replies {
				if strings.Contains(req.Messages[0].Content, "Prompt: "+k+"\n") {
					reply = v
				}
			}
			if req.Model != "judge-model" {
				w.WriteHeader(404)
				return
			}
			b, _ := json.Marshal(reply)
			fmt.Fprintf(w, `{"id": "x", "object": "chat.completion", "model": "judge-model", "choices": [{"index": 0, "message": {"role": "assistant", "content": %s}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}`, b)
		default:
			w.WriteHeader(404)
		}
	}))
	t.Cleanup(hs.Close)
	return hs.URL
}

func TestEvaluateJudge(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	url := judgeServer(t, map[string]string{"q1": "8/10, good", "q2": "Score: 0.5", "q3": "I would say it is great", "q4": "11"})
	a := newActivities(t)
	sc := stepContext(t, "eval", d)
	var lines []string
	for i := 1; i <= 4; i++ {
		lines = append(lines, fmt.Sprintf(`{"id": "%d", "prompt": "q%d", "answer": "a"}`, i, i))
	}
	in := EvaluateInput{GenerateInput: GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "e.jsonl", lines...), MaxTokens: 3},
		Scorer: json.RawMessage(fmt.Sprintf(`{"type": "judge", "url": %q, "rubric": "Prompt: {prompt}\nAnswer: {answer}\nResponse: {completion}\nRate 0-10."}`, url))}
	out, err := a.Evaluate(context.Background(), in)
	require.NoError(t, err)
	rows := readRollouts(t, out.Path)
	want := []float64{0.8, 0.05, 0, 0}
	for i, r := range rows {
		assert.InDelta(t, want[i], *r.Score, 1e-12, "row %d", i)
		assert.Equal(t, i >= 2, r.Unparsed, "row %d", i)
	}
	assert.Equal(t, 2, out.Unparsed)
	assert.InDelta(t, 0.85/4, out.Score, 1e-12)
	assert.Equal(t, 0.0, out.Min)
	assert.Equal(t, 0.8, out.Max)

	// scale 1: "0.5" is 0.5; the judge on the pipeline's own servers
	// (the double) answers with nonsense: unparsed or a number, never an error.
	in.Scorer = json.RawMessage(fmt.Sprintf(`{"type": "judge", "url": %q, "scale": 1, "rubric": "Prompt: {prompt}\n"}`, url))
	in.Output = "scale1.jsonl"
	out, err = a.Evaluate(context.Background(), in)
	require.NoError(t, err)
	assert.InDelta(t, 0.5, *readRollouts(t, out.Path)[1].Score, 1e-12)
	in.Scorer, in.Output = json.RawMessage(`{"type": "judge"}`), "self.jsonl"
	out, err = a.Evaluate(context.Background(), in)
	require.NoError(t, err)
	assert.Equal(t, 4, out.Samples)
	assert.Equal(t, 4, d.Stats().Requests["POST /v1/chat/completions"], "the judge asked the pipeline's server")
}

// The interpreter calls activities by step type name with the rendered
// `with` map plus "context": the inputs must decode from that shape.
func TestEvaluateFromInterpreterArgs(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	a := newActivities(t)
	sc := stepContext(t, "eval", d)
	writeLines(t, sc.BaseDir, "e.jsonl", `{"prompt": "2+2=", "answer": 4}`)
	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(a.Evaluate, activity.RegisterOptions{Name: pipelines.StepEvaluate})
	val, err := env.ExecuteActivity(pipelines.StepEvaluate, map[string]any{
		pipelines.ContextArg: sc, "prompts": "e.jsonl", "n": int64(3), "temperature": 0.5, "max_tokens": int64(4),
		"request_timeout": "30s", "stop": []any{"\n"}, "scorer": map[string]any{"type": "numeric", "tolerance": 0.5},
	})
	require.NoError(t, err)
	var out map[string]any
	require.NoError(t, val.Get(&out))
	assert.Equal(t, 3.0, out["samples"])
	assert.Contains(t, out, "score")
	assert.Equal(t, 1.0, out[pipelines.MetaAttempt])
}
