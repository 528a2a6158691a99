package pipelines

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// InlineSpec is the name LoadJSON's errors give a spec that came in a
// run's input rather than from a file: `spec:LINE:COL: field: problem`.
const InlineSpec = "spec"

// LoadJSON loads a pipeline given as JSON: a pipeline file's keys and
// values written as JSON, the form a run's input carries it in (the
// Temporal UI's start form, a schedule, `rlflow run`). JSON is YAML, so
// this is Load, with every check of Load and its messages, positioned in
// the JSON text as name:LINE:COL. Two things differ. JSON's own syntax is
// checked first, by JSON's rules. And base_dir is required: relative paths
// resolve against it, and a spec that is not a file has no directory to
// default to (the worker's current directory would be an accident).
//
// A Pipeline's JSON (encoding/json) is such a spec: LoadJSON of a loaded
// pipeline's JSON loads the same pipeline.
func LoadJSON(name string, data []byte) (*Pipeline, error) {
	if name == "" {
		name = InlineSpec
	}
	if len(data) > MaxFileBytes {
		return nil, ErrorList{tooBig(name, int64(len(data)))}
	}
	first := len(data) - len(bytes.TrimLeft(data, " \t\r\n"))
	if first == len(data) {
		return nil, ErrorList{{File: name, Line: 1, Col: 1,
			Msg: "empty spec: want a JSON object with the keys of a pipeline file (version, name, base_dir, steps, ...)"}}
	}
	if err := json.Unmarshal(data, new(json.RawMessage)); err != nil {
		off := len(data)
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			off = int(syn.Offset) - 1 // the byte that broke it
		}
		line, col := textPos(data, max(off, 0))
		return nil, ErrorList{{File: name, Line: line, Col: col, Msg: "invalid JSON: " + strings.TrimPrefix(err.Error(), "json: ")}}
	}
	p, err := Load(name, yamlReadableJSON(data))
	if missing := baseDirMissing(data); missing {
		line, col := textPos(data, first)
		// The loader's "is required", positioned as its own are: at the
		// mapping that lacks the key.
		e := &FieldError{File: name, Line: line, Col: col, Field: "base_dir",
			Msg: "is required in a spec given as JSON: relative paths resolve against it, and only a file has a directory to default to"}
		var list ErrorList
		if err != nil && !errors.As(err, &list) {
			return nil, err
		}
		list = append(list, e)
		list.sort()
		return nil, list
	}
	return p, err
}

// MarshalJSON writes the step as encoding/json does, but for a float in
// `with` that is a whole number beyond ±2^53 (1e16, say), which it writes
// with an exponent (1e+16): encoding/json would write its digits, which
// LoadJSON (as YAML) reads as an integer that `with` may not hold.
func (s Step) MarshalJSON() ([]byte, error) {
	type plain Step // without this method
	if wide, changed := wideFloats(s.With); changed {
		s.With = wide.(map[string]any)
	}
	return json.Marshal(plain(s))
}

// wideFloats returns v with every whole float64 beyond ±2^53 as a
// json.Number with an exponent, and whether there was one. Only the maps
// and lists on the way to one are copied; v is never modified.
func wideFloats(v any) (any, bool) {
	switch x := v.(type) {
	case float64:
		if x == math.Trunc(x) && math.Abs(x) > MaxExactInt && !math.IsInf(x, 0) {
			return json.Number(strconv.FormatFloat(x, 'e', -1, 64)), true
		}
	case map[string]any:
		var out map[string]any
		for k, e := range x {
			w, changed := wideFloats(e)
			if !changed {
				continue
			}
			if out == nil {
				out = maps.Clone(x)
			}
			out[k] = w
		}
		if out != nil {
			return out, true
		}
	case []any:
		var out []any
		for i, e := range x {
			w, changed := wideFloats(e)
			if !changed {
				continue
			}
			if out == nil {
				out = slices.Clone(x)
			}
			out[i] = w
		}
		if out != nil {
			return out, true
		}
	}
	return v, false
}

// baseDirMissing reports whether data, valid JSON, is an object whose
// base_dir is absent, null or "": what Load would default. Other values
// are Load's to judge.
func baseDirMissing(data []byte) bool {
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil || top == nil {
		return false // not an object (null decodes as a nil map): Load says so
	}
	raw, ok := top["base_dir"]
	if !ok {
		return true
	}
	var s *string
	if json.Unmarshal(raw, &s) != nil {
		return false
	}
	return s == nil || *s == ""
}

// textPos converts a byte offset of text to a 1-based line and column
// (in characters, as the loader counts them).
func textPos(text []byte, off int) (line, col int) {
	off = min(off, len(text))
	start := bytes.LastIndexByte(text[:off], '\n') + 1
	return bytes.Count(text[:off], []byte{'\n'}) + 1, utf8.RuneCount(text[start:off]) + 1
}

// yamlReadableJSON rewrites valid JSON text so that yaml.v3 reads it as
// JSON means it, keeping every line where it is:
//   - outside strings, tabs become spaces (JSON separates tokens with
//     them; YAML refuses them as indentation);
//   - inside strings, yaml.v3 does not know the escape `\/` (it becomes
//     `/`) nor UTF-16 surrogate pairs (`\ud83d\ude00` becomes one
//     `\U0001F600`; a lone surrogate is U+FFFD, as encoding/json reads
//     it), refuses some characters raw (DEL, C1 controls, U+FFFE, U+FFFF,
//     invalid UTF-8: escaped, invalid bytes as U+FFFD) and folds others
//     as line breaks (NEL, U+2028, U+2029: escaped).
//
// Columns after such a rewrite on the same line shift by a few characters;
// a spec rarely holds one.
func yamlReadableJSON(data []byte) []byte {
	out := make([]byte, 0, len(data))
	inString := false
	for i := 0; i < len(data); {
		c := data[i]
		if !inString {
			if c == '\t' {
				c = ' '
			}
			inString = c == '"'
			out = append(out, c)
			i++
			continue
		}
		switch {
		case c == '"':
			inString = false
			out = append(out, c)
			i++
		case c == '\\' && i+1 < len(data) && data[i+1] == '/':
			out = append(out, '/')
			i += 2
		case c == '\\' && i+1 < len(data) && data[i+1] == 'u':
			r, n := jsonUnicodeEscape(data[i:])
			if r < 0 {
				out = append(out, data[i:i+n]...) // not a surrogate: yaml.v3 reads it
			} else {
				out = append(out, yamlEscape(r)...)
			}
			i += n
		case c == '\\':
			out = append(out, data[i:min(i+2, len(data))]...)
			i += 2
		case c < utf8.RuneSelf:
			if c == 0x7f {
				out = append(out, yamlEscape(rune(c))...)
			} else {
				out = append(out, c)
			}
			i++
		default:
			r, n := utf8.DecodeRune(data[i:])
			if r == utf8.RuneError && n == 1 || yamlRefusesRaw(r) {
				out = append(out, yamlEscape(r)...)
			} else {
				out = append(out, data[i:i+n]...)
			}
			i += n
		}
	}
	return out
}

// jsonUnicodeEscape reads the \uXXXX escape (and, for a high surrogate, the
// low one after it) at the start of b. It returns the rune a surrogate
// escape stands for (U+FFFD for a lone one) and the bytes read, or -1 and
// 6 for any other \uXXXX, which yaml.v3 reads as JSON does.
func jsonUnicodeEscape(b []byte) (rune, int) {
	hex4 := func(b []byte) (rune, bool) {
		if len(b) < 6 || b[0] != '\\' || b[1] != 'u' {
			return 0, false
		}
		v, err := strconv.ParseUint(string(b[2:6]), 16, 16)
		return rune(v), err == nil
	}
	r, ok := hex4(b)
	switch {
	case !ok:
		return -1, min(2, len(b)) // cannot happen in valid JSON
	case !utf16.IsSurrogate(r):
		return -1, 6
	}
	if r2, ok := hex4(b[6:]); ok {
		if d := utf16.DecodeRune(r, r2); d != utf8.RuneError {
			return d, 12
		}
	}
	return utf8.RuneError, 6
}

// yamlRefusesRaw: characters yaml.v3 does not take raw in a double-quoted
// scalar, or takes as a line break and folds into a space.
func yamlRefusesRaw(r rune) bool {
	return r >= 0x80 && r <= 0x9f || r == 0x2028 || r == 0x2029 || r == 0xfffe || r == 0xffff
}

func yamlEscape(r rune) []byte {
	if r > 0xffff {
		return fmt.Appendf(nil, `\U%08X`, r)
	}
	return fmt.Appendf(nil, `\u%04X`, r)
}

// Bounds of Brief: a run's failure stays in its history and shows in the
// Temporal UI, which wants it short.
const (
	briefLines     = 20
	briefLineBytes = 500
)

// Brief is err for a run's failure message: at most 20 of an ErrorList's
// problems, in its order, each clipped to 500 bytes, then how many more
// there are (`rlflow validate` on the same spec lists them all); any other
// error clipped likewise. A spec's values are quoted in it only as the
// loader quotes them, briefly.
func Brief(err error) string {
	var list ErrorList
	if !errors.As(err, &list) {
		return clipBytes(err.Error(), briefLineBytes)
	}
	lines := make([]string, 0, min(len(list), briefLines)+1)
	for i, e := range list {
		if i == briefLines {
			lines = append(lines, fmt.Sprintf("... and %d more problems (rlflow validate lists them all)", len(list)-i))
			break
		}
		lines = append(lines, clipBytes(e.Error(), briefLineBytes))
	}
	return strings.Join(lines, "\n")
}

// clipBytes shortens s to at most n bytes, "..." included, on a character
// boundary.
func clipBytes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - 3
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}
