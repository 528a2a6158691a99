package pipelines

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"time"
)

// Scorer is evaluate's `scorer` object. ScorerProblems checks it, at load
// time (rlflow validate) and again in the activity on the rendered values;
// ParseScorer returns it with the type's defaults filled in. The keys of
// each type, their ranges and defaults are in scorerTypes.
type Scorer struct {
	Type string `json:"type"`
	// IgnoreCase: exact_match, contains, regex.
	IgnoreCase bool `json:"ignore_case,omitempty"`
	// Pattern (regex, required): with a capture group, the first group of
	// the first match is compared with the answer; without one, any match
	// scores 1.
	Pattern string `json:"pattern,omitempty"`
	// Tolerance (numeric): the last number in the completion scores 1 when
	// |x - answer| <= tolerance.
	Tolerance float64 `json:"tolerance,omitempty"`
	// URL: http (required) is POSTed {prompt, completion, answer, id} and
	// answers {"score": number}; judge (optional) is an OpenAI-compatible
	// server to ask instead of the pipeline's servers.
	URL       string `json:"url,omitempty"`
	APIKeyEnv string `json:"api_key_env,omitempty"`
	// Concurrency bounds the requests in flight to the scorer (http, judge).
	Concurrency int `json:"concurrency,omitempty"`
	// Timeout bounds one scoring request (http, judge).
	Timeout Duration `json:"timeout,omitempty"`
	// Rubric (judge) is the message sent to the judge; {prompt},
	// {completion} and {answer} are replaced.
	Rubric string `json:"rubric,omitempty"`
	// Scale (judge): the judge's first number in [0, scale] is divided by
	// scale (1 for a rubric that asks for 0..1).
	Scale float64 `json:"scale,omitempty"`
	// Model (judge): "" asks the server for its first model.
	Model     string `json:"model,omitempty"`
	MaxTokens int    `json:"max_tokens,omitempty"` // judge: of the reply
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

// ScorerType describes one scorer type: what it does and the keys its
// object takes besides type. ScorerProblems checks them, ParseScorer fills
// their defaults in, and the reference and JSON Schema list them.
type ScorerType struct {
	Name string
	Doc  string
	Args []ArgSpec
}

var (
	ignoreCaseArg = ArgSpec{Name: "ignore_case", Kind: KindBool, Default: false, Doc: "compare case-insensitively"}
	apiKeyEnvArg  = ArgSpec{Name: "api_key_env", Kind: KindString, Format: FormatEnvVar, DefaultDoc: "none: no API key is sent",
		Doc: "environment variable on the worker holding the bearer token; the key never enters workflow history"}
	scorerConcurrencyArg = ArgSpec{Name: "concurrency", Kind: KindInt, Min: bound(1), Max: bound(MaxScorerConcurrency), Default: int64(16),
		Doc: "scoring requests in flight"}
	scorerTimeoutArg = ArgSpec{Name: "timeout", Kind: KindDuration, Min: seconds(minTimeout), Default: Duration(30 * time.Second),
		Doc: "deadline of one scoring request"}
)

// scorerTypes is every scorer type, in reference order.
var scorerTypes = []ScorerType{
	{Name: ScorerExactMatch, Doc: "Scores 1 when the sample's text equals the answer (both trimmed), else 0.",
		Args: []ArgSpec{ignoreCaseArg}},
	{Name: ScorerContains, Doc: "Scores 1 when the sample's text contains the answer (both trimmed), else 0.",
		Args: []ArgSpec{ignoreCaseArg}},
	{Name: ScorerRegex, Doc: "With a capture group, scores 1 when the first group of the first match equals the answer (both trimmed); without one, 1 when the pattern matches at all.",
		Args: []ArgSpec{
			{Name: "pattern", Kind: KindString, Required: true, Format: FormatRegexp, Doc: "the regular expression"},
			ignoreCaseArg,
		}},
	{Name: ScorerNumeric, Doc: "Scores 1 when the last number in the sample's text is within tolerance of the answer (a number), else 0.",
		Args: []ArgSpec{
			{Name: "tolerance", Kind: KindFloat, Min: bound(0), Default: 0.0, Doc: "largest |x - answer| that scores 1; 0 wants equal values"},
		}},
	{Name: ScorerHTTP, Doc: "POSTs {prompt, completion, answer, id} to url for each sample and reads the answer {\"score\": number}.",
		Args: []ArgSpec{
			{Name: "url", Kind: KindString, Required: true, Format: FormatURL, Doc: "the scoring service"},
			apiKeyEnvArg, scorerConcurrencyArg, scorerTimeoutArg,
		}},
	{Name: ScorerJudge, Doc: "Asks a chat model to rate each sample with the rubric: the first number of the reply in [0, scale], divided by scale, is the score; a reply without one scores 0 and counts in unparsed.",
		Args: []ArgSpec{
			{Name: "rubric", Kind: KindString, MinItems: 1, Default: DefaultJudgeRubric, Doc: "the message sent to the judge; {prompt}, {completion} and {answer} are replaced"},
			{Name: "scale", Kind: KindFloat, Min: bound(0), MinExclusive: true, Default: 10.0, Doc: "the rubric's top rating (1 for a rubric that asks for 0..1)"},
			{Name: "model", Kind: KindString, MinItems: 1, DefaultDoc: "the server's first model", Doc: "the judge's model"},
			{Name: "max_tokens", Kind: KindInt, Min: bound(1), Default: int64(16), Doc: "tokens of the judge's reply"},
			{Name: "url", Kind: KindString, Format: FormatURL, DefaultDoc: "the pipeline's servers", Doc: "an OpenAI-compatible server to ask instead of the pipeline's servers"},
			apiKeyEnvArg, scorerConcurrencyArg, scorerTimeoutArg,
		}},
}

// LookupScorerType returns the scorer type with that name.
func LookupScorerType(name string) (*ScorerType, bool) {
	for i := range scorerTypes {
		if scorerTypes[i].Name == name {
			return &scorerTypes[i], true
		}
	}
	return nil, false
}

// keys lists the keys a scorer object of this type takes, type first.
func (t *ScorerType) keys() []string {
	out := []string{"type"}
	for _, a := range t.Args {
		out = append(out, a.Name)
	}
	return out
}

// ScorerTypes returns the scorer type names, sorted.
func ScorerTypes() []string {
	out := make([]string, 0, len(scorerTypes))
	for _, t := range scorerTypes {
		out = append(out, t.Name)
	}
	sort.Strings(out)
	return out
}

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
	st, known := LookupScorerType(t)
	if !known {
		return []string{fmt.Sprintf("unknown scorer type %q%s (known: %s)", clip(t), didYouMean(t, ScorerTypes()), joinNames(ScorerTypes()))}
	}
	keys := st.keys()
	var out []string
	for _, k := range sortedKeys(m) {
		v := m[k]
		if !contains(keys, k) {
			out = append(out, fmt.Sprintf("%s scorers take no %q%s (they take %s)", t, clip(k), didYouMean(k, keys), joinNames(keys)))
			continue
		}
		if k == "type" || isExpr(v) {
			continue
		}
		spec, _ := findArg(st.Args, k)
		if err := spec.Check(v); err != nil {
			out = append(out, k+": "+err.Error())
		}
	}
	for _, a := range st.Args {
		if _, ok := m[a.Name]; a.Required && !ok {
			out = append(out, fmt.Sprintf("%s scorers need %s", t, a.Name))
		}
	}
	return out
}

var scorerStructType = reflect.TypeOf(Scorer{})

// scorerSkip is the Scorer fields that are not keys of scorer type t.
func scorerSkip(t *ScorerType) map[string]bool {
	skip := map[string]bool{"type": true}
	for _, f := range argFields(scorerStructType) {
		if _, ok := findArg(t.Args, f.name); !ok {
			skip[f.name] = true
		}
	}
	return skip
}

// ParseScorer decodes and checks a rendered scorer object, and returns it
// with every key its type leaves out set to the key's default.
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
	st, _ := LookupScorerType(s.Type)
	if probs := resolveFields("scorer "+st.Name, st.Args, reflect.ValueOf(&s).Elem(), scorerSkip(st)); len(probs) > 0 {
		return Scorer{}, fmt.Errorf("scorer: %s", strings.Join(probs, "; "))
	}
	return s, nil
}
