package pipelines

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"

	"gopkg.in/yaml.v3"
)

// FieldError is one problem in a pipeline file, located at the YAML node that
// caused it. Line and Col are 1-based; Col counts characters, as yaml.v3 does.
type FieldError struct {
	File string
	Line int
	Col  int
	// Field is the path of the offending value in YAML names, e.g.
	// "steps[1].with.command"; empty for problems with the file as a whole.
	Field string
	Msg   string
}

func (e *FieldError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("%s:%d:%d: %s", e.File, e.Line, e.Col, e.Msg)
	}
	return fmt.Sprintf("%s:%d:%d: %s: %s", e.File, e.Line, e.Col, e.Field, e.Msg)
}

// ErrorList is every problem Load found in one file, sorted by line, column,
// then text. It is never empty when returned as an error.
type ErrorList []*FieldError

func (l ErrorList) Error() string {
	lines := make([]string, len(l))
	for i, e := range l {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}

func (l ErrorList) sort() {
	sort.SliceStable(l, func(i, j int) bool {
		a, b := l[i], l[j]
		if a.Line != b.Line {
			return a.Line < b.Line
		}
		if a.Col != b.Col {
			return a.Col < b.Col
		}
		return a.tail() < b.tail()
	})
}

func (e *FieldError) tail() string {
	if e.Field == "" {
		return e.Msg
	}
	return e.Field + ": " + e.Msg
}

// excerptRunes bounds a redactedExcerpt.
const excerptRunes = 40

// excerptKeyRe is a leading `key:` or `key=` (or `export key=`): a name,
// which an excerpt may show, before a value, which it may not.
var excerptKeyRe = regexp.MustCompile(`^(?:export\s+)?[A-Za-z_][A-Za-z0-9_.-]*\s*[:=]`)

// redactedExcerpt is all an error may quote of a file that is not a
// pipeline at all: such a file may be anything its reader could open (a
// .env file, a key, /etc/shadow), and the error may travel far (into a
// run's history). It is the line's first 40 characters, every one masked
// with '*' except ASCII punctuation and spaces, and a leading key:
// `OPENAI_API_KEY=sk-12` reads `OPENAI_API_KEY=**-**`. The shape is left to
// show why the file is not YAML a pipeline is made of.
func redactedExcerpt(line string) string {
	line = strings.TrimSpace(line)
	keep := len(excerptKeyRe.FindString(line))
	var b strings.Builder
	n := 0
	for i, r := range line {
		if n == excerptRunes {
			b.WriteString("...")
			break
		}
		if i >= keep && (r >= utf8.RuneSelf || !(unicode.IsPunct(r) || unicode.IsSymbol(r) || r == ' ')) {
			r = '*'
		}
		b.WriteRune(r)
		n++
	}
	return b.String()
}

// kindOf names a node's kind without its value ("a string", "a list").
func kindOf(n *yaml.Node) string {
	n = deref(n)
	switch {
	case n == nil:
		return "nothing"
	case n.Kind == yaml.MappingNode:
		return "a mapping"
	case n.Kind == yaml.SequenceNode:
		return "a list"
	}
	switch n.ShortTag() {
	case "!!null":
		return "null"
	case "!!bool":
		return "a bool"
	case "!!int":
		return "an integer"
	case "!!float":
		return "a float"
	case "!!str":
		return "a string"
	}
	return "a tagged value"
}
