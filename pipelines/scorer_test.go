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
	s, err = ParseScorer(json.RawMessage(`{"type": "judge", "timeout": "5s", "concurrency": 4, "scale": 1}`))
	require.NoError(t, err)
	assert.Equal(t, Scorer{Type: ScorerJudge, Timeout: Duration(5e9), Concurrency: 4, Scale: 1}, s)

	for raw, want := range map[string]string{
		`[]`:                                  "scorer must be an object",
		`null`:                                "scorer must be an object",
		`{"type": "http"}`:                    "scorer: http scorers need url",
		`{"type": "regex", "pattern": "("}`:   "scorer: pattern: bad regular expression",
		`{"type": 3}`:                         "scorer: type must be a string",
		`{"type": "http", "url": "${{ x }}"}`: `scorer: url: "${{ x }}" must be an http:// or https:// URL`,
		`{"type": "contains", "concurrency": 2.5}`: `contains scorers take no "concurrency"`,
		`{"type": "judge", "concurrency": 2.5}`:    "concurrency: must be an integer in 1..1024",
	} {
		_, err := ParseScorer(json.RawMessage(raw))
		assert.ErrorContains(t, err, want, raw)
	}
}
