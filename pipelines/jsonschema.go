package pipelines

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
)

// JSONSchema returns a JSON Schema (draft 2020-12) of the pipeline YAML for
// editors, generated from the schema tables and the step types registered
// when it is called. The loader remains the authority: the schema cannot
// express cross-step checks such as needs or expression references.
func JSONSchema() ([]byte, error) {
	defs := map[string]any{
		"duration": map[string]any{
			"type": "string", "pattern": durationRe,
			"description": "a Go duration: 30s, 5m, 1h30m",
		},
		"expression": map[string]any{
			"type": "string", "pattern": `^\s*\$\{\{.*\}\}\s*$`,
			"description": "a single ${{ }} expression, typed when rendered",
		},
	}
	for _, o := range objects {
		defs[o.name] = objectSchema(o)
	}
	var typeRules []any
	for _, name := range StepTypeNames() {
		t, _ := LookupStepType(name)
		defs["with_"+name] = withSchema(t)
		typeRules = append(typeRules, map[string]any{
			"if":   map[string]any{"properties": map[string]any{"uses": map[string]any{"const": name}}, "required": []string{"uses"}},
			"then": map[string]any{"properties": map[string]any{"with": map[string]any{"$ref": "#/$defs/with_" + name}}},
		})
	}
	step := defs["step"].(map[string]any)
	step["properties"].(map[string]any)["uses"].(map[string]any)["enum"] = StepTypeNames()
	if len(typeRules) > 0 {
		step["allOf"] = typeRules
	}
	doc := map[string]any{
		"$schema":     "https://json-schema.org/draft/2020-12/schema",
		"$id":         "https://github.com/rlflow/rlflow/pipelines/pipeline.schema.json",
		"title":       "rlflow pipeline",
		"description": "An rlflow pipeline: a DAG of steps run once per loop iteration as a Temporal workflow.",
		"$ref":        "#/$defs/pipeline",
		"$defs":       defs,
	}
	return json.MarshalIndent(doc, "", "  ")
}

func objectSchema(o *object) map[string]any {
	props := map[string]any{}
	var required []string
	for i := range o.fields {
		f := &o.fields[i]
		props[f.name] = fieldSchema(f, o.typ.Field(f.index).Type)
		if f.required {
			required = append(required, f.name)
		}
	}
	s := map[string]any{"type": "object", "description": o.doc, "additionalProperties": false, "properties": props}
	if len(required) > 0 {
		s["required"] = required
	}
	switch o {
	case loopObj:
		s["not"] = map[string]any{"required": []string{"iterations", "until"}}
		s["dependentRequired"] = map[string]any{"until": []string{"max_iterations"}, "max_iterations": []string{"until"}}
	case paramObj:
		var rules []any
		for _, t := range paramTypes {
			rules = append(rules, map[string]any{
				"if":   map[string]any{"properties": map[string]any{"type": map[string]any{"const": t}}},
				"then": map[string]any{"properties": map[string]any{"default": paramDefaultSchema(ParamType(t))}},
			})
		}
		rules = append(rules, map[string]any{
			"if":   map[string]any{"properties": map[string]any{"required": map[string]any{"const": true}}, "required": []string{"required"}},
			"then": map[string]any{"not": map[string]any{"required": []string{"default"}}},
		})
		s["allOf"] = rules
	}
	return s
}

func paramDefaultSchema(t ParamType) map[string]any {
	switch t {
	case ParamInt:
		return map[string]any{"type": "integer"}
	case ParamFloat:
		return map[string]any{"type": "number"}
	case ParamBool:
		return map[string]any{"type": "boolean"}
	case ParamDuration:
		return map[string]any{"$ref": "#/$defs/duration"}
	}
	return map[string]any{"type": []string{"string", "number", "boolean"}}
}

func fieldSchema(f *field, t reflect.Type) map[string]any {
	var s map[string]any
	switch {
	case f.kind == kindParams:
		s = map[string]any{"type": "object", "propertyNames": map[string]any{"pattern": identRe.String()},
			"additionalProperties": map[string]any{"$ref": "#/$defs/param"}}
	case f.kind == kindSize:
		s = map[string]any{"anyOf": []any{
			map[string]any{"type": "integer", "minimum": 1},
			map[string]any{"type": "string", "pattern": sizeRe.String()},
		}}
	case f.kind == kindWith:
		s = map[string]any{"type": "object"}
	case f.kind == kindCondition:
		s = map[string]any{"type": []string{"string", "boolean"}}
	case f.kind == kindAny:
		s = map[string]any{}
	case t == durationType:
		s = map[string]any{"$ref": "#/$defs/duration"}
	default:
		s = goTypeSchema(f, t)
	}
	s["description"] = f.doc
	if f.def != nil {
		s["default"] = jsonDefault(f.def)
	}
	return s
}

func goTypeSchema(f *field, t reflect.Type) map[string]any {
	switch t.Kind() {
	case reflect.String:
		s := map[string]any{"type": "string"}
		if len(f.enum) > 0 {
			s["enum"] = f.enum
		}
		if f.pattern != nil {
			s["pattern"] = f.pattern.String()
		}
		if f.maxLen > 0 {
			s["maxLength"] = f.maxLen
		}
		return s
	case reflect.Int, reflect.Int64:
		s := map[string]any{"type": "integer"}
		setBounds(s, f.min, f.max, false)
		return s
	case reflect.Float64:
		s := map[string]any{"type": "number"}
		setBounds(s, f.min, f.max, false)
		return s
	case reflect.Bool:
		return map[string]any{"type": "boolean"}
	case reflect.Slice:
		var items map[string]any
		if t.Elem().Kind() == reflect.String {
			items = map[string]any{"type": "string"}
			if f.pattern != nil {
				items["pattern"] = f.pattern.String()
			}
			if len(f.enum) > 0 {
				items["enum"] = f.enum
			}
		} else {
			items = map[string]any{"$ref": "#/$defs/" + objectByType[t.Elem()].name}
		}
		s := map[string]any{"type": "array", "items": items}
		if f.minItems > 0 {
			s["minItems"] = f.minItems
		}
		return s
	case reflect.Map:
		return map[string]any{"type": "object", "propertyNames": map[string]any{"pattern": envVarRe.String()},
			"additionalProperties": map[string]any{"type": "string"}}
	case reflect.Pointer:
		return map[string]any{"$ref": "#/$defs/" + objectByType[t.Elem()].name}
	case reflect.Struct:
		return map[string]any{"$ref": "#/$defs/" + objectByType[t].name}
	}
	return map[string]any{}
}

// setBounds writes a number's bounds as JSON Schema keywords.
func setBounds(s map[string]any, lo, hi *float64, loExclusive bool) {
	switch {
	case lo != nil && loExclusive:
		s["exclusiveMinimum"] = *lo
	case lo != nil:
		s["minimum"] = *lo
	}
	if hi != nil {
		s["maximum"] = *hi
	}
}

func withSchema(t *StepType) map[string]any {
	s := argsSchema(t.Args)
	s["description"] = t.Doc
	if t.Name == StepEvaluate {
		s["properties"].(map[string]any)["scorer"] = scorerSchema()
	}
	return s
}

// argsSchema describes a mapping of arguments.
func argsSchema(args []ArgSpec) map[string]any {
	props := map[string]any{}
	var required []string
	for _, a := range args {
		props[a.Name] = argPropertySchema(a)
		if a.Required {
			required = append(required, a.Name)
		}
	}
	s := map[string]any{"type": "object", "additionalProperties": false, "properties": props}
	if len(required) > 0 {
		s["required"] = required
	}
	return s
}

// argPropertySchema is one argument's schema with its description and
// default.
func argPropertySchema(a ArgSpec) map[string]any {
	s := argSchema(a)
	s["description"] = a.Doc + argConstraintDoc(a)
	if a.Default != nil {
		s["default"] = jsonDefault(a.Default)
	}
	return s
}

// scorerSchema is evaluate's scorer: one alternative per scorer type.
func scorerSchema() map[string]any {
	var types []any
	for _, t := range scorerTypes {
		s := argsSchema(t.Args)
		s["description"] = t.Doc
		s["properties"].(map[string]any)["type"] = map[string]any{"const": t.Name}
		req, _ := s["required"].([]string)
		s["required"] = append([]string{"type"}, req...)
		types = append(types, s)
	}
	spec, _ := LookupStepType(StepEvaluate)
	a, _ := spec.Arg("scorer")
	return map[string]any{"description": a.Doc, "anyOf": []any{map[string]any{"oneOf": types}, map[string]any{"$ref": "#/$defs/expression"}}}
}

// argSchema mirrors checkArg and ArgSpec.Check: any argument may instead
// be a single ${{ }} expression, and string kinds accept any scalar as its
// text.
func argSchema(a ArgSpec) map[string]any {
	expr := map[string]any{"$ref": "#/$defs/expression"}
	scalar := []string{"string", "number", "boolean"}
	var plain map[string]any
	switch a.Kind {
	case KindString:
		switch {
		case len(a.Enum) > 0:
			plain = map[string]any{"enum": a.Enum}
		case a.Format == FormatEnvVar:
			plain = map[string]any{"type": "string", "pattern": identRe.String()}
		default:
			s := map[string]any{"type": scalar}
			if n := minLength(a); n > 0 {
				s["minLength"] = n
			}
			switch a.Format {
			case FormatURL:
				s["format"] = "uri"
			case FormatRegexp:
				s["format"] = "regex"
			}
			return s
		}
	case KindInt:
		plain = map[string]any{"type": "integer"}
		setBounds(plain, a.Min, a.Max, a.MinExclusive)
	case KindFloat:
		plain = map[string]any{"type": "number"}
		setBounds(plain, a.Min, a.Max, a.MinExclusive)
	case KindBool:
		plain = map[string]any{"type": "boolean"}
	case KindDuration:
		plain = map[string]any{"$ref": "#/$defs/duration"}
		expr = map[string]any{"type": "string", "pattern": `\$\{\{`}
	case KindStringList:
		plain = map[string]any{"type": "array", "items": map[string]any{"type": scalar}}
		if a.MinItems > 0 {
			plain["minItems"] = a.MinItems
		}
	case KindStringMap:
		plain = map[string]any{"type": "object", "additionalProperties": map[string]any{"type": scalar}}
	case KindObject:
		plain = map[string]any{"type": "object"}
	default:
		return map[string]any{}
	}
	return map[string]any{"anyOf": []any{plain, expr}}
}

// minLength is the least length of a string argument.
func minLength(a ArgSpec) int {
	if a.Required && a.MinItems < 1 {
		return 1
	}
	return a.MinItems
}

// argConstraintDoc states an argument's range, items, format and default
// in words, for the JSON Schema's descriptions.
func argConstraintDoc(a ArgSpec) string {
	var parts []string
	if r := argRangeText(a); r != "" {
		parts = append(parts, "range "+r)
	}
	if a.Format != "" {
		parts = append(parts, formatDoc(a.Format))
	}
	if d := a.DefaultText(); d != "" && !strings.Contains(d, "\n") {
		parts = append(parts, "default: "+d)
	}
	if len(parts) == 0 {
		return ""
	}
	return " (" + strings.Join(parts, "; ") + ")"
}

// argRangeText is the range shown after an argument's kind: its bounds,
// or the least items of a list.
func argRangeText(a ArgSpec) string {
	if r := a.RangeText(); r != "" {
		return r
	}
	switch {
	case a.Kind == KindStringList && a.MinItems > 0:
		return fmt.Sprintf("at least %d", a.MinItems)
	case a.Kind == KindString && minLength(a) > 0:
		return "not empty"
	}
	return ""
}
