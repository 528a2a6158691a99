package pipelines

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
)

// ArgSpec describes one key of a step's `with` (or of an object argument
// such as evaluate's scorer): the single description the loader checks,
// the JSON Schema and the reference print, and ResolveArgs applies to an
// activity's input struct at run time.
type ArgSpec struct {
	Name     string
	Kind     ArgKind
	Required bool
	// Enum lists the allowed values of a string argument, if non-empty.
	Enum []string
	// Min and Max bound an int or float argument inclusively, and a
	// duration in seconds; nil: unbounded.
	Min, Max *float64
	// MinExclusive makes Min itself out of range (top_p > 0).
	MinExclusive bool
	// MinItems bounds a list from below (exec's command needs its
	// program); for a string it is the least length, so 1 means not empty.
	// A Required string is never empty either.
	MinItems int
	// Format is a check on a string's text beyond its kind.
	Format ArgFormat
	// Default is what the step uses when `with` leaves the argument out,
	// typed by Kind: int64 (KindInt), float64 (KindFloat), string, bool,
	// Duration, []string; nil when there is no single value (DefaultDoc
	// says what happens).
	Default any
	// DefaultDoc states the default in words where Default cannot ("the
	// server's"), or qualifies it.
	DefaultDoc string
	// Doc describes the argument, without its default or range: the
	// reference prints those from the fields above.
	Doc string
}

// ArgFormat names a check on a string argument's text.
type ArgFormat string

const (
	// FormatURL: an absolute http:// or https:// URL with a host.
	FormatURL ArgFormat = "url"
	// FormatRegexp: a Go regular expression (RE2 syntax) that compiles.
	FormatRegexp ArgFormat = "regexp"
	// FormatEnvVar: an environment variable name, [A-Za-z_][A-Za-z0-9_]*.
	FormatEnvVar ArgFormat = "env-var"
)

// formatDoc says what a format wants, for the reference.
func formatDoc(f ArgFormat) string {
	switch f {
	case FormatURL:
		return "an http:// or https:// URL with a host"
	case FormatRegexp:
		return "a Go regular expression"
	case FormatEnvVar:
		return "an environment variable name (`" + identRe.String() + "`)"
	}
	return string(f)
}

func bound(v float64) *float64 { return &v }

// checkExactInt refuses an integer that JSON, as the workflow decodes it,
// would not carry exactly.
func checkExactInt(x int64) error {
	if x > MaxExactInt || x < -MaxExactInt {
		return fmt.Errorf("integer %d is beyond ±%d (2^53), the integers workflow input carries exactly as JSON numbers", x, int64(MaxExactInt))
	}
	return nil
}

// seconds is a duration bound in the unit ArgSpec.Min and Max use.
func seconds(d time.Duration) *float64 { return bound(d.Seconds()) }

// Check reports whether v, a rendered value, fits the spec: kind, range,
// enum, items and format. v is as decoded from YAML (int64, float64,
// string, bool, []any, map[string]any) or from JSON (float64 for numbers),
// or a Go value of an input struct's field (int, int64, float64, Duration,
// []string, map[string]string, json.RawMessage). String kinds want strings:
// the loader and CoerceArgs turn other scalars into their text first. The
// error names no path (callers prefix it) and states the range.
func (a ArgSpec) Check(v any) error {
	switch a.Kind {
	case KindString:
		s, ok := v.(string)
		if !ok {
			return a.kindError(v)
		}
		return a.checkText(s)
	case KindInt:
		x, ok := asInt64(v)
		if !ok {
			return a.kindError(v)
		}
		if err := checkExactInt(x); err != nil {
			return err
		}
		return a.checkRange(float64(x), strconv.FormatInt(x, 10), x == 0)
	case KindFloat:
		x, ok := asFloat64(v)
		if !ok {
			return a.kindError(v)
		}
		return a.checkRange(x, formatFloat(x), x == 0)
	case KindBool:
		if _, ok := v.(bool); !ok {
			return a.kindError(v)
		}
	case KindDuration:
		var d Duration
		switch x := v.(type) {
		case string:
			p, err := ParseDuration(x)
			if err != nil {
				return err
			}
			d = p
		case Duration:
			d = x
		case time.Duration:
			d = Duration(x)
		default:
			return a.kindError(v)
		}
		if d < 0 {
			return fmt.Errorf("must not be negative, got %s", shortDuration(d))
		}
		return a.checkRange(float64(d)/1e9, shortDuration(d), d == 0)
	case KindStringList:
		var n int
		switch x := v.(type) {
		case []string:
			n = len(x)
		case []any:
			n = len(x)
			for i, e := range x {
				if _, ok := e.(string); !ok {
					return fmt.Errorf("item %d must be a string, got %s", i, describeArg(e))
				}
			}
		default:
			return a.kindError(v)
		}
		return a.checkItems(n)
	case KindStringMap:
		switch x := v.(type) {
		case map[string]string:
		case map[string]any:
			keys := sortedKeys(x)
			for _, k := range keys {
				if _, ok := x[k].(string); !ok {
					return fmt.Errorf("%s must be a string, got %s", clip(k), describeArg(x[k]))
				}
			}
		default:
			return a.kindError(v)
		}
	case KindObject:
		switch x := v.(type) {
		case map[string]any:
		case json.RawMessage:
			var m map[string]any
			if json.Unmarshal(x, &m) != nil || m == nil {
				return fmt.Errorf("must be a mapping, got %s", describeArg(x))
			}
		default:
			return a.kindError(v)
		}
	}
	return nil
}

func (a ArgSpec) kindError(v any) error {
	return fmt.Errorf("must be %s, got %s", a.want(), describeArg(v))
}

// want is what the argument must be, with its range: "an integer in 1..1024".
func (a ArgSpec) want() string {
	w := kindWant(a.Kind)
	if r := a.RangeText(); r != "" && (a.Kind == KindInt || a.Kind == KindFloat) {
		if strings.Contains(r, "..") {
			return w + " in " + r
		}
		return w + " " + r
	}
	return w
}

func (a ArgSpec) checkText(s string) error {
	if s == "" && (a.Required || a.MinItems > 0) {
		return errors.New("must not be empty")
	}
	if a.MinItems > 1 && len([]rune(s)) < a.MinItems {
		return fmt.Errorf("must be at least %d characters long, got %d", a.MinItems, len([]rune(s)))
	}
	if len(a.Enum) > 0 && !contains(a.Enum, s) {
		return fmt.Errorf("%q is not one of %s%s", clip(s), joinNames(a.Enum), didYouMean(s, a.Enum))
	}
	switch a.Format {
	case FormatURL:
		u, err := url.Parse(s)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%q must be an http:// or https:// URL with a host", clip(s))
		}
	case FormatRegexp:
		if _, err := regexp.Compile(s); err != nil {
			return fmt.Errorf("bad regular expression: %v", err)
		}
	case FormatEnvVar:
		if !identRe.MatchString(s) {
			return fmt.Errorf("must name an environment variable (%s), got %s", strings.Trim(identRe.String(), "^$"), describeValue(s))
		}
	}
	return nil
}

func (a ArgSpec) checkItems(n int) error {
	switch {
	case n >= a.MinItems:
		return nil
	case a.MinItems == 1:
		return errors.New("must not be empty")
	}
	return fmt.Errorf("must have at least %d items, got %d", a.MinItems, n)
}

// checkRange checks x (seconds, for a duration) against Min and Max; got
// is x as the message shows it.
func (a ArgSpec) checkRange(x float64, got string, zero bool) error {
	lo, hi := a.Min, a.Max
	if (lo == nil || x > *lo || (!a.MinExclusive && x == *lo)) && (hi == nil || x <= *hi) {
		return nil
	}
	var msg string
	if r := a.RangeText(); strings.Contains(r, "..") {
		msg = fmt.Sprintf("%s is out of range %s", got, r)
	} else {
		msg = fmt.Sprintf("must be %s, got %s", r, got)
	}
	if d := a.DefaultText(); zero && d != "" {
		// A zero means "the default" to an input struct; in a file it is
		// a mistake better caught than silently replaced.
		msg += "; leave it out for the default (" + d + ")"
	}
	return errors.New(msg)
}

// RangeText states Min and Max: "1..1024", ">= 1", "> 0 and <= 1", ">= 1ms";
// "" when unbounded.
func (a ArgSpec) RangeText() string {
	lo, hi := a.Min, a.Max
	if lo != nil && hi != nil && !a.MinExclusive {
		return a.boundText(*lo) + ".." + a.boundText(*hi)
	}
	var parts []string
	if lo != nil {
		op := ">= "
		if a.MinExclusive {
			op = "> "
		}
		parts = append(parts, op+a.boundText(*lo))
	}
	if hi != nil {
		parts = append(parts, "<= "+a.boundText(*hi))
	}
	return strings.Join(parts, " and ")
}

func (a ArgSpec) boundText(b float64) string {
	if a.Kind == KindDuration {
		return shortDuration(Duration(math.Round(b * 1e9)))
	}
	return formatFloat(b)
}

// DefaultText states the default as the reference and messages show it:
// Default formatted, DefaultDoc, or both; "" when there is none.
func (a ArgSpec) DefaultText() string {
	switch {
	case a.Default == nil:
		return a.DefaultDoc
	case a.DefaultDoc == "":
		return formatDefault(a.Default)
	}
	return formatDefault(a.Default) + " (" + a.DefaultDoc + ")"
}

// formatDefault writes a default value as a user would in YAML.
func formatDefault(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		if x == "" {
			return `""`
		}
		return x
	case float64:
		s := formatFloat(x)
		if !strings.ContainsAny(s, ".e") {
			s += ".0"
		}
		return s
	case Duration:
		return shortDuration(x)
	case time.Duration:
		return shortDuration(Duration(x))
	case []string:
		return "[" + strings.Join(x, ", ") + "]"
	}
	return fmt.Sprint(v)
}

// jsonDefault is a default as the JSON Schema's "default" holds it.
func jsonDefault(v any) any {
	switch x := v.(type) {
	case Duration:
		return shortDuration(x)
	case time.Duration:
		return shortDuration(Duration(x))
	}
	return v
}

// formatFloat writes x in plain decimals (2147483647, 0.5), falling back to
// an exponent only for magnitudes where decimals would be unreadable.
func formatFloat(x float64) string {
	if a := math.Abs(x); x == 0 || (a >= 1e-6 && a < 1e21) {
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
	return strconv.FormatFloat(x, 'g', -1, 64)
}

// shortDuration writes d without trailing zero units: 2h, 10m, 1m30s.
func shortDuration(d Duration) string {
	s := time.Duration(d).String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

// describeArg is describeValue for the Go values of input structs too.
func describeArg(v any) string {
	switch x := v.(type) {
	case Duration:
		return "duration " + shortDuration(x)
	case time.Duration:
		return "duration " + shortDuration(Duration(x))
	case []string:
		return "a list"
	case map[string]string:
		return "a mapping"
	case json.RawMessage:
		return "JSON " + clip(string(bytes.TrimSpace(x)))
	case int8, int16, int32, uint, uint8, uint16, uint32, uint64:
		return fmt.Sprintf("integer %v", x)
	case float32:
		return fmt.Sprintf("float %v", x)
	}
	return describeValue(v)
}

// asInt64 accepts integers, and integral finite floats (JSON numbers).
func asInt64(v any) (int64, bool) {
	switch x := v.(type) {
	case int:
		return int64(x), true
	case int64:
		return x, true
	case int32:
		return int64(x), true
	case int16:
		return int64(x), true
	case int8:
		return int64(x), true
	case uint:
		return int64(x), uint64(x) <= math.MaxInt64
	case uint64:
		return int64(x), x <= math.MaxInt64
	case uint32:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint8:
		return int64(x), true
	case float64:
		if x != math.Trunc(x) || x < -(1<<63) || x >= 1<<63 {
			return 0, false // also NaN and the infinities
		}
		return int64(x), true
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i, true
		}
		if f, err := x.Float64(); err == nil {
			return asInt64(f)
		}
	}
	return 0, false
}

// asFloat64 accepts finite numbers of any Go type.
func asFloat64(v any) (float64, bool) {
	switch x := v.(type) {
	case float64:
		return x, !math.IsNaN(x) && !math.IsInf(x, 0)
	case float32:
		return asFloat64(float64(x))
	case json.Number:
		f, err := x.Float64()
		return f, err == nil && !math.IsNaN(f) && !math.IsInf(f, 0)
	}
	if i, ok := asInt64(v); ok {
		return float64(i), true
	}
	switch x := v.(type) {
	case uint64:
		return float64(x), true
	case uint:
		return float64(x), true
	}
	return 0, false
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	// Sorted below: the order of the loop never shows (workflow code
	// renders expressions through this).
	//workflowcheck:ignore
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func findArg(specs []ArgSpec, name string) (ArgSpec, bool) {
	for _, a := range specs {
		if a.Name == name {
			return a, true
		}
	}
	return ArgSpec{}, false
}

// Default returns the named argument's Default (nil when it has none or
// there is no such argument).
func (t *StepType) Default(name string) any {
	a, _ := t.Arg(name)
	return a.Default
}
