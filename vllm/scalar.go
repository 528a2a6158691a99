package vllm

import (
	"bytes"
	"encoding/json"
)

// ScalarText returns a JSON string's value or a JSON number's literal text,
// and false for anything else (null, objects, arrays, booleans, bad JSON).
// vLLM lets weight versions be either, and prompts files follow the same
// rule for ids and answers.
func ScalarText(raw json.RawMessage) (string, bool) {
	if bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		return "", false // Unmarshal would accept it as "no change"
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, true
	}
	var n json.Number
	if json.Unmarshal(raw, &n) == nil {
		return n.String(), true
	}
	return "", false
}
