package double

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// Weight checker actions (POST /weight_checker).
const (
	checkChecksum = "checksum"
	checkReset    = "reset"
	checkCompare  = "compare"
)

// shardKeys are the weight checker's keys for the one tensor, one per
// worker shard as vLLM names them: dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}.
// The double has no pipeline or context parallelism (pp = pcp = 0).
func (s *Server) shardKeys() []string {
	keys := make([]string, 0, s.cfg.DataParallel*s.cfg.WorldSize)
	for dp := range s.cfg.DataParallel {
		for tp := range s.cfg.WorldSize {
			keys = append(keys, fmt.Sprintf("dp%d:pp0:pcp0:tp%d:%s", dp, tp, bigram.TensorName))
		}
	}
	return keys
}

// checksums are the current weights' SHA-256 digests per shard key. Every
// worker of the double holds the whole table (it has one model and does
// not shard it), so every key has the same digest; a real TP worker's
// digest covers its shard only.
func (s *Server) checksums() map[string]string {
	sum := s.model.Load().Checksum()
	out := map[string]string{}
	for _, k := range s.shardKeys() {
		out[k] = sum
	}
	return out
}

// zeroWeights are what reset leaves: every logit 0, so sampling is
// uniform over the vocabulary.
func zeroWeights() (*bigram.Model, error) {
	return bigram.FromLogits(make([]float32, bigram.Vocab*bigram.Vocab))
}

// weightChecker serves POST /weight_checker as vLLM's stateless checker:
//
//	{"action": "checksum"}                   -> {"checksums": {key: sha256 hex}}
//	{"action": "reset"}                      -> zeroes every weight; {"status": "reset"}
//	{"action": "compare", "baseline": {...}} -> {"match": bool, "mismatches": [key, ...]}
//
// Invalid requests are 400 on every generation: bad JSON, a non-object
// body, a missing or unknown action, a compare without a baseline object,
// and (the double's strictness; vLLM ignores them) unknown keys. C and D
// answer 409 while generation is paused; E has no such rule.
func (s *Server) weightChecker(w http.ResponseWriter, r *http.Request) {
	action, obj, err := s.checkerRequest(w, r)
	if err != nil {
		fail(w, err)
		return
	}
	// As in vLLM, the pause is checked before the per-action arguments.
	if !s.cfg.Generation.routerValidates() && s.sched.isPaused() {
		errorResponse(w, http.StatusConflict, "weight checker is unavailable while generation is paused; resume first")
		return
	}
	var baseline map[string]any
	if action == checkCompare {
		if json.Unmarshal(obj["baseline"], &baseline) != nil || baseline == nil {
			fail(w, badRequest("action='compare' requires a 'baseline' object (a checksum answer's \"checksums\" map)"))
			return
		}
	}
	switch action {
	case checkChecksum:
		writeJSON(w, http.StatusOK, map[string]any{"checksums": s.checksums()})
	case checkReset:
		m, err := zeroWeights()
		if err != nil {
			fail(w, workerError("RuntimeError: reset weights: %v", err))
			return
		}
		// reset is an engine RPC like an update: it waits for one running.
		s.xferMu.Lock()
		s.model.Store(m)
		s.xferMu.Unlock()
		writeJSON(w, http.StatusOK, map[string]string{"status": "reset"})
	case checkCompare:
		sums := s.checksums()
		var mismatches []string
		for key, sum := range sums {
			if v, ok := baseline[key].(string); !ok || v != sum {
				mismatches = append(mismatches, key)
			}
		}
		for key := range baseline {
			if _, ok := sums[key]; !ok {
				mismatches = append(mismatches, key)
			}
		}
		sort.Strings(mismatches)
		writeJSON(w, http.StatusOK, map[string]any{"match": len(mismatches) == 0, "mismatches": nonNil(mismatches)})
	}
}

// checkerRequest validates a weight checker body but for the baseline
// (every failure a 400).
func (s *Server) checkerRequest(w http.ResponseWriter, r *http.Request) (string, map[string]json.RawMessage, error) {
	body, err := s.readBody(w, r)
	if err != nil {
		return "", nil, err
	}
	if !json.Valid(body) {
		return "", nil, badRequest("Invalid JSON format")
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(body, &obj) != nil || obj == nil {
		return "", nil, badRequest("Expected a JSON object, got %s", pyType(body))
	}
	var action string
	raw, ok := obj["action"]
	switch {
	case !ok || isNull(raw):
		return "", nil, badRequest("Missing 'action' in request body (checksum, reset or compare)")
	case json.Unmarshal(raw, &action) != nil || (action != checkChecksum && action != checkReset && action != checkCompare):
		return "", nil, badRequest("unknown action %s: want checksum, reset or compare", clip(string(raw)))
	}
	if err := onlyKeys(obj, "action", "baseline"); err != nil {
		return "", nil, badRequest("%v", err)
	}
	return action, obj, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
