package double_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/rlflow/rlflow/vllm/double"
)

// vLLM's protocol models ignore fields they do not know (they log a
// warning); so does the double. Known fields keep their types and ranges.
func TestOpenAIUnknownFieldsIgnored(t *testing.T) {
	s := start(t, double.Config{ModelName: "m"})
	for _, c := range []struct {
		path, body string
		status     int
		want       string
	}{
		{"/v1/completions", `{"model":"m","prompt":"a","max_tokens":2,"bogus":1,"priority":3,"guided_json":{"type":"object"}}`, http.StatusOK, `"object":"text_completion"`},
		{"/v1/completions", `{"model":"m","prompt":"a","max_tokens":2,"nested":{"deep":[1,2,{"x":null}]}}`, http.StatusOK, `"object":"text_completion"`},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi","extra_key":true}],"max_tokens":2,"top_k":5,"unknown":"x"}`, http.StatusOK, `"object":"chat.completion"`},
		{"/v1/completions", `{"model":"m","prompt":"a","bogus":1,"n":"two"}`, http.StatusBadRequest, "invalid request body: n: got a JSON string, want integer"},
		{"/v1/completions", `{"model":"m","prompt":"a","bogus":1,"top_p":2}`, http.StatusBadRequest, "top_p must be in (0, 1], got 2"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":7}],"extra":1}`, http.StatusBadRequest, "invalid request body: messages.role: got a JSON number, want string"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"extra":1}`, http.StatusBadRequest, "messages must not be empty"},
		{"/v1/completions", `{"model":"m","prompt":"a"} {}`, http.StatusBadRequest, "trailing data"},
	} {
		status, body := s.call("POST", c.path, c.body)
		assert.Equal(t, c.status, status, "%s %s: %s", c.path, c.body, body)
		assert.Contains(t, body, c.want, "%s %s", c.path, c.body)
	}
}
