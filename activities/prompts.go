package activities

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/rlflow/rlflow/vllm"
)

// maxPromptLine bounds one line of a prompts file (a long chat transcript
// fits; a file without newlines does not take the worker's memory).
const maxPromptLine = 16 << 20

// prompt is one line of a prompts file.
type prompt struct {
	line     int
	id       string
	text     string         // plain prompt, or "" for chat
	messages []vllm.Message // chat prompt, or nil
	answer   json.RawMessage
}

// promptSet is a parsed prompts file; digest hashes its bytes, so a retry
// never resumes a partial file made from different prompts.
type promptSet struct {
	path    string
	prompts []prompt
	digest  string
}

// where names a prompt's line for error messages.
func (s *promptSet) where(p *prompt) string {
	return fmt.Sprintf("%s:%d (id %s)", s.path, p.line, p.id)
}

// readPrompts parses a JSONL prompts file: one object per line with
// "prompt" (string) or "messages" ([{role, content}]), an optional "id"
// (string or number; default: the line number) and, when wantAnswer, an
// "answer" (string or number). Other keys are ignored, so datasets with
// metadata work unchanged. Blank lines are skipped. Every problem is
// reported as file:line.
func readPrompts(path string, wantAnswer bool) (*promptSet, error) {
	f, err := openRegular(path)
	if err != nil {
		return nil, fmt.Errorf("prompts: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	sc := bufio.NewScanner(io.TeeReader(f, h))
	sc.Buffer(make([]byte, 64<<10), maxPromptLine)
	set := &promptSet{path: path}
	ids := map[string]int{}
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		p, err := parsePrompt(b, line, wantAnswer)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %v", path, line, err)
		}
		if first, dup := ids[p.id]; dup {
			return nil, fmt.Errorf("%s:%d: id %q repeats line %d (ids must be unique: a retried step resumes by id)", path, line, p.id, first)
		}
		ids[p.id] = line
		set.prompts = append(set.prompts, p)
	}
	if err := sc.Err(); err != nil {
		if err == bufio.ErrTooLong {
			return nil, fmt.Errorf("%s:%d: line longer than %d bytes", path, line+1, maxPromptLine)
		}
		return nil, fmt.Errorf("prompts: reading %s: %w", path, err)
	}
	if len(set.prompts) == 0 {
		return nil, fmt.Errorf("%s: no prompts (want one JSON object per line)", path)
	}
	set.digest = hex.EncodeToString(h.Sum(nil))
	return set, nil
}

func parsePrompt(b []byte, line int, wantAnswer bool) (prompt, error) {
	p := prompt{line: line}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(b, &obj); err != nil {
		return p, fmt.Errorf("not a JSON object: %v", err)
	}
	if raw, ok := obj["id"]; ok && !isNullJSON(raw) {
		id, ok := vllm.ScalarText(raw)
		if !ok || id == "" {
			return p, fmt.Errorf("id must be a non-empty string or a number, got %s", clipJSON(raw))
		}
		p.id = id
	} else {
		p.id = strconv.Itoa(line)
	}
	rawPrompt, hasPrompt := obj["prompt"]
	rawMsgs, hasMsgs := obj["messages"]
	switch {
	case hasPrompt && hasMsgs:
		return p, fmt.Errorf("has both prompt and messages; give one")
	case hasPrompt:
		if json.Unmarshal(rawPrompt, &p.text) != nil {
			return p, fmt.Errorf("prompt must be a string, got %s", clipJSON(rawPrompt))
		}
		if p.text == "" {
			return p, fmt.Errorf("prompt is empty")
		}
	case hasMsgs:
		var msgs []map[string]json.RawMessage
		if json.Unmarshal(rawMsgs, &msgs) != nil || len(msgs) == 0 {
			return p, fmt.Errorf("messages must be a non-empty list of {role, content}, got %s", clipJSON(rawMsgs))
		}
		for i, m := range msgs {
			var role, content string
			if json.Unmarshal(m["role"], &role) != nil || role == "" {
				return p, fmt.Errorf("messages[%d].role must be a non-empty string", i)
			}
			if json.Unmarshal(m["content"], &content) != nil {
				return p, fmt.Errorf("messages[%d].content must be a string", i)
			}
			p.messages = append(p.messages, vllm.Message{Role: role, Content: content})
		}
	default:
		return p, fmt.Errorf("needs \"prompt\" (a string) or \"messages\" (a list of {role, content})")
	}
	if wantAnswer {
		raw, ok := obj["answer"]
		if !ok || isNullJSON(raw) {
			return p, fmt.Errorf("has no \"answer\" (an eval set needs one per line)")
		}
		if _, ok := vllm.ScalarText(raw); !ok {
			return p, fmt.Errorf("answer must be a string or a number, got %s", clipJSON(raw))
		}
		p.answer = append(json.RawMessage(nil), raw...)
	}
	return p, nil
}

func isNullJSON(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

func clipJSON(raw json.RawMessage) string { return truncate(string(raw), 60) }

// promptText is what scorers see as the prompt: the plain prompt, or the
// chat messages as "role: content" lines.
func (p *prompt) promptText() string {
	if p.messages == nil {
		return p.text
	}
	var b strings.Builder
	for i, m := range p.messages {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(m.Role + ": " + m.Content)
	}
	return b.String()
}
