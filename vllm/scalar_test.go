package vllm

import (
	"encoding/json"
	"testing"
)

func TestScalarText(t *testing.T) {
	for _, c := range []struct {
		raw  string
		want string
		ok   bool
	}{
		{`"a b"`, "a b", true},
		{`""`, "", true},
		{`42`, "42", true},
		{`-1.5e3`, "-1.5e3", true},
		{`null`, "", false},
		{`[1]`, "", false},
		{`{"a":1}`, "", false},
		{`true`, "", false},
		{`"unterminated`, "", false},
		{``, "", false},
	} {
		got, ok := ScalarText(json.RawMessage(c.raw))
		if got != c.want || ok != c.ok {
			t.Errorf("ScalarText(%s) = %q, %v; want %q, %v", c.raw, got, ok, c.want, c.ok)
		}
	}
}
