package pipelines

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
)

// argField is one argument field of an input struct.
type argField struct {
	name   string // JSON name
	goName string
	index  []int
	typ    reflect.Type
}

// argFields lists the JSON-named fields of struct type t as encoding/json
// sees them: exported, not tagged "-", embedded structs without a name
// flattened; the ContextArg field is left out.
func argFields(t reflect.Type) []argField {
	var out []argField
	var walk func(t reflect.Type, index []int)
	walk = func(t reflect.Type, index []int) {
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			idx := append(append([]int(nil), index...), i)
			tag := f.Tag.Get("json")
			if tag == "-" {
				continue
			}
			name, _, _ := strings.Cut(tag, ",")
			if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
				walk(f.Type, idx)
				continue
			}
			if !f.IsExported() {
				continue
			}
			if name == "" {
				name = f.Name
			}
			if name == ContextArg {
				continue
			}
			out = append(out, argField{name: name, goName: f.Name, index: idx, typ: f.Type})
		}
	}
	walk(t, nil)
	return out
}

// ResolveArgs fills the unset fields of in, a pointer to a step type's
// input struct whose fields are named by their json tags (embedded structs
// are walked; the ContextArg field is skipped), with their ArgSpecs'
// Defaults, and checks every set field with Check. A field is unset when it
// holds its zero value or is a nil pointer, slice or map (or a JSON null);
// an unset Required argument is an error. Activities call it first thing:
// the values were rendered from expressions and may be anything. Every
// problem is reported, each naming its argument ("n: 5000 is out of range
// 1..1024"), joined with "; ". A field without an ArgSpec is an error too
// (ArgsStructProblems catches that in a test first). The step type's
// Validate hook is not run: object arguments check themselves (ParseScorer).
func ResolveArgs(stepType string, in any) error {
	t, ok := LookupStepType(stepType)
	if !ok {
		return fmt.Errorf("unknown step type %q", stepType)
	}
	rv := reflect.ValueOf(in)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("%s arguments: want a non-nil pointer to a struct, got %T", stepType, in)
	}
	if probs := resolveFields(t.Name, t.Args, rv.Elem(), nil); len(probs) > 0 {
		return errors.New(strings.Join(probs, "; "))
	}
	return nil
}

// resolveFields is ResolveArgs over any spec list; names in skip are
// fields without a spec on purpose (a scorer's type).
func resolveFields(owner string, specs []ArgSpec, rv reflect.Value, skip map[string]bool) []string {
	var probs []string
	for _, f := range argFields(rv.Type()) {
		if skip[f.name] {
			continue
		}
		spec, ok := findArg(specs, f.name)
		if !ok {
			probs = append(probs, fmt.Sprintf("%s: field %s has no argument spec in %s", f.name, f.goName, owner))
			continue
		}
		fv := rv.FieldByIndex(f.index)
		if isUnset(fv) {
			switch {
			case spec.Required:
				probs = append(probs, f.name+": is required")
			case spec.Default != nil:
				if err := setValue(fv, spec.Default); err != nil {
					probs = append(probs, fmt.Sprintf("%s: default: %v", f.name, err))
				}
			}
			continue
		}
		if err := spec.Check(fieldValue(fv)); err != nil {
			probs = append(probs, f.name+": "+err.Error())
		}
	}
	return probs
}

var rawMessageType = reflect.TypeOf(json.RawMessage(nil))

func isUnset(fv reflect.Value) bool {
	if fv.IsZero() {
		return true
	}
	if fv.Type() == rawMessageType {
		// An absent object may come as no bytes at all or as JSON null.
		raw := string(bytes.TrimSpace(fv.Bytes()))
		return raw == "" || raw == "null"
	}
	return false
}

// fieldValue is a set field's value as Check takes it.
func fieldValue(fv reflect.Value) any {
	if fv.Kind() == reflect.Pointer {
		fv = fv.Elem()
	}
	switch {
	case fv.Type() == durationType:
		return Duration(fv.Int())
	case fv.Type() == rawMessageType:
		return json.RawMessage(fv.Bytes())
	}
	switch fv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return fv.Int()
	case reflect.Float32, reflect.Float64:
		return fv.Float()
	case reflect.String:
		return fv.String()
	case reflect.Bool:
		return fv.Bool()
	}
	return fv.Interface()
}

// setValue stores def, a Default, in fv (allocating a pointer's target).
func setValue(fv reflect.Value, def any) error {
	if fv.Kind() == reflect.Pointer {
		p := reflect.New(fv.Type().Elem())
		if err := setValue(p.Elem(), def); err != nil {
			return err
		}
		fv.Set(p)
		return nil
	}
	switch x := def.(type) {
	case int64:
		switch fv.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			if fv.OverflowInt(x) {
				return fmt.Errorf("%d overflows %s", x, fv.Type())
			}
			fv.SetInt(x)
			return nil
		case reflect.Float32, reflect.Float64:
			fv.SetFloat(float64(x))
			return nil
		}
	case float64:
		if fv.Kind() == reflect.Float64 || fv.Kind() == reflect.Float32 {
			fv.SetFloat(x)
			return nil
		}
	case string:
		if fv.Kind() == reflect.String {
			fv.SetString(x)
			return nil
		}
	case bool:
		if fv.Kind() == reflect.Bool {
			fv.SetBool(x)
			return nil
		}
	case Duration:
		if fv.Type() == durationType {
			fv.SetInt(int64(x))
			return nil
		}
	case []string:
		if fv.Type() == reflect.TypeOf(x) {
			fv.Set(reflect.ValueOf(append([]string(nil), x...)))
			return nil
		}
	}
	return fmt.Errorf("a %T default does not fit a %s field", def, fv.Type())
}

// ArgsStructProblems compares a step type's ArgSpecs with its input struct
// type (or a pointer to it): every ArgSpec has a field with its JSON name
// and every field (but ContextArg) an ArgSpec; each field's Go type fits
// its Kind (KindInt: int, int64 or pointers to them; KindFloat: float64 or
// *float64; KindString: string; KindBool: bool or *bool; KindDuration:
// Duration; KindStringList: []string; KindStringMap: map[string]string;
// KindObject: json.RawMessage or map[string]any); a Default has the Go
// type its Kind names and passes Check; and where the zero value would be
// ambiguous (a number, duration or bool whose zero is in range while the
// Default is not that zero, or there is none) the field is a pointer, so
// that "unset" and "explicit zero" differ. It returns every problem,
// sorted; none means ResolveArgs can serve the struct.
func ArgsStructProblems(stepType string, t reflect.Type) []string {
	st, ok := LookupStepType(stepType)
	if !ok {
		return []string{fmt.Sprintf("unknown step type %q", stepType)}
	}
	return argsStructProblems(st.Name, st.Args, t, nil)
}

func argsStructProblems(owner string, specs []ArgSpec, t reflect.Type, skip map[string]bool) []string {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.Kind() != reflect.Struct {
		return []string{fmt.Sprintf("%s arguments: want a struct type, got %v", owner, t)}
	}
	var probs []string
	seen := map[string]bool{}
	for _, f := range argFields(t) {
		if skip[f.name] {
			continue
		}
		where := fmt.Sprintf("field %s (json %q)", f.goName, f.name)
		if seen[f.name] {
			probs = append(probs, where+": the JSON name is used twice")
			continue
		}
		seen[f.name] = true
		spec, ok := findArg(specs, f.name)
		if !ok {
			probs = append(probs, fmt.Sprintf("%s: %s has no argument %q", where, owner, f.name))
			continue
		}
		if want := kindGoTypes(spec.Kind); !typeFits(f.typ, spec.Kind) {
			probs = append(probs, fmt.Sprintf("%s: is %s; an argument of kind %s needs %s", where, f.typ, spec.Kind, want))
			continue
		}
		if f.typ.Kind() != reflect.Pointer {
			if zero, ok := kindZero(spec.Kind); ok && spec.Check(zero) == nil && !reflect.DeepEqual(spec.Default, zero) {
				def := "it has no default"
				if spec.Default != nil {
					def = "its default is " + formatDefault(spec.Default)
				}
				probs = append(probs, fmt.Sprintf("%s: %s is a valid value but %s: make the field a pointer so that an explicit %s is not taken for unset",
					where, formatDefault(zero), def, formatDefault(zero)))
			}
		}
	}
	for _, a := range specs {
		if !seen[a.Name] {
			probs = append(probs, fmt.Sprintf("argument %q of %s: no field has the JSON name %q", a.Name, owner, a.Name))
		}
	}
	probs = append(probs, specProblems(owner, specs)...)
	sort.Strings(probs)
	return probs
}

// specProblems checks a spec list by itself: each Default has the Go type
// its Kind names and passes its own Check.
func specProblems(owner string, specs []ArgSpec) []string {
	var probs []string
	for _, a := range specs {
		if a.Default == nil {
			continue
		}
		where := fmt.Sprintf("argument %q of %s", a.Name, owner)
		if want := kindDefaultType(a.Kind); want == nil || reflect.TypeOf(a.Default) != want {
			probs = append(probs, fmt.Sprintf("%s: Default is %T, want %v for kind %s", where, a.Default, want, a.Kind))
			continue
		}
		if err := a.Check(a.Default); err != nil {
			probs = append(probs, fmt.Sprintf("%s: Default %s fails its own check: %v", where, formatDefault(a.Default), err))
		}
	}
	return probs
}

var (
	intType       = reflect.TypeOf(int(0))
	int64Type     = reflect.TypeOf(int64(0))
	float64Type   = reflect.TypeOf(float64(0))
	stringType    = reflect.TypeOf("")
	boolType      = reflect.TypeOf(false)
	stringsType   = reflect.TypeOf([]string(nil))
	stringMapType = reflect.TypeOf(map[string]string(nil))
	anyMapType    = reflect.TypeOf(map[string]any(nil))
)

func typeFits(t reflect.Type, k ArgKind) bool {
	elem := t
	if t.Kind() == reflect.Pointer {
		elem = t.Elem()
	}
	switch k {
	case KindInt:
		return elem == intType || elem == int64Type
	case KindFloat:
		return elem == float64Type
	case KindString:
		return t == stringType
	case KindBool:
		return elem == boolType
	case KindDuration:
		return t == durationType
	case KindStringList:
		return t == stringsType
	case KindStringMap:
		return t == stringMapType
	case KindObject:
		return t == rawMessageType || t == anyMapType
	}
	return false
}

func kindGoTypes(k ArgKind) string {
	switch k {
	case KindInt:
		return "int, int64, *int or *int64"
	case KindFloat:
		return "float64 or *float64"
	case KindString:
		return "string"
	case KindBool:
		return "bool or *bool"
	case KindDuration:
		return "pipelines.Duration"
	case KindStringList:
		return "[]string"
	case KindStringMap:
		return "map[string]string"
	case KindObject:
		return "json.RawMessage or map[string]any"
	}
	return "nothing (unknown kind)"
}

func kindDefaultType(k ArgKind) reflect.Type {
	switch k {
	case KindInt:
		return int64Type
	case KindFloat:
		return float64Type
	case KindString:
		return stringType
	case KindBool:
		return boolType
	case KindDuration:
		return durationType
	case KindStringList:
		return stringsType
	case KindStringMap:
		return stringMapType
	case KindObject:
		return anyMapType
	}
	return nil
}

// kindZero is the zero value of the kinds whose zero can be ambiguous.
func kindZero(k ArgKind) (any, bool) {
	switch k {
	case KindInt:
		return int64(0), true
	case KindFloat:
		return float64(0), true
	case KindBool:
		return false, true
	case KindDuration:
		return Duration(0), true
	}
	return nil, false
}
