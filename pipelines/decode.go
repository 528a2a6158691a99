package pipelines

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// The decoder maps the yaml.v3 node tree onto the types in types.go, driven
// by the schema tables. Unlike yaml.v3's own decoding it is strict (unknown
// keys, duplicate keys and YAML 1.1 surprises like `yes` are errors), keeps
// going after an error so that all problems are reported at once, and
// records the node of every field path for the semantic checks.

// deref follows an alias to its anchored node. measure has already refused
// aliases that loop.
func deref(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && i < 8; i++ {
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	n = deref(n)
	return n == nil || (n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null")
}

// describe names what a node holds, for "must be X, got Y" messages.
func describe(n *yaml.Node) string {
	n = deref(n)
	if n == nil {
		return "nothing"
	}
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.DocumentNode:
		return "a document"
	}
	v := n.Value
	if len(v) > 40 {
		v = v[:37] + "..."
	}
	switch n.ShortTag() {
	case "!!null":
		return "null"
	case "!!bool":
		return "bool " + v
	case "!!int":
		return "integer " + v
	case "!!float":
		return "float " + v
	case "!!str":
		return fmt.Sprintf("string %q", v)
	}
	return fmt.Sprintf("%s %q", n.ShortTag(), v)
}

// standardTags are the tags the decoder understands; anything else (a
// custom !tag) is refused rather than silently read as a string.
var standardTags = map[string]bool{
	"!!str": true, "!!int": true, "!!float": true, "!!bool": true, "!!null": true,
	"!!timestamp": true, "!!binary": true, "!!map": true, "!!seq": true, "!!merge": true,
}

func (l *loader) checkTag(n *yaml.Node, path string) bool {
	if standardTags[n.ShortTag()] {
		return true
	}
	l.errNode(n, path, "unsupported YAML tag %s", n.Tag)
	return false
}

type entry struct {
	key  string
	k, v *yaml.Node
}

// entries returns the key/value pairs of a mapping, with `<<` merge keys
// expanded (explicit keys win, as in YAML 1.1). Duplicate and non-scalar
// keys are reported and dropped.
func (l *loader) entries(n *yaml.Node, path string) []entry {
	var out []entry
	seen := map[string]*yaml.Node{}
	var merges []*yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			merges = append(merges, v)
			continue
		}
		dk := deref(k)
		if dk.Kind != yaml.ScalarNode {
			l.errNode(k, path, "mapping keys must be scalars, got %s", describe(k))
			continue
		}
		key := dk.Value
		if first, dup := seen[key]; dup {
			l.errNode(k, joinPath(path, key), "duplicate key %q (first defined at line %d)", clip(key), first.Line)
			continue
		}
		seen[key] = k
		out = append(out, entry{key, k, v})
	}
	for _, m := range merges {
		var sources []*yaml.Node
		switch dm := deref(m); dm.Kind {
		case yaml.MappingNode:
			sources = []*yaml.Node{dm}
		case yaml.SequenceNode:
			sources = append(sources, dm.Content...)
		default:
			sources = []*yaml.Node{m}
		}
		for _, s := range sources {
			ds := deref(s)
			if ds.Kind != yaml.MappingNode {
				l.errNode(s, path, "a << merge needs a mapping or a list of mappings, got %s", describe(s))
				continue
			}
			for _, e := range l.entries(ds, path) {
				if _, ok := seen[e.key]; !ok {
					seen[e.key] = e.k
					out = append(out, e)
				}
			}
		}
	}
	return out
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func indexPath(path string, i int) string { return fmt.Sprintf("%s[%d]", path, i) }

// decodeObject decodes mapping n into the struct rv described by obj.
func (l *loader) decodeObject(n *yaml.Node, rv reflect.Value, obj *object, path string) {
	dn := deref(n)
	if dn.Kind != yaml.MappingNode {
		l.errNode(n, path, "must be a mapping, got %s", describe(n))
		return
	}
	seen := map[string]bool{}
	for _, e := range l.entries(dn, path) {
		p := joinPath(path, e.key)
		f := obj.field(e.key)
		if f == nil {
			hint := didYouMean(e.key, obj.keyNames())
			if hint == "" {
				hint = " (want " + joinNames(obj.keyNames()) + ")"
			}
			l.errNode(e.k, p, "unknown key %q%s", clip(e.key), hint)
			continue
		}
		l.keys[p] = e.k
		if isNull(e.v) {
			// An empty value means the key is absent, as in most YAML tools;
			// it keeps `params:` with every entry commented out valid.
			if f.required {
				l.errNode(e.k, p, "is required; the value is empty")
				seen[e.key] = true
			}
			continue
		}
		seen[e.key] = true
		l.pos[p] = e.v
		before := len(l.errs)
		l.decodeField(e.v, rv.Field(f.index), f, p)
		if len(l.errs) != before {
			l.bad[p] = true
		}
	}
	for _, f := range obj.fields {
		if f.required && !seen[f.name] {
			l.errNode(n, joinPath(path, f.name), "is required")
		}
	}
}

func (l *loader) decodeField(n *yaml.Node, rv reflect.Value, f *field, path string) {
	switch f.kind {
	case kindParams:
		l.decodeParams(n, path)
		return
	case kindSize:
		if v, ok := l.size(n, path); ok {
			rv.SetInt(v)
		}
		return
	case kindWith:
		if deref(n).Kind != yaml.MappingNode {
			l.errNode(n, path, "must be a mapping of arguments, got %s", describe(n))
			return
		}
		if v, ok := l.decodeAny(n, path).(map[string]any); ok {
			rv.Set(reflect.ValueOf(v))
		}
		return
	case kindAny:
		if v := l.decodeAny(n, path); v != nil {
			rv.Set(reflect.ValueOf(v))
		}
		return
	}
	t := rv.Type()
	if t == durationType {
		if dn := deref(n); dn.Kind != yaml.ScalarNode {
			l.errNode(n, path, "must be a duration like 30s or 1h30m, got %s", describe(n))
			return
		}
		if s, ok := l.str(n, path); ok {
			d, err := ParseDuration(s)
			if err == nil {
				err = f.spec(t).Check(d)
			}
			if err != nil {
				l.errNode(n, path, "%v", err)
				return
			}
			rv.SetInt(int64(d))
		}
		return
	}
	switch t.Kind() {
	case reflect.String:
		if s, ok := l.str(n, path); ok && l.checkString(n, s, f, path) {
			rv.SetString(s)
		}
	case reflect.Int, reflect.Int64:
		if v, ok := l.integer(n, path); ok && l.checkRange(n, float64(v), f, path) {
			rv.SetInt(v)
		}
	case reflect.Float64:
		if v, ok := l.float(n, path); ok && l.checkRange(n, v, f, path) {
			rv.SetFloat(v)
		}
	case reflect.Bool:
		if v, ok := l.boolean(n, path); ok {
			rv.SetBool(v)
		}
	case reflect.Slice:
		dn := deref(n)
		if dn.Kind != yaml.SequenceNode {
			what := "a list"
			if t.Elem().Kind() == reflect.String {
				what = "a list of strings"
			}
			l.errNode(n, path, "must be %s, got %s", what, describe(n))
			return
		}
		if len(dn.Content) < f.minItems {
			l.errNode(n, path, "must have at least %d entry", f.minItems)
			return
		}
		out := reflect.MakeSlice(t, len(dn.Content), len(dn.Content))
		for i, c := range dn.Content {
			p := indexPath(path, i)
			l.pos[p] = c
			switch t.Elem().Kind() {
			case reflect.String:
				if s, ok := l.str(c, p); ok && l.checkString(c, s, f, p) {
					out.Index(i).SetString(s)
				} else {
					l.bad[p] = true
				}
			case reflect.Struct:
				l.decodeObject(c, out.Index(i), objectByType[t.Elem()], p)
			}
		}
		rv.Set(out)
	case reflect.Map:
		// A mapping of strings (trainer.env): any scalar is taken as the
		// text written, as step arguments of kind map of strings are.
		dn := deref(n)
		if dn.Kind != yaml.MappingNode {
			l.errNode(n, path, "must be a mapping of strings, got %s", describe(n))
			return
		}
		out := reflect.MakeMap(t)
		for _, e := range l.entries(dn, path) {
			p := joinPath(path, e.key)
			l.pos[p] = e.v
			dv := deref(e.v)
			if dv.Kind != yaml.ScalarNode || dv.ShortTag() == "!!null" {
				l.errNode(e.v, p, "must be a string, got %s", describe(e.v))
				l.bad[p] = true
				continue
			}
			if !envVarRe.MatchString(e.key) {
				l.errNode(e.k, p, "key must name an environment variable (%s)", strings.Trim(envVarRe.String(), "^$"))
				l.bad[p] = true
				continue
			}
			out.SetMapIndex(reflect.ValueOf(e.key), reflect.ValueOf(dv.Value))
		}
		rv.Set(out)
	case reflect.Pointer:
		v := reflect.New(t.Elem())
		l.decodeObject(n, v.Elem(), objectByType[t.Elem()], path)
		rv.Set(v)
	case reflect.Struct:
		l.decodeObject(n, rv, objectByType[t], path)
	default:
		panic(fmt.Sprintf("pipelines: no decoder for %s (%s)", path, t))
	}
}

// checkString applies a field's enum, pattern and length constraints.
func (l *loader) checkString(n *yaml.Node, s string, f *field, path string) bool {
	if f.check != nil {
		if msg := f.check(s); msg != "" {
			l.errNode(n, path, "%s", msg)
			return false
		}
	}
	switch {
	case f.check == nil && len(f.enum) > 0 && !contains(f.enum, s):
		l.errNode(n, path, "%q is not one of %s%s", clip(s), joinNames(f.enum), didYouMean(s, f.enum))
		return false
	case f.maxLen > 0 && len(s) > f.maxLen:
		l.errNode(n, path, "must be at most %d characters, got %d", f.maxLen, len(s))
		return false
	case f.pattern != nil && !f.pattern.MatchString(s):
		l.errNode(n, path, "%q must match %s", clip(s), f.pattern)
		return false
	}
	return true
}

// checkRange applies a number field's bounds, quoting the value as written.
func (l *loader) checkRange(n *yaml.Node, v float64, f *field, path string) bool {
	switch {
	case f.min != nil && v < *f.min:
		l.errNode(n, path, "must be at least %s, got %s", formatFloat(*f.min), deref(n).Value)
		return false
	case f.max != nil && v > *f.max:
		l.errNode(n, path, "must be at most %s, got %s", formatFloat(*f.max), deref(n).Value)
		return false
	}
	return true
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// clip shortens s for a message.
func clip(s string) string {
	if len(s) > 60 {
		return s[:57] + "..."
	}
	return s
}

// str reads any non-null scalar as text, exactly as written: schema strings
// such as `task_queue: 7` or `when: true` need no quotes.
func (l *loader) str(n *yaml.Node, path string) (string, bool) {
	dn := deref(n)
	if dn.Kind != yaml.ScalarNode || dn.ShortTag() == "!!null" {
		l.errNode(n, path, "must be a string, got %s", describe(n))
		return "", false
	}
	if !l.checkTag(dn, path) {
		return "", false
	}
	return dn.Value, true
}

func (l *loader) integer(n *yaml.Node, path string) (int64, bool) {
	dn := deref(n)
	if dn.Kind != yaml.ScalarNode || dn.ShortTag() != "!!int" {
		l.errNode(n, path, "must be an integer, got %s", describe(n))
		return 0, false
	}
	var v int64
	if err := dn.Decode(&v); err != nil {
		l.errNode(n, path, "integer %s is out of range", dn.Value)
		return 0, false
	}
	return v, true
}

func isRangeError(_ float64, err error) bool { return errors.Is(err, strconv.ErrRange) }

func (l *loader) float(n *yaml.Node, path string) (float64, bool) {
	dn := deref(n)
	if dn.Kind != yaml.ScalarNode || (dn.ShortTag() != "!!int" && dn.ShortTag() != "!!float") {
		if dn.Kind == yaml.ScalarNode && dn.Style == 0 && isRangeError(strconv.ParseFloat(dn.Value, 64)) {
			// yaml.v3 reads a plain 1e309 as a string.
			l.errNode(n, path, "number %s is out of range: a float64 holds at most about 1.8e308", dn.Value)
			return 0, false
		}
		l.errNode(n, path, "must be a number, got %s", describe(n))
		return 0, false
	}
	var v float64
	if err := dn.Decode(&v); err != nil {
		l.errNode(n, path, "number %s is out of range", dn.Value)
		return 0, false
	}
	if math.IsInf(v, 0) || math.IsNaN(v) {
		// JSON, and so Temporal's payloads, cannot carry them.
		l.errNode(n, path, "must be a finite number, got %s", dn.Value)
		return 0, false
	}
	return v, true
}

func (l *loader) boolean(n *yaml.Node, path string) (bool, bool) {
	dn := deref(n)
	if dn.Kind != yaml.ScalarNode || dn.ShortTag() != "!!bool" {
		l.errNode(n, path, "must be true or false, got %s", describe(n))
		return false, false
	}
	var v bool
	if err := dn.Decode(&v); err != nil {
		l.errNode(n, path, "must be true or false, got %s", describe(n))
		return false, false
	}
	return v, true
}

var sizeUnits = map[string]int64{"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}

// size reads a positive byte count: an integer or a string like "1GiB".
func (l *loader) size(n *yaml.Node, path string) (int64, bool) {
	dn := deref(n)
	if dn.Kind == yaml.ScalarNode && dn.ShortTag() == "!!int" {
		v, ok := l.integer(n, path)
		if ok && v <= 0 {
			l.errNode(n, path, "must be positive, got %d", v)
			return 0, false
		}
		return v, ok
	}
	s, ok := l.str(n, path)
	if !ok {
		return 0, false
	}
	v, err := ParseSize(s)
	if err != nil {
		l.errNode(n, path, "%v", err)
		return 0, false
	}
	return v, true
}

// ParseSize parses a positive byte count: "1024", "64MiB", "1 GB".
func ParseSize(s string) (int64, error) {
	m := sizeRe.FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("invalid size %q (want bytes, or a number with B, KiB, MiB, GiB, KB, MB or GB)", clip(s))
	}
	v, err := strconv.ParseInt(m[1], 10, 64)
	unit := sizeUnits[m[2]]
	if err != nil || v > math.MaxInt64/unit {
		return 0, fmt.Errorf("size %q is out of range", clip(s))
	}
	if v == 0 {
		return 0, fmt.Errorf("size %q must be positive", clip(s))
	}
	return v * unit, nil
}

// decodeAny decodes free-form YAML (step arguments, param defaults) into
// plain values: map[string]any, []any, string, int64, float64, bool, nil.
// Timestamps and binary stay the strings they were written as.
func (l *loader) decodeAny(n *yaml.Node, path string) any {
	l.pos[path] = n
	before := len(l.errs)
	defer func() {
		if len(l.errs) != before {
			l.bad[path] = true
		}
	}()
	dn := deref(n)
	switch dn.Kind {
	case yaml.MappingNode:
		m := make(map[string]any, len(dn.Content)/2)
		for _, e := range l.entries(dn, path) {
			p := joinPath(path, e.key)
			l.keys[p] = e.k
			m[e.key] = l.decodeAny(e.v, p)
		}
		return m
	case yaml.SequenceNode:
		s := make([]any, len(dn.Content))
		for i, c := range dn.Content {
			s[i] = l.decodeAny(c, indexPath(path, i))
		}
		return s
	case yaml.ScalarNode:
		if !l.checkTag(dn, path) {
			return nil
		}
		switch dn.ShortTag() {
		case "!!null":
			return nil
		case "!!bool":
			if v, ok := l.boolean(n, path); ok {
				return v
			}
		case "!!int":
			if v, ok := l.integer(n, path); ok {
				return v
			}
		case "!!float":
			if v, ok := l.float(n, path); ok {
				return v
			}
		default:
			return dn.Value
		}
		return nil
	}
	l.errNode(n, path, "unexpected %s", describe(n))
	return nil
}

// decodeParams decodes the params mapping, keeping file order.
func (l *loader) decodeParams(n *yaml.Node, path string) {
	dn := deref(n)
	if dn.Kind != yaml.MappingNode {
		l.errNode(n, path, "must be a mapping from param name to {type, default, required, description}, got %s", describe(n))
		return
	}
	for _, e := range l.entries(dn, path) {
		p := joinPath(path, e.key)
		l.keys[p] = e.k
		l.pos[p] = e.v
		if !identRe.MatchString(e.key) {
			l.errNode(e.k, p, "invalid param name %q: want a letter or _, then letters, digits or _", clip(e.key))
			continue
		}
		param := Param{Name: e.key}
		if dv := deref(e.v); dv == nil || dv.Kind != yaml.MappingNode {
			at := e.v
			if isNull(e.v) {
				at = e.k
			}
			l.errNode(at, p, "must be a mapping like {type: int, default: 5}, got %s", describe(e.v))
			continue
		}
		l.decodeObject(e.v, reflect.ValueOf(&param).Elem(), paramObj, p)
		if param.Type != "" && !l.bad[p+".type"] && !l.bad[p+".default"] {
			l.checkParam(&param, p)
		}
		l.p.Params = append(l.p.Params, param)
	}
}

// checkParam coerces a declared default to the param's type.
func (l *loader) checkParam(param *Param, path string) {
	_, hasDefault := l.pos[path+".default"]
	if param.Required && hasDefault {
		l.errPath(path+".required", "a required param cannot have a default")
	}
	if !hasDefault {
		return
	}
	dn := deref(l.pos[path+".default"])
	v := param.Default
	if param.Type == ParamString {
		// Any scalar reads as the text written, like other strings.
		if _, isStr := v.(string); !isStr {
			if dn.Kind != yaml.ScalarNode {
				l.errPath(path+".default", "must be a string, got %s", describe(dn))
				return
			}
			v = dn.Value
		}
	}
	c, err := coerceParam(param.Type, v, false)
	if err != nil {
		l.errPath(path+".default", "%v", err)
		return
	}
	param.Default = c
}

func (l *loader) uniqueStrings(list []string, path, what string) {
	seen := map[string]int{}
	for i, s := range list {
		if l.bad[indexPath(path, i)] {
			continue
		}
		if j, dup := seen[s]; dup {
			l.errPath(indexPath(path, i), "duplicate %s %q (also at index %d)", what, clip(s), j)
			continue
		}
		seen[s] = i
	}
}
