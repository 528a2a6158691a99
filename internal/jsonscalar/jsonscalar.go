// Package jsonscalar reads the JSON values that vLLM and prompts files let
// be either a string or a number (ids, weight versions, answers).
package jsonscalar

import (
	"bytes"
	"encoding/json"
)

// Text returns a JSON string's value or a JSON number's literal text, and
// false for anything else (null, objects, arrays, booleans, bad JSON).
func Text(raw json.RawMessage) (string, bool) {
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
