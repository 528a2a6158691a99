package double_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
)

type checkerAnswer struct {
	Checksums  map[string]string `json:"checksums"`
	Status     string            `json:"status"`
	Match      *bool             `json:"match"`
	Mismatches []string          `json:"mismatches"`
}

func (s *testServer) checker(body string) checkerAnswer {
	s.t.Helper()
	var a checkerAnswer
	require.NoError(s.t, json.Unmarshal([]byte(s.ok("POST", "/weight_checker", body)), &a))
	return a
}

// The checker keys one digest per worker shard (dp:pp:pcp:tp:name),
// compares against a baseline map the caller holds, and reset zeroes the
// weights.
func TestWeightChecker(t *testing.T) {
	for _, gen := range []double.Generation{double.GenC, double.GenD, double.GenE} {
		s := start(t, double.Config{Generation: gen, DevMode: true, WorldSize: 2, DataParallel: 3, Seed: 4})
		sum := s.Model().Checksum()
		got := s.checker(`{"action":"checksum"}`)
		assert.Equal(t, map[string]string{
			"dp0:pp0:pcp0:tp0:bigram.logits": sum, "dp0:pp0:pcp0:tp1:bigram.logits": sum,
			"dp1:pp0:pcp0:tp0:bigram.logits": sum, "dp1:pp0:pcp0:tp1:bigram.logits": sum,
			"dp2:pp0:pcp0:tp0:bigram.logits": sum, "dp2:pp0:pcp0:tp1:bigram.logits": sum,
		}, got.Checksums, "gen %s", gen)
		baseline, err := json.Marshal(got.Checksums)
		require.NoError(t, err)

		cmp := s.checker(`{"action":"compare","baseline":` + string(baseline) + `}`)
		require.NotNil(t, cmp.Match)
		assert.True(t, *cmp.Match)
		assert.Equal(t, []string{}, cmp.Mismatches)

		cmp = s.checker(`{"action":"compare","baseline":{"dp0:pp0:pcp0:tp0:bigram.logits":"00","dp0:pp0:pcp0:tp1:bigram.logits":"` + sum +
			`","dp1:pp0:pcp0:tp0:bigram.logits":"` + sum + `","dp1:pp0:pcp0:tp1:bigram.logits":"` + sum +
			`","dp2:pp0:pcp0:tp0:bigram.logits":"` + sum + `","dp2:pp0:pcp0:tp1:bigram.logits":7,"dp9:pp0:pcp0:tp0:x":"` + sum + `"}}`)
		assert.False(t, *cmp.Match)
		assert.Equal(t, []string{"dp0:pp0:pcp0:tp0:bigram.logits", "dp2:pp0:pcp0:tp1:bigram.logits", "dp9:pp0:pcp0:tp0:x"}, cmp.Mismatches)

		// The baseline is the checksums map: a whole checksum answer is
		// read as a map with the one key "checksums", as vLLM reads it.
		whole := s.ok("POST", "/weight_checker", `{"action":"checksum"}`)
		cmp = s.checker(`{"action":"compare","baseline":` + whole + `}`)
		assert.False(t, *cmp.Match)
		assert.Contains(t, cmp.Mismatches, "checksums")

		// reset zeroes every weight: the served table is all-zero logits.
		assert.JSONEq(t, `{"status":"reset"}`, s.ok("POST", "/weight_checker", `{"action":"reset"}`))
		for i, v := range s.Model().Logits() {
			require.Zero(t, v, "logit %d", i)
		}
		zero, err := bigram.FromLogits(make([]float32, bigram.Vocab*bigram.Vocab))
		require.NoError(t, err)
		assert.Equal(t, zero.Checksum(), s.checker(`{"action":"checksum"}`).Checksums["dp1:pp0:pcp0:tp1:bigram.logits"])
		assert.False(t, *s.checker(`{"action":"compare","baseline":` + string(baseline) + `}`).Match)
		assert.JSONEq(t, `{"weight_version":null}`, s.ok("GET", "/weight_info", ""), "reset is no weight update")
	}
}

func TestWeightCheckerRequests(t *testing.T) {
	rows := []struct {
		body string
		msg  string
	}{
		{`not json`, "Invalid JSON format"},
		{``, "Invalid JSON format"},
		{`[]`, "Expected a JSON object, got list"},
		{`{}`, "Missing 'action' in request body (checksum, reset or compare)"},
		{`{"action":"bogus"}`, `unknown action "bogus": want checksum, reset or compare`},
		{`{"action":3}`, `unknown action 3: want checksum, reset or compare`},
		{`{"action":"checksum","extra":1}`, "unexpected key(s) 'extra'"},
		{`{"action":"compare"}`, "action='compare' requires a 'baseline' object"},
		{`{"action":"compare","baseline":[1]}`, "action='compare' requires a 'baseline' object"},
		{`{"action":"compare","baseline":"x"}`, "action='compare' requires a 'baseline' object"},
	}
	for _, gen := range []double.Generation{double.GenC, double.GenD, double.GenE} {
		s := start(t, double.Config{Generation: gen, DevMode: true})
		for _, r := range rows {
			status, body := s.call("POST", "/weight_checker", r.body)
			assert.Equal(t, http.StatusBadRequest, status, "gen %s %s: %s", gen, r.body, body)
			assert.Contains(t, errorMessage(t, body), r.msg, "gen %s %s", gen, r.body)
		}

		// C and D refuse every action while paused (409); E has no such rule.
		s.ok("POST", "/pause?mode=keep", "")
		for _, body := range []string{`{"action":"checksum"}`, `{"action":"reset"}`, `{"action":"compare"}`} {
			status, out := s.call("POST", "/weight_checker", body)
			if gen == double.GenE {
				assert.NotEqual(t, http.StatusConflict, status, "%s: %s", body, out)
				continue
			}
			assert.Equal(t, http.StatusConflict, status, "gen %s %s", gen, body)
			assert.Contains(t, out, "weight checker is unavailable while generation is paused; resume first")
		}
		s.ok("POST", "/resume", "")
	}

	for _, gen := range []double.Generation{double.GenD, double.GenE} {
		s := start(t, double.Config{Generation: gen, DevMode: true, NoWeightChecker: true})
		status, body := s.call("POST", "/weight_checker", `{"action":"checksum"}`)
		assert.Equal(t, http.StatusNotFound, status, "a router without the checker")
		assert.JSONEq(t, `{"detail":"Not Found"}`, body)
	}
}

// errorMessage is the message of vLLM's ErrorResponse body.
func errorMessage(t *testing.T, body string) string {
	t.Helper()
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &e), body)
	return e.Error.Message
}
