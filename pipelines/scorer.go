package pipelines

import (
	"encoding/json"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"sort"
	"strings"
)

// Scorer is evaluate's `scorer` object. ScorerProblems checks it, at load
// time (rlflow validate) and again in the activity on the rendered values.
type Scorer struct {
	Type string `json:"type"`
	// IgnoreCase: exact_match, contains, regex.
	IgnoreCase bool `json:"ignore_case,omitempty"`
	// Pattern (regex, required): with a capture group, the first group of
	// the first match is compared with the answer; without one, any match
	// scores 1.
	Pattern string `json:"pattern,omitempty"`
	// Tolerance (numeric): the last number in the completion scores 1 when
	// |x - answer| <= tolerance (default 0: equal values).
	Tolerance float64 `json:"tolerance,omitempty"`
	// URL: http (required) is POSTed {prompt, completion, answer, id} and
	// answers {"score": number}; judge (optional) is an OpenAI-compatible
	// server to ask instead of the pipeline's servers.
	URL       string `json:"url,omitempty"`
	APIKeyEnv string `json:"api_key_env,omitempty"`
	// Concurrency bounds the requests in flight to the scorer (http, judge;
	// default 16).
	Concurrency int `json:"concurrency,omitempty"`
	// Timeout bounds one scoring request (http, judge; default 30s).
	Timeout Duration `json:"timeout,omitempty"`
	// Rubric (judge) is the message sent to the judge; {prompt},
	// {completion} and {answer} are replaced. Default: DefaultJudgeRubric.
	Rubric string `json:"rubric,omitempty"`
	// Scale (judge): the judge's first number in [0, scale] is divided by
	// scale (default 10; 1 for a rubric that asks for 0..1).
	Scale     float64 `json:"scale,omitempty"`
	Model     string  `json:"model,omitempty"`      // judge: default the server's first model
	MaxTokens int     `json:"max_tokens,omitempty"` // judge: default 16
}

// DefaultJudgeRubric asks for a 0-10 rating (Scale 10).
const DefaultJudgeRubric = "Rate how well the response answers the prompt, compared with the reference answer, " +
	"on a scale from 0 (wrong) to 10 (fully correct). Reply with the number only.\n\n" +
	"Prompt:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{completion}\n\nRating:"

// Scorer types.
const (
	ScorerExactMatch = "exact_match"
	ScorerContains   = "contains"
	ScorerRegex      = "regex"
	ScorerNumeric    = "numeric"
	ScorerHTTP       = "http"
	ScorerJudge      = "judge"
)

// scorerKeys lists the keys each scorer type takes.
var scorerKeys = map[string][]string{
	ScorerExactMatch: {"type", "ignore_case"},
	ScorerContains:   {"type", "ignore_case"},
	ScorerRegex:      {"type", "pattern", "ignore_case"},
	ScorerNumeric:    {"type", "tolerance"},
	ScorerHTTP:       {"type", "url", "api_key_env", "concurrency", "timeout"},
	ScorerJudge:      {"type", "url", "api_key_env", "concurrency", "timeout", "rubric", "scale", "model", "max_tokens"},
}

// ScorerTypes returns the scorer type names, sorted.
func ScorerTypes() []string {
	out := make([]string, 0, len(scorerKeys))
	for t := range scorerKeys {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

// MaxScorerConcurrency bounds a scorer's concurrency.
const MaxScorerConcurrency = 1024

// ScorerProblems checks a scorer object, returning every problem. At load
// time (rendered false) a value holding a ${{ }} expression is only known
// when the step runs, so only its presence counts.
func ScorerProblems(m map[string]any, rendered bool) []string {
	isExpr := func(v any) bool {
		s, ok := v.(string)
		return !rendered && ok && strings.Contains(s, "${{")
	}
	typ, ok := m["type"]
	if !ok {
		return []string{"type is required (" + joinNames(ScorerTypes()) + ")"}
	}
	if isExpr(typ) {
		return nil
	}
	t, ok := typ.(string)
	if !ok {
		return []string{fmt.Sprintf("type must be a string, got %s", describeValue(typ))}
	}
	keys, known := scorerKeys[t]
	if !known {
		return []string{fmt.Sprintf("unknown scorer type %q%s (known: %s)", clip(t), didYouMean(t, ScorerTypes()), joinNames(ScorerTypes()))}
	}
	var out []string
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		v := m[k]
		if !contains(keys, k) {
			out = append(out, fmt.Sprintf("%s scorers take no %q%s (they take %s)", t, clip(k), didYouMean(k, keys), joinNames(keys)))
			continue
		}
		if isExpr(v) {
			continue
		}
		if msg := scorerValueProblem(k, v); msg != "" {
			out = append(out, k+": "+msg)
		}
	}
	for _, req := range map[string][]string{ScorerRegex: {"pattern"}, ScorerHTTP: {"url"}}[t] {
		if _, ok := m[req]; !ok {
			out = append(out, fmt.Sprintf("%s scorers need %s", t, req))
		}
	}
	return out
}

func scorerValueProblem(k string, v any) string {
	str, isStr := v.(string)
	num, isNum := number(v)
	switch k {
	case "type":
		return ""
	case "ignore_case":
		if _, ok := v.(bool); !ok {
			return "must be true or false, got " + describeValue(v)
		}
	case "pattern":
		if !isStr || str == "" {
			return "must be a non-empty string (a Go regular expression)"
		}
		if _, err := regexp.Compile(str); err != nil {
			return fmt.Sprintf("bad regular expression: %v", err)
		}
	case "tolerance":
		if !isNum || num < 0 {
			return "must be a number >= 0, got " + describeValue(v)
		}
	case "scale":
		if !isNum || !(num > 0) {
			return "must be a number > 0, got " + describeValue(v)
		}
	case "url":
		if !isStr {
			return "must be a string, got " + describeValue(v)
		}
		u, err := url.Parse(str)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Sprintf("%q must be an http:// or https:// URL with a host", clip(str))
		}
	case "api_key_env":
		if !isStr || !identRe.MatchString(str) {
			return "must name an environment variable ([A-Za-z_][A-Za-z0-9_]*), got " + describeValue(v)
		}
	case "concurrency":
		if !isNum || num != math.Trunc(num) || num < 1 || num > MaxScorerConcurrency {
			return fmt.Sprintf("must be an integer in 1..%d, got %s", MaxScorerConcurrency, describeValue(v))
		}
	case "max_tokens":
		if !isNum || num != math.Trunc(num) || num < 1 {
			return "must be a positive integer, got " + describeValue(v)
		}
	case "timeout":
		if !isStr {
			return "must be a duration string like 30s, got " + describeValue(v)
		}
		if _, err := ParseDuration(str); err != nil {
			return err.Error()
		}
	case "rubric", "model":
		if !isStr || str == "" {
			return "must be a non-empty string"
		}
	}
	return ""
}

func number(v any) (float64, bool) {
	switch x := v.(type) {
	case int64:
		return float64(x), true
	case int:
		return float64(x), true
	case float64:
		return x, !math.IsNaN(x) && !math.IsInf(x, 0)
	case json.Number:
		f, err := x.Float64()
		return f, err == nil
	}
	return 0, false
}

// ParseScorer decodes and checks a rendered scorer object.
func ParseScorer(raw json.RawMessage) (Scorer, error) {
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil || m == nil {
		return Scorer{}, fmt.Errorf("scorer must be an object like {type: exact_match}, got %s", clip(string(raw)))
	}
	if probs := ScorerProblems(m, true); len(probs) > 0 {
		return Scorer{}, fmt.Errorf("scorer: %s", strings.Join(probs, "; "))
	}
	var s Scorer
	if err := json.Unmarshal(raw, &s); err != nil {
		return Scorer{}, fmt.Errorf("scorer: %v", err)
	}
	return s, nil
}
