package pipelines

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

// ResolveParams turns `-p name=value` strings into typed launch values,
// applying defaults; every problem is reported at once.
func (p *Pipeline) ResolveParams(raw map[string]string) (map[string]any, error) {
	vals := make(map[string]any, len(raw))
	for k, v := range raw {
		vals[k] = v
	}
	return p.resolve(vals, true)
}

// ResolveParamValues validates JSON launch values (from the Temporal UI form
// or a schedule): JSON numbers become int64 for int params.
func (p *Pipeline) ResolveParamValues(vals map[string]any) (map[string]any, error) {
	return p.resolve(vals, false)
}

func (p *Pipeline) resolve(vals map[string]any, fromText bool) (map[string]any, error) {
	var errs []string
	names := make([]string, 0, len(p.Params))
	for _, pr := range p.Params {
		names = append(names, pr.Name)
	}
	keys := make([]string, 0, len(vals))
	for k := range vals {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !contains(names, k) {
			if len(names) == 0 {
				errs = append(errs, fmt.Sprintf("unknown param %q (the pipeline declares none)", k))
			} else {
				errs = append(errs, "unknown param"+suggest(k, names))
			}
		}
	}
	out := make(map[string]any, len(p.Params))
	for _, pr := range p.Params {
		v, given := vals[pr.Name]
		if !given {
			if pr.Default != nil {
				d, err := coerceValue(pr.Type, pr.Default)
				if err != nil {
					errs = append(errs, fmt.Sprintf("%s: default: %v", pr.Name, err))
				}
				out[pr.Name] = d
			} else if pr.Required {
				errs = append(errs, fmt.Sprintf("%s: required (give -p %s=<%s>)", pr.Name, pr.Name, pr.Type))
			} else {
				out[pr.Name] = zeroValue(pr.Type)
			}
			continue
		}
		var c any
		var err error
		if s, ok := v.(string); ok && fromText {
			c, err = coerceParam(pr.Type, s, "")
		} else {
			c, err = coerceValue(pr.Type, v)
		}
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", pr.Name, err))
			continue
		}
		out[pr.Name] = c
	}
	if len(errs) > 0 {
		return nil, errors.New(strings.Join(errs, "; "))
	}
	return out, nil
}

func zeroValue(t ParamType) any {
	switch t {
	case ParamInt:
		return int64(0)
	case ParamFloat:
		return 0.0
	case ParamBool:
		return false
	case ParamDuration:
		return "0s"
	}
	return ""
}

// coerceValue checks a JSON-typed value against a param type.
func coerceValue(t ParamType, v any) (any, error) {
	switch t {
	case ParamString:
		if s, ok := v.(string); ok {
			return s, nil
		}
	case ParamInt:
		switch x := v.(type) {
		case int64:
			return x, nil
		case int:
			return int64(x), nil
		case float64:
			if x == float64(int64(x)) {
				return int64(x), nil
			}
		}
	case ParamFloat:
		switch x := v.(type) {
		case float64:
			return x, nil
		case int64:
			return float64(x), nil
		case int:
			return float64(x), nil
		}
	case ParamBool:
		if b, ok := v.(bool); ok {
			return b, nil
		}
	case ParamDuration:
		if s, ok := v.(string); ok {
			if _, err := ParseDuration(s); err != nil {
				return nil, err
			}
			return s, nil
		}
	}
	return nil, fmt.Errorf("want a %s, got %v (%T)", t, v, v)
}
