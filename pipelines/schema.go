package pipelines

import (
	"encoding/json"
	"fmt"
	"strings"
)

func kindSchema(k ArgKind) map[string]any {
	expr := map[string]any{"type": "string", "pattern": `\$\{\{`}
	switch k {
	case KindString, KindDuration:
		return map[string]any{"type": "string"}
	case KindInt:
		return map[string]any{"anyOf": []any{map[string]any{"type": "integer"}, expr}}
	case KindFloat:
		return map[string]any{"anyOf": []any{map[string]any{"type": "number"}, expr}}
	case KindBool:
		return map[string]any{"anyOf": []any{map[string]any{"type": "boolean"}, expr}}
	case KindStringList:
		return map[string]any{"type": "array", "items": map[string]any{"type": "string"}, "minItems": 1}
	case KindStringMap:
		return map[string]any{"type": "object", "additionalProperties": map[string]any{"type": "string"}}
	}
	return map[string]any{"type": "object"}
}

// JSONSchema returns a JSON Schema (draft 2020-12) of the pipeline YAML,
// generated from the step type registry, for editors.
func JSONSchema() ([]byte, error) {
	dur := map[string]any{"type": "string", "pattern": `^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`}
	retry := map[string]any{"type": "object", "additionalProperties": false, "properties": map[string]any{
		"max_attempts": map[string]any{"type": "integer", "minimum": 0}, "initial_interval": dur,
		"backoff": map[string]any{"type": "number", "minimum": 1}, "max_interval": dur,
		"non_retryable": map[string]any{"type": "array", "items": map[string]any{"type": "string"}},
	}}
	var branches []any
	for _, name := range StepTypeNames() {
		t, _ := LookupStepType(name)
		props := map[string]any{}
		var req []string
		for _, a := range t.Args {
			s := kindSchema(a.Kind)
			s["description"] = a.Doc
			if len(a.Enum) > 0 {
				s["enum"] = a.Enum
			}
			props[a.Name] = s
			if a.Required {
				req = append(req, a.Name)
			}
		}
		with := map[string]any{"type": "object", "additionalProperties": false, "properties": props}
		if len(req) > 0 {
			with["required"] = req
		}
		branches = append(branches, map[string]any{
			"if":   map[string]any{"properties": map[string]any{"uses": map[string]any{"const": name}}},
			"then": map[string]any{"properties": map[string]any{"with": with}},
		})
	}
	step := map[string]any{
		"type": "object", "additionalProperties": false, "required": []string{"id", "uses"},
		"properties": map[string]any{
			"id":         map[string]any{"type": "string", "pattern": "^[a-z][a-z0-9_-]*$"},
			"uses":       map[string]any{"enum": StepTypeNames()},
			"needs":      map[string]any{"type": "array", "items": map[string]any{"type": "string"}},
			"with":       map[string]any{"type": "object"},
			"when":       map[string]any{"type": "string"},
			"always":     map[string]any{"type": "boolean"},
			"outputs":    map[string]any{"type": "array", "items": map[string]any{"type": "string"}},
			"retry":      retry,
			"timeout":    dur,
			"heartbeat":  dur,
			"task_queue": map[string]any{"type": "string"},
		},
		"allOf": branches,
	}
	schema := map[string]any{
		"$schema": "https://json-schema.org/draft/2020-12/schema",
		"title":   "rlflow pipeline", "type": "object", "additionalProperties": false,
		"required": []string{"version", "name", "steps"},
		"properties": map[string]any{
			"version":     map[string]any{"const": SchemaVersion},
			"name":        map[string]any{"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]*$", "maxLength": 100},
			"description": map[string]any{"type": "string"},
			"base_dir":    map[string]any{"type": "string"},
			"params": map[string]any{"type": "object", "additionalProperties": map[string]any{
				"type": "object", "additionalProperties": false, "required": []string{"type"},
				"properties": map[string]any{"type": map[string]any{"enum": []string{"string", "int", "float", "bool", "duration"}},
					"default": map[string]any{}, "required": map[string]any{"type": "boolean"}, "description": map[string]any{"type": "string"}}}},
			"servers": map[string]any{"type": "array", "items": map[string]any{"type": "object", "additionalProperties": false, "required": []string{"url"},
				"properties": map[string]any{"url": map[string]any{"type": "string"}, "api_key_env": map[string]any{"type": "string"}, "api": map[string]any{"enum": []string{"A", "B", "C", "D"}}}}},
			"weight_transfer": map[string]any{"type": "object", "additionalProperties": false, "required": []string{"backend"},
				"properties": map[string]any{"backend": map[string]any{"enum": []string{"nccl", "disk"}}, "packed": map[string]any{"type": "boolean"},
					"buffer_bytes": map[string]any{"type": []string{"integer", "string"}}, "num_buffers": map[string]any{"type": "integer", "minimum": 1}}},
			"loop": map[string]any{"type": "object", "additionalProperties": false, "properties": map[string]any{
				"iterations": map[string]any{"type": "integer", "minimum": 1}, "until": map[string]any{"type": "string"},
				"max_iterations": map[string]any{"type": "integer", "minimum": 1}, "continue_as_new_every": map[string]any{"type": "integer", "minimum": 1}}},
			"max_parallel": map[string]any{"type": "integer", "minimum": 0},
			"defaults": map[string]any{"type": "object", "additionalProperties": false, "properties": map[string]any{
				"timeout": dur, "heartbeat": dur, "retry": retry, "task_queue": map[string]any{"type": "string"}}},
			"steps": map[string]any{"type": "array", "minItems": 1, "items": step},
		},
	}
	return json.MarshalIndent(schema, "", "  ")
}

// Reference returns the Markdown reference of every step type, generated
// from the registry (README links to `rlflow schema --reference`).
func Reference() string {
	var b strings.Builder
	b.WriteString("# rlflow step types\n\nGenerated from the step type registry (`rlflow schema --reference`).\n")
	for _, name := range StepTypeNames() {
		t, _ := LookupStepType(name)
		fmt.Fprintf(&b, "\n## `%s`\n\n%s\n\n| argument | type | required | description |\n|---|---|---|---|\n", t.Name, t.Doc)
		for _, a := range t.Args {
			req := ""
			if a.Required {
				req = "yes"
			}
			fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", a.Name, a.Kind, req, a.Doc)
		}
		outs := strings.Join(t.Outputs, "`, `")
		if outs != "" {
			outs = "`" + outs + "`"
		}
		if t.DeclaredOutputs {
			if outs != "" {
				outs += ", plus "
			}
			outs += "the keys declared in the step's `outputs:` (or `with.outputs`)"
		}
		fmt.Fprintf(&b, "\nOutputs: %s.\n", outs)
	}
	return b.String()
}
