package pipelines

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
)

// ParseParamFlags splits `-p key=value` flag values into a map. The value
// may contain '='; a key given twice is an error.
func ParseParamFlags(flags []string) (map[string]string, error) {
	out := make(map[string]string, len(flags))
	var errs []error
	for _, f := range flags {
		k, v, ok := strings.Cut(f, "=")
		k = strings.TrimSpace(k)
		switch {
		case !ok || k == "":
			errs = append(errs, fmt.Errorf("param %q: want key=value", f))
		case hasKey(out, k):
			errs = append(errs, fmt.Errorf("param %q is set twice", k))
		default:
			out[k] = v
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

func hasKey(m map[string]string, k string) bool { _, ok := m[k]; return ok }

// ResolveParams returns the launch value of every declared param: the
// override parsed as the param's type, else the default, else the type's
// zero value ("", 0, 0.0, false, "0s"). Unknown names, missing required
// params and unparsable values are all reported, one per line.
func (p *Pipeline) ResolveParams(overrides map[string]string) (map[string]any, error) {
	given := make(map[string]any, len(overrides))
	for k, v := range overrides {
		given[k] = v
	}
	return p.resolveParams(given)
}

// ResolveParamValues is ResolveParams for typed values, as decoded from JSON
// (the Temporal UI's start form): integral float64 numbers become int64 for
// int params, and strings are parsed as ResolveParams does.
func (p *Pipeline) ResolveParamValues(values map[string]any) (map[string]any, error) {
	return p.resolveParams(values)
}

// TypedParams returns values with each declared param's value in its
// declared type where it converts, as ResolveParamValues would convert it
// (an integral float64 becomes int64 for an int param); other values are
// kept as they are. The pipeline workflow resolves the params once; an
// iteration workflow receives them through JSON, every number a float64,
// and calls this so that expressions see `params.n` as an int again. It
// is pure and never fails, so workflow code may call it; values is not
// modified.
func (p *Pipeline) TypedParams(values map[string]any) map[string]any {
	if len(values) == 0 {
		return values
	}
	out := make(map[string]any, len(values))
	// Map to map: the order never shows.
	//workflowcheck:ignore
	for k, v := range values {
		out[k] = v
	}
	for _, prm := range p.Params {
		if v, ok := values[prm.Name]; ok {
			if c, err := coerceParam(prm.Type, v, true); err == nil {
				out[prm.Name] = c
			}
		}
	}
	return out
}

func (p *Pipeline) resolveParams(given map[string]any) (map[string]any, error) {
	var errs []string
	names := make([]string, len(p.Params))
	declared := make(map[string]bool, len(p.Params))
	for i, prm := range p.Params {
		names[i] = prm.Name
		declared[prm.Name] = true
	}
	// The problems are sorted before they are joined, so the order of this
	// loop never shows (workflow code calls this).
	//workflowcheck:ignore
	for k := range given {
		if declared[k] {
			continue
		}
		switch hint := didYouMean(k, names); {
		case hint != "":
			errs = append(errs, fmt.Sprintf("unknown param %q%s", clip(k), hint))
		case len(names) == 0:
			errs = append(errs, fmt.Sprintf("unknown param %q (the pipeline declares no params)", clip(k)))
		default:
			errs = append(errs, fmt.Sprintf("unknown param %q (declared: %s)", clip(k), joinNames(names)))
		}
	}
	out := make(map[string]any, len(p.Params))
	for _, prm := range p.Params {
		v, ok := given[prm.Name]
		switch {
		case ok:
		case prm.Default != nil:
			// Defaults are coerced too: after a JSON round trip through
			// Temporal an int default arrives as float64.
			v = prm.Default
		case prm.Required:
			errs = append(errs, fmt.Sprintf("param %q is required", prm.Name))
			continue
		default:
			out[prm.Name] = zeroParam(prm.Type)
			continue
		}
		c, err := coerceParam(prm.Type, v, true)
		if err != nil {
			errs = append(errs, fmt.Sprintf("param %q: %v", prm.Name, err))
			continue
		}
		out[prm.Name] = c
	}
	if len(errs) > 0 {
		sort.Strings(errs)
		return nil, errors.New(strings.Join(errs, "\n"))
	}
	return out, nil
}

func zeroParam(t ParamType) any {
	switch t {
	case ParamInt:
		return int64(0)
	case ParamFloat:
		return float64(0)
	case ParamBool:
		return false
	case ParamDuration:
		return "0s"
	}
	return ""
}

// coerceParam converts v to the Go type of t: string, int64, float64, bool,
// or a validated duration string. Lenient mode (launch values) also parses
// strings and accepts integral float64 for ints; strict mode (YAML
// defaults) takes only values already of the right YAML type.
func coerceParam(t ParamType, v any, lenient bool) (any, error) {
	s, isStr := v.(string)
	switch t {
	case ParamString:
		if isStr {
			return s, nil
		}
	case ParamInt:
		n, ok := int64(0), false
		switch x := v.(type) {
		case int64:
			n, ok = x, true
		case int:
			n, ok = int64(x), true
		case float64:
			// An int after a JSON round trip: what the workflow sees.
			if lenient && x == math.Trunc(x) && math.Abs(x) <= MaxExactInt {
				n, ok = int64(x), true
			}
		case json.Number:
			var err error
			n, err = x.Int64()
			ok = err == nil
		case string:
			if lenient {
				var err error
				n, err = strconv.ParseInt(strings.TrimSpace(x), 10, 64)
				ok = err == nil
			}
		}
		if ok {
			if err := checkExactInt(n); err != nil {
				return nil, err
			}
			return n, nil
		}
	case ParamFloat:
		var f float64
		ok := true
		switch x := v.(type) {
		case float64:
			f = x
		case int64:
			f = float64(x)
		case int:
			f = float64(x)
		case json.Number:
			var err error
			f, err = x.Float64()
			ok = err == nil
		case string:
			var err error
			f, err = strconv.ParseFloat(strings.TrimSpace(x), 64)
			ok = lenient && err == nil
		default:
			ok = false
		}
		if ok && !math.IsInf(f, 0) && !math.IsNaN(f) {
			return f, nil
		}
	case ParamBool:
		switch x := v.(type) {
		case bool:
			return x, nil
		case string:
			if lenient {
				if b, err := strconv.ParseBool(strings.TrimSpace(x)); err == nil {
					return b, nil
				}
			}
		}
	case ParamDuration:
		if isStr {
			s = strings.TrimSpace(s)
			if _, err := ParseDuration(s); err != nil {
				return nil, err
			}
			return s, nil
		}
	default:
		return nil, fmt.Errorf("unknown param type %q", t)
	}
	return nil, fmt.Errorf("must be %s, got %s", paramTypeWant(t), describeValue(v))
}

func paramTypeWant(t ParamType) string {
	switch t {
	case ParamInt:
		return "an integer"
	case ParamFloat:
		return "a finite number"
	case ParamBool:
		return "true or false"
	case ParamDuration:
		return "a duration like 30s or 1h30m"
	}
	return "a string"
}

// describeValue names a decoded value for messages.
func describeValue(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("string %q", clip(x))
	case bool:
		return fmt.Sprintf("bool %v", x)
	case int, int64:
		return fmt.Sprintf("integer %v", x)
	case float64:
		return fmt.Sprintf("float %v", x)
	case json.Number:
		return "number " + x.String()
	case map[string]any:
		return "a mapping"
	case []any:
		return "a list"
	}
	return fmt.Sprintf("%T", v)
}
