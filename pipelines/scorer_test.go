package pipelines

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRLHFPipelineWithServersLoads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`version: 1
name: rlhf
servers: [{url: http://localhost:8000}]
weight_transfer: {backend: disk}
steps:
  - {id: rollout, uses: generate, with: {prompts: p.jsonl, n: 2}}
  - {id: pause, uses: pause, needs: [rollout], with: {mode: keep, timeout: 1m}}
  - {id: sync, uses: broadcast, needs: [pause], with: {checkpoint: ckpt}}
  - {id: resume, uses: resume, needs: [sync], always: true}
  - id: eval
    uses: evaluate
    needs: [resume]
    with: {prompts: e.jsonl, scorer: {type: regex, pattern: "answer: (\\d+)", ignore_case: true}}
`), 0o644))
	_, err := LoadFile(path)
	require.NoError(t, err)
}

func TestParseScorer(t *testing.T) {
	s, err := ParseScorer(json.RawMessage(`{"type": "numeric", "tolerance": 0.5}`))
	require.NoError(t, err)
	assert.Equal(t, Scorer{Type: ScorerNumeric, Tolerance: 0.5}, s)
	// The type's defaults are filled in; other types' keys stay zero.
	s, err = ParseScorer(json.RawMessage(`{"type": "judge", "timeout": "5s", "concurrency": 4, "scale": 1}`))
	require.NoError(t, err)
	assert.Equal(t, Scorer{Type: ScorerJudge, Timeout: Duration(5e9), Concurrency: 4, Scale: 1, Rubric: DefaultJudgeRubric, MaxTokens: 16}, s)
	s, err = ParseScorer(json.RawMessage(`{"type": "judge"}`))
	require.NoError(t, err)
	assert.Equal(t, Scorer{Type: ScorerJudge, Timeout: Duration(30e9), Concurrency: 16, Scale: 10, Rubric: DefaultJudgeRubric, MaxTokens: 16}, s)
	s, err = ParseScorer(json.RawMessage(`{"type": "http", "url": "http://score:9000/x"}`))
	require.NoError(t, err)
	assert.Equal(t, Scorer{Type: ScorerHTTP, URL: "http://score:9000/x", Timeout: Duration(30e9), Concurrency: 16}, s)
	s, err = ParseScorer(json.RawMessage(`{"type": "exact_match", "ignore_case": true}`))
	require.NoError(t, err)
	assert.Equal(t, Scorer{Type: ScorerExactMatch, IgnoreCase: true}, s)

	for raw, want := range map[string]string{
		`[]`:                                  "scorer must be an object",
		`null`:                                "scorer must be an object",
		`{"type": "http"}`:                    "scorer: http scorers need url",
		`{"type": "regex", "pattern": "("}`:   "scorer: pattern: bad regular expression",
		`{"type": 3}`:                         "scorer: type must be a string",
		`{"type": "http", "url": "${{ x }}"}`: `scorer: url: "${{ x }}" must be an http:// or https:// URL`,
		`{"type": "contains", "concurrency": 2.5}`: `contains scorers take no "concurrency"`,
		`{"type": "judge", "concurrency": 2.5}`:    "concurrency: must be an integer in 1..1024, got float 2.5",
		`{"type": "judge", "concurrency": 0}`:      "concurrency: 0 is out of range 1..1024; leave it out for the default (16)",
		`{"type": "judge", "scale": -1}`:           "scale: must be > 0, got -1",
		`{"type": "judge", "model": ""}`:           "model: must not be empty",
		`{"type": "judge", "timeout": "0s"}`:       "timeout: must be >= 1ms, got 0s; leave it out for the default (30s)",
		`{"type": "numeric", "tolerance": "x"}`:    `tolerance: must be a number >= 0, got string "x"`,
	} {
		_, err := ParseScorer(json.RawMessage(raw))
		assert.ErrorContains(t, err, want, raw)
	}
}

// TestScorerStructCoversTypes keeps Scorer and the scorer table in step:
// every key of every type has a field of a fitting Go type, with no
// ambiguous zero, and every default is typed and in range.
func TestScorerStructCoversTypes(t *testing.T) {
	keys := map[string]bool{"type": true}
	for _, st := range scorerTypes {
		for _, p := range argsStructProblems("scorer "+st.Name, st.Args, scorerStructType, scorerSkip(&st)) {
			t.Error(p)
		}
		for _, a := range st.Args {
			keys[a.Name] = true
		}
	}
	for _, f := range argFields(scorerStructType) {
		if !keys[f.name] {
			t.Errorf("Scorer field %s (%s) is a key of no scorer type", f.goName, f.name)
		}
	}
}
