package pipelines

import (
	"fmt"
	"sort"
	"strings"
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
