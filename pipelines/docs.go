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
		if f.min != nil {
			s["minimum"] = *f.min
		}
		return s
	case reflect.Float64:
		s := map[string]any{"type": "number"}
		if f.min != nil {
			s["minimum"] = *f.min
		}
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
		} else {
			items = map[string]any{"$ref": "#/$defs/" + objectByType[t.Elem()].name}
		}
		s := map[string]any{"type": "array", "items": items}
		if f.minItems > 0 {
			s["minItems"] = f.minItems
		}
		return s
	case reflect.Pointer:
		return map[string]any{"$ref": "#/$defs/" + objectByType[t.Elem()].name}
	case reflect.Struct:
		return map[string]any{"$ref": "#/$defs/" + objectByType[t].name}
	}
	return map[string]any{}
}

func withSchema(t *StepType) map[string]any {
	props := map[string]any{}
	var required []string
	for _, a := range t.Args {
		s := argSchema(a)
		s["description"] = a.Doc
		props[a.Name] = s
		if a.Required {
			required = append(required, a.Name)
		}
	}
	s := map[string]any{"type": "object", "description": t.Doc, "additionalProperties": false, "properties": props}
	if len(required) > 0 {
		s["required"] = required
	}
	return s
}

// argSchema mirrors checkArg: any argument may instead be a single ${{ }}
// expression, and string kinds accept any scalar as its text.
func argSchema(a ArgSpec) map[string]any {
	expr := map[string]any{"$ref": "#/$defs/expression"}
	scalar := []string{"string", "number", "boolean"}
	var plain map[string]any
	switch a.Kind {
	case KindString:
		if len(a.Enum) > 0 {
			plain = map[string]any{"enum": a.Enum}
		} else {
			return map[string]any{"type": scalar}
		}
	case KindInt:
		plain = map[string]any{"type": "integer"}
	case KindFloat:
		plain = map[string]any{"type": "number"}
	case KindBool:
		plain = map[string]any{"type": "boolean"}
	case KindDuration:
		plain = map[string]any{"$ref": "#/$defs/duration"}
		expr = map[string]any{"type": "string", "pattern": `\$\{\{`}
	case KindStringList:
		plain = map[string]any{"type": "array", "items": map[string]any{"type": scalar}}
	case KindStringMap:
		plain = map[string]any{"type": "object", "additionalProperties": map[string]any{"type": scalar}}
	case KindObject:
		plain = map[string]any{"type": "object"}
	default:
		return map[string]any{}
	}
	return map[string]any{"anyOf": []any{plain, expr}}
}

// Reference returns a Markdown reference of the pipeline YAML, generated
// from the same tables as the decoder and from the registered step types.
func Reference() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("# Pipeline YAML reference\n\n")
	w("<!-- Generated by pipelines.Reference(); do not edit. Regenerate with: go test ./pipelines/ -run TestReference -update -->\n\n")
	w("A pipeline file holds one YAML document. Unknown keys are errors everywhere, and `rlflow validate` reports every problem at once as `file:line:col: field: message`. ")
	w("A key with an empty (null) value counts as absent. Strings may be written unquoted whatever they look like (`task_queue: 7` is the string \"7\").\n\n")
	w("Limits: files up to %d bytes, %d YAML nodes and %d levels of nesting (aliases expanded), %d steps, expressions up to %d bytes.\n\n",
		MaxFileBytes, MaxNodes, MaxDepth, MaxSteps, maxExprBytes)
	w("Value types: a *duration* is a Go duration string (`30s`, `5m`, `1h30m`), never negative; a *size* is a byte count, an integer or a number with `B`, `KiB`, `MiB`, `GiB`, `KB`, `MB` or `GB` (`1GiB`); an *expression* is a condition written bare or as one `${{ }}`.\n\n")
	for _, o := range objects {
		w("## %s\n\n%s\n\n", heading(o.title), o.doc)
		w("| key | type | required | description |\n|---|---|---|---|\n")
		for i := range o.fields {
			f := &o.fields[i]
			req := ""
			if f.required {
				req = "yes"
			}
			w("| `%s` | %s | %s | %s |\n", f.name, cell(refType(f, o.typ.Field(f.index).Type)), req, cell(refDoc(f)))
		}
		w("\n")
		if o == loopObj {
			w("`iterations` and `until` are mutually exclusive; `until` requires `max_iterations`.\n\n")
		}
		if o == stepObj {
			w("A step's `heartbeat` must be shorter than its `timeout` (its own or the default). `needs` may not repeat a step, name the step itself, or form a cycle.\n\n")
		}
	}
	w("## Expressions\n\n")
	w("Strings anywhere inside `with`, and the conditions `when` and `loop.until`, may hold `${{ expr }}` expressions ([expr-lang](https://expr-lang.org) syntax; `$${{` writes a literal `${{`). ")
	w("A string that is exactly one expression keeps the expression's type; otherwise the values are formatted into the text. ")
	w("The clock builtins `now()` and `date()` are disabled: expressions run inside workflow code and must be deterministic.\n\n")
	w("| variable | meaning |\n|---|---|\n")
	w("| `params.<name>` | a declared launch parameter |\n")
	w("| `steps.<id>.outputs.<key>` | an output of a step upstream of the one using it (any step in `loop.until`); the key must be one the step type produces or the step declares |\n")
	w("| `steps.<id>.status` | the status of that step |\n")
	w("| `loop.iteration` | the current iteration number |\n\n")
	w("Step ids containing `-` are reached with brackets: `steps['shard-0'].outputs.done`. Computed member names (`steps[x]`) are not checked when loading.\n\n")
	w("## Step types\n\n")
	w("Every value of `uses`. An argument of any kind may instead be a string that is exactly one `${{ }}` expression, checked when it is rendered. ")
	w("String kinds take any scalar as the text written (`env: {N: 4}` sets N to \"4\").\n\n")
	for _, name := range StepTypeNames() {
		t, _ := LookupStepType(name)
		w("### %s\n\n%s\n\n", t.Name, t.Doc)
		switch {
		case t.NeedsServers && t.NeedsWeightTransfer:
			w("Needs the pipeline's `servers:` and `weight_transfer:`.\n\n")
		case t.NeedsServers:
			w("Needs the pipeline's `servers:`.\n\n")
		}
		if len(t.Args) == 0 {
			w("No arguments.\n\n")
		} else {
			w("| argument | kind | required | description |\n|---|---|---|---|\n")
			for _, a := range t.Args {
				req := ""
				if a.Required {
					req = "yes"
				}
				doc := a.Doc
				if len(a.Enum) > 0 {
					doc += ". One of: " + backticks(a.Enum) + "."
				}
				w("| `%s` | %s | %s | %s |\n", a.Name, cell(string(a.Kind)), req, cell(doc))
			}
			w("\n")
		}
		var outs []string
		if len(t.Outputs) > 0 {
			outs = append(outs, backticks(t.Outputs))
		}
		if t.DeclaredOutputs {
			outs = append(outs, "the keys declared in the step's `outputs`")
			if _, ok := t.Arg("outputs"); ok {
				outs = append(outs, "the keys of `with.outputs`")
			}
		}
		if len(outs) == 0 {
			w("Outputs: none.\n\n")
		} else {
			w("Outputs: %s.\n\n", strings.Join(outs, "; "))
		}
	}
	return b.String()
}

func refType(f *field, t reflect.Type) string {
	switch {
	case f.kind == kindParams:
		return "mapping of `" + paramObj.title + "`"
	case f.kind == kindSize:
		return "size"
	case f.kind == kindWith:
		return "mapping"
	case f.kind == kindCondition:
		return "expression"
	case f.kind == kindAny:
		return "any"
	case t == durationType:
		return "duration"
	}
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Int, reflect.Int64:
		return "integer"
	case reflect.Float64:
		return "number"
	case reflect.Bool:
		return "bool"
	case reflect.Slice:
		if t.Elem().Kind() == reflect.String {
			return "list of strings"
		}
		return "list of `" + objectByType[t.Elem()].title + "`"
	case reflect.Pointer:
		return "`" + objectByType[t.Elem()].title + "`"
	case reflect.Struct:
		return "`" + objectByType[t].title + "`"
	}
	return t.String()
}

// heading puts schema names in code spans: "params.<name>" would otherwise
// read as an HTML tag.
func heading(title string) string {
	if strings.ContainsAny(title, "<[.") || title == strings.ToLower(title) {
		return "`" + title + "`"
	}
	return title
}

func refDoc(f *field) string {
	doc := f.doc
	if len(f.enum) > 0 {
		doc += ". One of: " + backticks(f.enum)
	}
	if f.pattern != nil {
		doc += ". Pattern: `" + f.pattern.String() + "`"
	}
	if f.maxLen > 0 {
		doc += fmt.Sprintf(". At most %d characters", f.maxLen)
	}
	if f.min != nil {
		doc += fmt.Sprintf(". Minimum: %v", *f.min)
	}
	if f.minItems > 0 {
		doc += fmt.Sprintf(". At least %d entry", f.minItems)
	}
	return doc + "."
}

func backticks(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = "`" + n + "`"
	}
	return strings.Join(q, ", ")
}

// cell escapes text for a Markdown table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}
