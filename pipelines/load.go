package pipelines

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// Limits that keep hostile files from costing unbounded time or memory.
const (
	MaxFileBytes = 4 << 20
	MaxNodes     = 100_000
	MaxDepth     = 64
	MaxAliases   = 1_000
)

// Problem is one validation error at a position of a file.
type Problem struct {
	File      string
	Line, Col int
	Field     string
	Msg       string
}

func (p Problem) String() string {
	if p.Field == "" {
		return fmt.Sprintf("%s:%d:%d: %s", p.File, p.Line, p.Col, p.Msg)
	}
	return fmt.Sprintf("%s:%d:%d: %s: %s", p.File, p.Line, p.Col, p.Field, p.Msg)
}

// ErrorList is every problem Load found, sorted by position.
type ErrorList []Problem

func (l ErrorList) Error() string {
	lines := make([]string, len(l))
	for i, p := range l {
		lines[i] = p.String()
	}
	return strings.Join(lines, "\n")
}

// LoadFile reads and loads a pipeline file.
func LoadFile(path string) (*Pipeline, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, ErrorList{{File: path, Line: 1, Col: 1, Msg: fmt.Sprintf("cannot read: %v", errors.Unwrap(err))}}
	}
	if st.Size() > MaxFileBytes {
		return nil, ErrorList{{File: path, Line: 1, Col: 1, Msg: fmt.Sprintf("file is %d bytes, over the %d-byte limit", st.Size(), MaxFileBytes)}}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, ErrorList{{File: path, Line: 1, Col: 1, Msg: fmt.Sprintf("cannot read: %v", err)}}
	}
	return Load(path, data)
}

type loader struct {
	file     string
	problems ErrorList
}

func (l *loader) addf(n *yaml.Node, field, format string, args ...any) {
	line, col := 1, 1
	if n != nil && n.Line > 0 {
		line, col = n.Line, n.Column
	}
	l.problems = append(l.problems, Problem{File: l.file, Line: line, Col: col, Field: field, Msg: fmt.Sprintf(format, args...)})
}

var yamlLine = regexp.MustCompile(`^(?:yaml: )?line (\d+): (.*)$`)

// Load parses and validates a pipeline; path names the file in errors and
// sets BaseDir (its absolute directory) unless the file sets base_dir.
func Load(path string, data []byte) (p *Pipeline, err error) {
	l := &loader{file: path}
	if len(data) > MaxFileBytes {
		l.addf(nil, "", "file is %d bytes, over the %d-byte limit", len(data), MaxFileBytes)
		return nil, l.problems
	}
	defer func() {
		if r := recover(); r != nil {
			p, err = nil, ErrorList{{File: path, Line: 1, Col: 1, Msg: fmt.Sprintf("cannot parse: %v", r)}}
		}
	}()
	var doc yaml.Node
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	if err := dec.Decode(&doc); err != nil {
		line, msg := 1, strings.TrimPrefix(err.Error(), "yaml: ")
		if m := yamlLine.FindStringSubmatch(msg); m != nil {
			line, _ = strconv.Atoi(m[1])
			msg = m[2]
		}
		if err.Error() == "EOF" {
			msg = "file is empty"
		}
		l.problems = append(l.problems, Problem{File: path, Line: line, Col: 1, Msg: "yaml: " + msg})
		return nil, l.problems
	}
	var extra yaml.Node
	if dec.Decode(&extra) == nil {
		l.addf(&extra, "", "only one YAML document is allowed")
		return nil, l.problems
	}
	if !l.checkShape(&doc) {
		return nil, l.problems
	}
	root := &doc
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = root.Content[0]
	}
	if root.Kind != yaml.MappingNode {
		l.addf(root, "", "a pipeline must be a YAML mapping")
		return nil, l.problems
	}
	p = l.pipeline(root)
	if p != nil {
		if p.BaseDir == "" {
			if abs, err := filepath.Abs(filepath.Dir(path)); err == nil {
				p.BaseDir = abs
			}
		}
		l.semantic(p, root)
	}
	if len(l.problems) > 0 {
		sort.SliceStable(l.problems, func(i, j int) bool {
			a, b := l.problems[i], l.problems[j]
			if a.Line != b.Line {
				return a.Line < b.Line
			}
			if a.Col != b.Col {
				return a.Col < b.Col
			}
			return a.Msg < b.Msg
		})
		return nil, l.problems
	}
	return p, nil
}

// checkShape bounds node count, depth and alias use before any decoding,
// so alias bombs and deep nesting are refused cheaply.
func (l *loader) checkShape(doc *yaml.Node) bool {
	nodes, aliases := 0, 0
	var walk func(n *yaml.Node, depth int) bool
	walk = func(n *yaml.Node, depth int) bool {
		nodes++
		if nodes > MaxNodes {
			l.addf(n, "", "more than %d YAML nodes", MaxNodes)
			return false
		}
		if depth > MaxDepth {
			l.addf(n, "", "nesting deeper than %d levels", MaxDepth)
			return false
		}
		if n.Kind == yaml.AliasNode {
			aliases++
			if aliases > MaxAliases {
				l.addf(n, "", "more than %d YAML aliases", MaxAliases)
				return false
			}
			// An alias is not walked again: its anchor was already counted.
			return true
		}
		for _, c := range n.Content {
			if !walk(c, depth+1) {
				return false
			}
		}
		return true
	}
	return walk(doc, 0)
}

// mapping returns a mapping node's key/value pairs, reporting unknown keys
// and duplicate keys against the allowed set.
func (l *loader) mapping(n *yaml.Node, field string, allowed ...string) map[string]*yaml.Node {
	out := map[string]*yaml.Node{}
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Kind != yaml.MappingNode {
		l.addf(n, field, "want a mapping, got %s", kindName(n))
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if v.Kind == yaml.AliasNode {
			v = v.Alias
		}
		if _, dup := out[k.Value]; dup {
			l.addf(k, join(field, k.Value), "duplicate key")
			continue
		}
		if allowed != nil && !contains(allowed, k.Value) {
			l.addf(k, join(field, k.Value), "unknown key%s", suggest(k.Value, allowed))
			continue
		}
		out[k.Value] = v
	}
	return out
}

func join(field, key string) string {
	if field == "" {
		return key
	}
	return field + "." + key
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		if n.Tag == "!!null" {
			return "null"
		}
		return fmt.Sprintf("%q", n.Value)
	}
	return "something else"
}

// suggest returns ` (did you mean "x"?)` for a near miss, or the allowed list.
func suggest(got string, allowed []string) string {
	best, bestD := "", 3
	for _, a := range allowed {
		if d := editDistance(got, a); d < bestD {
			best, bestD = a, d
		}
	}
	if best != "" {
		return fmt.Sprintf(" %q (did you mean %q?)", got, best)
	}
	s := append([]string(nil), allowed...)
	sort.Strings(s)
	return fmt.Sprintf(" %q (want one of %s)", got, strings.Join(s, ", "))
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

func (l *loader) str(n *yaml.Node, field string) (string, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag == "!!null" {
		l.addf(n, field, "want a string, got %s", kindName(n))
		return "", false
	}
	return n.Value, true
}

func (l *loader) integer(n *yaml.Node, field string) (int, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!int" {
		l.addf(n, field, "want an integer, got %s", kindName(n))
		return 0, false
	}
	v, err := strconv.ParseInt(n.Value, 0, 64)
	if err != nil || v > 1<<31 || v < -(1<<31) {
		l.addf(n, field, "integer %s out of range", n.Value)
		return 0, false
	}
	return int(v), true
}

func (l *loader) float(n *yaml.Node, field string) (float64, bool) {
	if n.Kind != yaml.ScalarNode || (n.Tag != "!!int" && n.Tag != "!!float") {
		l.addf(n, field, "want a number, got %s", kindName(n))
		return 0, false
	}
	v, err := strconv.ParseFloat(n.Value, 64)
	if err != nil {
		l.addf(n, field, "bad number %s", n.Value)
		return 0, false
	}
	return v, true
}

func (l *loader) boolean(n *yaml.Node, field string) (bool, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
		l.addf(n, field, "want true or false, got %s", kindName(n))
		return false, false
	}
	return n.Value == "true", true
}

func (l *loader) duration(n *yaml.Node, field string) (Duration, bool) {
	s, ok := l.str(n, field)
	if !ok {
		return 0, false
	}
	d, err := ParseDuration(s)
	if err != nil {
		l.addf(n, field, "%v", err)
		return 0, false
	}
	return d, true
}

func (l *loader) strList(n *yaml.Node, field string) []string {
	if n.Kind != yaml.SequenceNode {
		l.addf(n, field, "want a list of strings, got %s", kindName(n))
		return nil
	}
	out := []string{}
	for i, c := range n.Content {
		if s, ok := l.str(c, fmt.Sprintf("%s[%d]", field, i)); ok {
			out = append(out, s)
		}
	}
	return out
}

// value converts a YAML node into plain JSON-compatible Go data.
func (l *loader) value(n *yaml.Node, field string) any {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	switch n.Kind {
	case yaml.ScalarNode:
		switch n.Tag {
		case "!!null":
			return nil
		case "!!bool":
			return n.Value == "true"
		case "!!int":
			if v, err := strconv.ParseInt(n.Value, 0, 64); err == nil {
				return v
			}
			l.addf(n, field, "integer %s out of range", n.Value)
			return nil
		case "!!float":
			v, err := strconv.ParseFloat(n.Value, 64)
			if err != nil {
				l.addf(n, field, "bad number %s", n.Value)
			}
			return v
		default:
			return n.Value
		}
	case yaml.SequenceNode:
		out := make([]any, len(n.Content))
		for i, c := range n.Content {
			out[i] = l.value(c, fmt.Sprintf("%s[%d]", field, i))
		}
		return out
	case yaml.MappingNode:
		out := map[string]any{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i].Value
			if _, dup := out[k]; dup {
				l.addf(n.Content[i], join(field, k), "duplicate key")
			}
			out[k] = l.value(n.Content[i+1], join(field, k))
		}
		return out
	}
	return nil
}
