package pipelines

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"gopkg.in/yaml.v3"
)

// Limits on what Load accepts. They bound the time and memory a hostile file
// can cost; a real pipeline is far below every one of them.
const (
	// MaxFileBytes is the largest file Load parses.
	MaxFileBytes = 4 << 20
	// MaxNodes bounds the YAML nodes of a document, aliases expanded.
	MaxNodes = 100_000
	// MaxDepth bounds the nesting of a document, aliases expanded.
	MaxDepth = 64
	// MaxExpandedBytes bounds the text of a document's scalars, aliases
	// expanded: without it a 3 MiB string aliased 40,000 times is a 120 GB
	// spec in a 4 MiB file, and checking its expressions takes hours.
	// Aliases may not make a document larger than the largest file.
	MaxExpandedBytes = MaxFileBytes
	// MaxSteps bounds the steps of one pipeline.
	MaxSteps = 1000

	// maxTokens bounds the YAML indicators (lines, commas, brackets, "- ",
	// ": ") counted before parsing: yaml.v3 builds the whole node tree before
	// we can count nodes, and a 4 MiB flow list costs it seconds and
	// hundreds of MB. Two tokens per node leaves room for any real file.
	maxTokens    = 2 * MaxNodes
	maxExprBytes = 4096
	maxExprs     = 10_000
	maxErrors    = 1000
)

// LoadFile reads and loads a pipeline file. Only a regular file is read
// (a symbolic link to one is followed): a FIFO would block the read until
// a writer comes, a device may never end, and a directory has no text.
// Files over MaxFileBytes are refused without being read. A problem with
// the file as a whole is an ErrorList positioned at 1:1, like the file's
// other problems; a file that cannot be opened is the os error, wrapped.
func LoadFile(path string) (*Pipeline, error) {
	// Stat first so that a FIFO is refused before open, which would wait
	// for a writer; openNoBlock and the Stat of the opened file close the
	// race with a path replaced in between.
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("loading pipeline: %w", err)
	}
	if bad := fileProblem(path, st); bad != nil {
		return nil, ErrorList{bad}
	}
	f, err := openNoBlock(path)
	if err != nil {
		return nil, fmt.Errorf("loading pipeline: %w", err)
	}
	defer f.Close()
	if st, err = f.Stat(); err != nil {
		return nil, fmt.Errorf("loading pipeline: %w", err)
	}
	if bad := fileProblem(path, st); bad != nil {
		return nil, ErrorList{bad}
	}
	// The file may grow after Stat: read one byte past the limit to tell.
	data, err := io.ReadAll(io.LimitReader(f, MaxFileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("loading pipeline: %w", err)
	}
	return Load(path, data)
}

// fileProblem refuses what is not a regular file of at most MaxFileBytes.
func fileProblem(path string, st os.FileInfo) *FieldError {
	mode := st.Mode()
	if mode.IsRegular() {
		if st.Size() > MaxFileBytes {
			return tooBig(path, st.Size())
		}
		return nil
	}
	what := "not a regular file"
	switch {
	case mode.IsDir():
		what = "a directory"
	case mode&os.ModeNamedPipe != 0:
		what = "a named pipe (FIFO)"
	case mode&os.ModeSocket != 0:
		what = "a socket"
	case mode&os.ModeCharDevice != 0:
		what = "a character device"
	case mode&os.ModeDevice != 0:
		what = "a block device"
	}
	return &FieldError{File: path, Line: 1, Col: 1,
		Msg: fmt.Sprintf("%s, not a regular file: a pipeline is read from a regular file only", what)}
}

func tooBig(file string, size int64) *FieldError {
	return &FieldError{File: file, Line: 1, Col: 1,
		Msg: fmt.Sprintf("file is too large: %d bytes, the limit is %d (4 MiB)", size, MaxFileBytes)}
}

// Load parses and validates a pipeline. path names the file in error
// messages and sets the default base_dir. On failure the error is an
// ErrorList holding every problem found; the *Pipeline is then nil.
func Load(path string, data []byte) (p *Pipeline, err error) {
	file := path
	if file == "" {
		file = "<input>"
	}
	l := &loader{file: file, data: data, pos: map[string]*yaml.Node{}, keys: map[string]*yaml.Node{}, bad: map[string]bool{}}
	defer func() {
		// Load never panics on input; a panic here is a bug in this package,
		// reported as an error rather than crashing the CLI or a worker.
		if r := recover(); r != nil {
			l.errs = append(l.errs, &FieldError{File: file, Line: 1, Col: 1, Msg: fmt.Sprintf("internal error: %v", r)})
			p, err = nil, l.list()
		}
	}()
	p = l.load(path)
	if len(l.errs) > 0 {
		return nil, l.list()
	}
	return p, nil
}

// loader holds the state of one Load call.
type loader struct {
	file  string
	data  []byte
	errs  ErrorList
	pos   map[string]*yaml.Node // value node of every decoded field path
	keys  map[string]*yaml.Node // key node of every decoded mapping entry
	bad   map[string]bool       // free-form paths already reported, not to be checked again
	lines []int                 // byte offset of each line start, built lazily

	p        *Pipeline
	exprs    int
	upstream map[string]map[string]bool
	env      any // typed expression environment, built on first use
}

func (l *loader) list() ErrorList {
	l.errs.sort()
	if len(l.errs) > maxErrors {
		last := l.errs[maxErrors-1]
		l.errs = append(l.errs[:maxErrors:maxErrors], &FieldError{File: l.file, Line: last.Line, Col: last.Col,
			Msg: fmt.Sprintf("too many errors; only the first %d are shown", maxErrors)})
	}
	return l.errs
}

func (l *loader) errAt(line, col int, path, format string, args ...any) {
	if line < 1 {
		line = 1
	}
	if col < 1 {
		col = 1
	}
	l.errs = append(l.errs, &FieldError{File: l.file, Line: line, Col: col, Field: path, Msg: fmt.Sprintf(format, args...)})
}

// errNode reports a problem at node n (or line 1 if n is nil).
func (l *loader) errNode(n *yaml.Node, path, format string, args ...any) {
	if n == nil {
		l.errAt(1, 1, path, format, args...)
		return
	}
	l.errAt(n.Line, n.Column, path, format, args...)
}

// errPath reports a problem at the node decoded for path, or at the nearest
// enclosing path that has one.
func (l *loader) errPath(path, format string, args ...any) {
	l.errNode(l.nodeFor(path), path, format, args...)
}

// nodeFor returns the node of path or of its nearest decoded ancestor.
func (l *loader) nodeFor(path string) *yaml.Node {
	for p := path; p != ""; p = parentPath(p) {
		if n, ok := l.pos[p]; ok {
			return n
		}
	}
	return l.pos[""]
}

func parentPath(p string) string {
	i := strings.LastIndexAny(p, ".[")
	if i < 0 {
		return ""
	}
	return p[:i]
}

func (l *loader) load(path string) *Pipeline {
	if len(l.data) > MaxFileBytes {
		l.errs = append(l.errs, tooBig(l.file, int64(len(l.data))))
		return nil
	}
	if n := countTokens(l.data); n > maxTokens {
		l.errAt(1, 1, "", "document is too complex: more than %d lines and YAML indicators (a pipeline may have at most %d nodes)", maxTokens, MaxNodes)
		return nil
	}
	root := l.parse()
	if root == nil {
		return nil
	}
	if !l.measure(root) {
		return nil
	}
	l.pos[""] = root
	p := &Pipeline{}
	l.p = p
	l.decodeObject(root, reflect.ValueOf(p).Elem(), pipelineObj, "")
	l.check(path)
	if len(l.errs) == 0 {
		l.checkSpecSize()
	}
	return p
}

// countTokens over-estimates the YAML nodes of data without parsing it.
func countTokens(data []byte) int {
	n := 0
	for i, c := range data {
		switch c {
		case '\n', ',', '[', '{':
			n++
		case '-', ':', '?':
			if i+1 == len(data) || data[i+1] == ' ' || data[i+1] == '\n' || data[i+1] == '\t' || data[i+1] == '\r' {
				n++
			}
		}
	}
	return n
}

var yamlLineRe = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)
var unknownAnchorRe = regexp.MustCompile(`^yaml: unknown anchor '(.*)' referenced$`)

// parse returns the document's root mapping, or nil after reporting why
// there is none.
func (l *loader) parse() (root *yaml.Node) {
	defer func() {
		if r := recover(); r != nil {
			l.errAt(1, 1, "", "yaml parser failed: %v", r)
			root = nil
		}
	}()
	dec := yaml.NewDecoder(bytes.NewReader(l.data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			l.errAt(1, 1, "", "empty document: want a mapping with version, name and steps")
		} else {
			l.yamlError(err)
		}
		return nil
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case errors.Is(err, io.EOF):
	case err != nil:
		l.yamlError(err)
	default:
		l.errAt(next.Line, next.Column, "", "a pipeline file holds one YAML document; found another here")
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) == 0 {
		l.errAt(1, 1, "", "empty document: want a mapping with version, name and steps")
		return nil
	}
	root = doc.Content[0]
	if root.Kind == yaml.ScalarNode && root.ShortTag() == "!!null" {
		l.errNode(root, "", "empty document: want a mapping with version, name and steps")
		return nil
	}
	// A document that is not a mapping, or a mapping with no key a pipeline
	// has, is not a pipeline at all but whatever file was named: nothing of
	// it is quoted beyond a redacted excerpt.
	if root.Kind != yaml.MappingNode {
		msg := "the document must be a mapping with version, name and steps, got " + kindOf(root)
		if root.Kind == yaml.ScalarNode {
			msg += fmt.Sprintf(" (it reads %q, values masked)", redactedExcerpt(l.lineText(root.Line)))
		}
		l.errNode(root, "", "%s", msg)
		return nil
	}
	if k := l.foreignKey(root); k != nil {
		l.errNode(k, "", "not a pipeline: a mapping with none of the keys version, name and steps (line %d reads %q, values masked)",
			k.Line, redactedExcerpt(l.lineText(k.Line)))
		return nil
	}
	return root
}

// foreignKey returns the first key of a root mapping none of whose keys is
// a pipeline's or a likely typo of one; nil when some key is (or there are
// none, or a merge key hides them).
func (l *loader) foreignKey(root *yaml.Node) *yaml.Node {
	names := make([]string, len(pipelineObj.fields))
	for i, f := range pipelineObj.fields {
		names[i] = f.name
	}
	var first *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		k := deref(root.Content[i])
		if k == nil || k.Kind != yaml.ScalarNode || k.ShortTag() == "!!merge" {
			return nil
		}
		if slices.Contains(names, k.Value) || suggest(k.Value, names) != "" {
			return nil
		}
		if first == nil {
			first = root.Content[i]
		}
	}
	return first
}

// yamlParserProblems are the messages of yaml.v3's parser (as opposed to
// its scanner). For them yaml.v3 reports a 0-based line, that of the
// construct being parsed; the hint says which construct that is.
var yamlParserProblems = map[string]string{
	"did not find expected ',' or ']'":       " (in the flow list that starts here)",
	"did not find expected ',' or '}'":       " (in the flow mapping that starts here)",
	"did not find expected '-' indicator":    " (in the block list that starts here; check the indentation below it)",
	"did not find expected key":              " (in the block mapping that starts here; check the indentation below it)",
	"did not find expected node content":     "",
	"did not find expected <document start>": "",
	"did not find expected <stream-start>":   "",
	"found undefined tag handle":             "",
	"found duplicate %YAML directive":        "",
	"found duplicate %TAG directive":         "",
	"found incompatible YAML document":       "",
}

// yamlError turns a yaml.v3 parse error into a positioned FieldError.
func (l *loader) yamlError(err error) {
	msg := err.Error()
	line, col := 1, 1
	if m := yamlLineRe.FindStringSubmatch(msg); m != nil {
		line, _ = strconv.Atoi(m[1])
		msg = m[2]
	} else if m := unknownAnchorRe.FindStringSubmatch(msg); m != nil {
		// yaml.v3 gives no position here; the first use of the alias is it.
		// The name is left out: the position shows it, and a file that does
		// not parse may be any file (a line "*secret" is such an alias).
		if i := bytes.Index(l.data, []byte("*"+m[1])); i >= 0 {
			line, col = l.offsetPos(i)
		}
		msg = "unknown anchor referenced (an alias *name needs an anchor &name before it)"
	} else {
		msg = strings.TrimPrefix(msg, "yaml: ")
		line = 0 // yaml.v3 leaves the line out when it is the first
	}
	if hint, ok := yamlParserProblems[msg]; ok {
		line++
		// Point at the construct's opening token where the line shows it.
		text := l.lineText(line)
		i := -1
		switch {
		case strings.HasSuffix(msg, "']'"):
			i = strings.IndexByte(text, '[')
		case strings.HasSuffix(msg, "'}'"):
			i = strings.IndexByte(text, '{')
		case strings.Contains(msg, "'-'"):
			i = strings.IndexByte(text, '-')
		case strings.Contains(msg, "expected key"):
			i = len(text) - len(strings.TrimLeft(text, " "))
		}
		if i >= 0 {
			col = utf8.RuneCountInString(text[:i]) + 1
		}
		msg += hint
	} else if line == 0 {
		line = 1
	}
	if strings.Contains(msg, "tab") || strings.Contains(msg, "cannot start any token") {
		// The reported line is where the scalar or token began; the tab
		// may be on one of the lines after it.
		for n := line; n <= line+2; n++ {
			text := l.lineText(n)
			indent := text[:len(text)-len(strings.TrimLeft(text, " \t"))]
			if i := strings.IndexByte(indent, '\t'); i >= 0 {
				line, col = n, i+1
				if !strings.Contains(msg, "tab") {
					msg += " (tabs are not allowed for indentation)"
				}
				break
			}
		}
	}
	l.errAt(line, col, "", "yaml syntax error: %s", msg)
}

func (l *loader) lineStarts() []int {
	if l.lines == nil {
		l.lines = []int{0}
		for i, c := range l.data {
			if c == '\n' {
				l.lines = append(l.lines, i+1)
			}
		}
	}
	return l.lines
}

// lineText returns line n (1-based) without its newline, or "".
func (l *loader) lineText(n int) string {
	starts := l.lineStarts()
	if n < 1 || n > len(starts) {
		return ""
	}
	end := len(l.data)
	if n < len(starts) {
		end = starts[n] - 1
	}
	return strings.TrimSuffix(string(l.data[starts[n-1]:end]), "\r")
}

// offsetPos converts a byte offset of data to a 1-based line and column.
func (l *loader) offsetPos(off int) (line, col int) {
	starts := l.lineStarts()
	lo, hi := 0, len(starts)-1
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if starts[mid] <= off {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo + 1, utf8.RuneCount(l.data[starts[lo]:off]) + 1
}

// scalarPos returns the position of byte offset off inside scalar n's value.
// It is exact when the scalar sits on one line exactly as its value reads
// (plain, or quoted without escapes), and otherwise the scalar's own
// position: block scalars and escapes break the offset-to-column mapping.
func (l *loader) scalarPos(n *yaml.Node, off int) (line, col int) {
	if n == nil {
		return 1, 1
	}
	line, col = n.Line, n.Column
	if off < 0 || off > len(n.Value) || strings.ContainsAny(n.Value, "\n\r") {
		return line, col
	}
	q := 0
	switch n.Style &^ (yaml.TaggedStyle | yaml.FlowStyle) {
	case 0:
	case yaml.DoubleQuotedStyle, yaml.SingleQuotedStyle:
		q = 1
	default:
		return line, col
	}
	text := l.lineText(n.Line)
	// Walk col-1+q characters into the line to find the value's first byte.
	b := 0
	for i := 0; i < col-1+q && b < len(text); i++ {
		_, w := utf8.DecodeRuneInString(text[b:])
		b += w
	}
	if !strings.HasPrefix(text[b:], n.Value) {
		return line, col
	}
	return line, col + q + utf8.RuneCountInString(n.Value[:off])
}

// measure checks the document's size and depth with aliases expanded, and
// that no alias contains itself, so that decoding can follow aliases freely.
func (l *loader) measure(root *yaml.Node) bool {
	m := &measurer{memo: map[*yaml.Node]shape{}, active: map[*yaml.Node]bool{}}
	m.walk(root, 1)
	if m.failed != "" {
		l.errNode(m.at, "", "%s", m.failed)
		return false
	}
	return true
}

type shape struct{ size, height, bytes int }

type measurer struct {
	total  int                  // nodes, aliases expanded
	bytes  int                  // scalar text, aliases expanded
	memo   map[*yaml.Node]shape // anchored nodes only: aliases reuse them
	active map[*yaml.Node]bool  // anchored nodes being walked
	failed string
	at     *yaml.Node
}

func (m *measurer) fail(n *yaml.Node, format string, args ...any) {
	if m.failed == "" {
		m.failed, m.at = fmt.Sprintf(format, args...), n
	}
}

// walk returns the expanded size and height of n at nesting level depth,
// stopping at the first limit exceeded. Memoising anchored nodes keeps it
// linear in the parsed tree however aliases multiply.
func (m *measurer) walk(n *yaml.Node, depth int) shape {
	if m.failed != "" || n == nil {
		return shape{}
	}
	if depth > MaxDepth {
		m.fail(n, "document nests deeper than %d levels", MaxDepth)
		return shape{}
	}
	if n.Kind == yaml.AliasNode {
		t := n.Alias
		if t == nil {
			m.fail(n, "alias *%s refers to nothing", n.Value)
			return shape{}
		}
		if m.active[t] {
			m.fail(n, "alias *%s refers to a node that contains it", n.Value)
			return shape{}
		}
		s, ok := m.memo[t]
		if !ok {
			s = m.walk(t, depth)
			return shape{s.size + 1, s.height, s.bytes}
		}
		if depth+s.height-1 > MaxDepth {
			m.fail(n, "document nests deeper than %d levels (aliases expanded)", MaxDepth)
			return shape{}
		}
		m.total += s.size + 1
		m.bytes += s.bytes
		if !m.within(n) {
			return shape{}
		}
		return shape{s.size + 1, s.height, s.bytes}
	}
	m.total++
	m.bytes += len(n.Value)
	if !m.within(n) {
		return shape{}
	}
	if n.Anchor != "" {
		m.active[n] = true
		defer delete(m.active, n)
	}
	s := shape{size: 1, height: 1, bytes: len(n.Value)}
	for _, c := range n.Content {
		cs := m.walk(c, depth+1)
		if m.failed != "" {
			return shape{}
		}
		s.size += cs.size
		s.bytes += cs.bytes
		s.height = max(s.height, cs.height+1)
	}
	if n.Anchor != "" {
		m.memo[n] = s
	}
	return s
}

// within reports whether the totals are inside the limits, failing at n
// when they are not.
func (m *measurer) within(n *yaml.Node) bool {
	switch {
	case m.total > MaxNodes:
		m.fail(n, "document is too large: more than %d YAML nodes (aliases expanded)", MaxNodes)
	case m.bytes > MaxExpandedBytes:
		m.fail(n, "document is too large: more than %d bytes of text (aliases expanded); the limit is that of a file", MaxExpandedBytes)
	default:
		return true
	}
	return false
}

// defaultBaseDir is the absolute directory of path.
func defaultBaseDir(path string) string {
	dir := filepath.Dir(path)
	if abs, err := filepath.Abs(dir); err == nil {
		return abs
	}
	return dir
}
