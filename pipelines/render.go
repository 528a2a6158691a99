package pipelines

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/file"
	"github.com/expr-lang/expr/vm"
)

// Segment is one piece of a templated string: literal text or an expression.
type Segment struct {
	Text   string
	IsExpr bool
	// Offset is the byte offset of the segment's text (of the expression
	// source, for an expression) within the whole string.
	Offset int
}

// ParseTemplate splits s into literal and ${{ expr }} segments. An unclosed
// "${{" is an error; "$${{" escapes a literal "${{".
func ParseTemplate(s string) ([]Segment, error) {
	var segs []Segment
	var lit strings.Builder
	litStart := 0
	for i := 0; i < len(s); {
		if strings.HasPrefix(s[i:], "$${{") {
			lit.WriteString("${{")
			i += 4
			continue
		}
		if !strings.HasPrefix(s[i:], "${{") {
			lit.WriteByte(s[i])
			i++
			continue
		}
		end := strings.Index(s[i+3:], "}}")
		if end < 0 {
			return nil, fmt.Errorf("unclosed ${{ at offset %d", i)
		}
		if lit.Len() > 0 {
			segs = append(segs, Segment{Text: lit.String(), Offset: litStart})
			lit.Reset()
		}
		src := s[i+3 : i+3+end]
		trimmed := strings.TrimSpace(src)
		if trimmed == "" {
			return nil, fmt.Errorf("empty expression ${{ }} at offset %d", i)
		}
		segs = append(segs, Segment{Text: trimmed, IsExpr: true, Offset: i + 3 + strings.Index(src, trimmed)})
		i += 3 + end + 2
		litStart = i
	}
	if lit.Len() > 0 {
		segs = append(segs, Segment{Text: lit.String(), Offset: litStart})
	}
	return segs, nil
}

// ConditionSource returns the expression of a when/until condition, which may
// be written bare or wrapped in a single ${{ }}.
func ConditionSource(s string) (string, error) {
	t := strings.TrimSpace(s)
	if !strings.Contains(t, "${{") {
		return t, nil
	}
	segs, err := ParseTemplate(t)
	if err != nil {
		return "", err
	}
	if len(segs) != 1 || !segs[0].IsExpr {
		return "", fmt.Errorf("a condition must be one expression, bare or as ${{ ... }}, not text around it")
	}
	return segs[0].Text, nil
}

// Env is what expressions see at run time.
type Env struct {
	Params    map[string]any
	Steps     map[string]StepState
	Iteration int
}

// StepState is what an expression sees of a finished step.
type StepState struct {
	Status  string         `json:"status"`
	Outputs map[string]any `json:"outputs,omitempty"`
}

func (e Env) vars() map[string]any {
	steps := make(map[string]any, len(e.Steps))
	// Map to map: the order of the loop never shows.
	//workflowcheck:ignore
	for id, s := range e.Steps {
		outs := s.Outputs
		if outs == nil {
			outs = map[string]any{}
		}
		steps[id] = map[string]any{"status": s.Status, "outputs": outs}
	}
	params := e.Params
	if params == nil {
		params = map[string]any{}
	}
	return map[string]any{
		"params": params,
		"steps":  steps,
		"loop":   map[string]any{"iteration": e.Iteration},
	}
}

// exprOptions are shared by the static checker and the runtime. Builtins that
// read the clock are disabled: expressions run inside workflow code, which
// must be deterministic.
func exprOptions() []expr.Option {
	return []expr.Option{expr.DisableBuiltin("now"), expr.DisableBuiltin("date")}
}

// CompileExpr compiles an expression with rlflow's options and its
// checked arithmetic (arith.go).
func CompileExpr(src string) (*vm.Program, error) {
	return expr.Compile(src, append(exprOptions(), arithOptions()...)...)
}

// EvalExpr evaluates one expression against env. A value that is not a
// finite number (or holds one) is an error, never a result: JSON cannot
// carry it, and a step given +Inf has been given nonsense.
func EvalExpr(src string, env Env) (any, error) {
	prog, err := CompileExpr(src)
	if err != nil {
		return nil, fmt.Errorf("compiling %q: %w", clip(src), oneLine(err))
	}
	v, err := expr.Run(prog, env.vars())
	if err != nil {
		return nil, fmt.Errorf("evaluating %q: %w", clip(src), oneLine(err))
	}
	if err := checkFinite(v); err != nil {
		return nil, fmt.Errorf("evaluating %q: %w", clip(src), err)
	}
	return v, nil
}

// exprError is an expr-lang error on one line: its message and column,
// without the source snippet expr appends over several lines.
type exprError struct {
	msg    string
	column int
	cause  error
}

func (e *exprError) Error() string {
	if e.column > 0 {
		return fmt.Sprintf("%s (column %d)", e.msg, e.column)
	}
	return e.msg
}

func (e *exprError) Unwrap() error { return e.cause }

func oneLine(err error) error {
	var fe *file.Error
	if !errors.As(err, &fe) {
		return err
	}
	msg, _, _ := strings.Cut(fe.Message, "\n")
	col := 0
	if fe.Line == 1 {
		col = fe.Column + 1
	}
	return &exprError{msg: strings.TrimSpace(msg), column: col, cause: err}
}

// EvalCondition evaluates a when/until condition; it must yield a bool.
func EvalCondition(cond string, env Env) (bool, error) {
	src, err := ConditionSource(cond)
	if err != nil {
		return false, err
	}
	v, err := EvalExpr(src, env)
	if err != nil {
		return false, err
	}
	b, ok := v.(bool)
	if !ok {
		return false, fmt.Errorf("condition %q yielded %s, want a bool", clip(src), describeValue(v))
	}
	return b, nil
}

// RenderString renders one templated string. A string that is exactly one
// expression keeps the expression's type (so `${{ params.n }}` stays an int);
// otherwise every expression is formatted into the text.
func RenderString(s string, env Env) (any, error) {
	if !strings.Contains(s, "${{") {
		return s, nil
	}
	segs, err := ParseTemplate(s)
	if err != nil {
		return nil, err
	}
	if len(segs) == 1 && segs[0].IsExpr && isWholeExpr(s) {
		return EvalExpr(segs[0].Text, env)
	}
	var b strings.Builder
	for _, seg := range segs {
		if !seg.IsExpr {
			b.WriteString(seg.Text)
			continue
		}
		v, err := EvalExpr(seg.Text, env)
		if err != nil {
			return nil, err
		}
		b.WriteString(formatValue(v))
	}
	return b.String(), nil
}

func isWholeExpr(s string) bool {
	t := strings.TrimSpace(s)
	return strings.HasPrefix(t, "${{") && strings.HasSuffix(t, "}}") && strings.Count(t, "${{") == 1
}

// formatValue prints values the way a user expects inside text: integral
// floats without a fraction (JSON round-trips turn ints into float64).
func formatValue(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case float64:
		if x == float64(int64(x)) && x < 1e15 && x > -1e15 {
			return fmt.Sprintf("%d", int64(x))
		}
		return fmt.Sprintf("%g", x)
	default:
		return fmt.Sprint(x)
	}
}

// Render renders every string inside v (maps and lists recursively) and
// returns a new value; v is not modified.
func Render(v any, env Env) (any, error) {
	switch x := v.(type) {
	case string:
		return RenderString(x, env)
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			r, err := Render(e, env)
			if err != nil {
				return nil, fmt.Errorf("[%d]: %w", i, err)
			}
			out[i] = r
		}
		return out, nil
	case map[string]any:
		out := make(map[string]any, len(x))
		keys := make([]string, 0, len(x))
		//workflowcheck:ignore
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys) // deterministic: the first error reported is stable
		for _, k := range keys {
			r, err := Render(x[k], env)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", k, err)
			}
			out[k] = r
		}
		return out, nil
	default:
		return v, nil
	}
}

// CoerceArgs formats rendered values as text where the step type declares a
// string-typed argument, so `env: {N: "${{ params.n }}"}` gives "4", not 4.
func CoerceArgs(uses string, args map[string]any) {
	t, ok := LookupStepType(uses)
	if !ok {
		return
	}
	for _, a := range t.Args {
		v, ok := args[a.Name]
		if !ok {
			continue
		}
		switch a.Kind {
		case KindString, KindDuration:
			if _, isStr := v.(string); !isStr && v != nil {
				args[a.Name] = formatValue(v)
			}
		case KindStringList:
			if list, ok := v.([]any); ok {
				for i, e := range list {
					if _, isStr := e.(string); !isStr && e != nil {
						list[i] = formatValue(e)
					}
				}
			}
		case KindStringMap:
			if m, ok := v.(map[string]any); ok {
				// Each value is replaced in place: the order never shows.
				//workflowcheck:ignore
				for k, e := range m {
					if _, isStr := e.(string); !isStr && e != nil {
						m[k] = formatValue(e)
					}
				}
			}
		}
	}
}
