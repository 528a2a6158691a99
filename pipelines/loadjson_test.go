package pipelines

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// TestInlineSpecCorpus: every spec in testdata/json fails with the errors in
// its golden file (go test ./pipelines/ -run TestInlineSpecCorpus -update).
func TestInlineSpecCorpus(t *testing.T) {
	files, err := filepath.Glob("testdata/json/*.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 15 {
		t.Fatalf("corpus has %d files, want at least 15", len(files))
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			p, err := LoadJSON(InlineSpec, data)
			if err == nil {
				t.Fatalf("loaded without error: %+v", p)
			}
			if _, ok := err.(ErrorList); !ok {
				t.Fatalf("error is %T, want ErrorList", err)
			}
			got := err.Error() + "\n"
			golden := strings.TrimSuffix(f, ".json") + ".golden"
			if *update {
				if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if got != string(want) {
				t.Errorf("errors differ from %s\n--- got\n%s--- want\n%s", golden, got, want)
			}
		})
	}
}

// TestInlineSpecRoundTrip: a loaded pipeline's JSON loads as the same
// pipeline, for every example and for a spec using every key; the JSON is
// what a run's input carries and what the worker validates again.
func TestInlineSpecRoundTrip(t *testing.T) {
	withFixtureType(t)
	files := pipelineFiles(t)
	every := filepath.Join(t.TempDir(), "every.yaml")
	if err := os.WriteFile(every, []byte(`version: 1
name: every-key
description: "quotes \" <tags> & unicode é 😀 \u2028 \u0085 \x7f \\/ tab\t"
base_dir: /data/runs
params:
  n: {type: int, default: 3, description: count}
  lr: {type: float, default: 1.0}
  big: {type: float, default: 1.0e16}
  tag: {type: string, required: true}
  on: {type: bool, default: false}
  wait: {type: duration, default: 90s}
servers:
  - {url: "${{ params.tag }}", api_key_env: VLLM_KEY, api: C}
  - url: http://localhost:8000
weight_transfer: {backend: nccl, packed: true, buffer_bytes: 1GiB, num_buffers: 3, gpu_task_queue: gpus, gpu_start_timeout: 2m}
loop: {until: "${{ steps.b.outputs.v >= params.n }}", max_iterations: 7, continue_as_new_every: 3}
max_parallel: 2
defaults:
  timeout: 1h30m
  heartbeat: 30s
  retry: {max_attempts: 4, initial_interval: 1s, backoff: 1.5, max_interval: 1m, non_retryable: [ExitError]}
  task_queue: control
steps:
  - id: a
    uses: noop
    with: {outputs: {v: 1.0, w: 1.0e16, x: [1, 2.5, "s", true, null, {k: -3}], y: 1e300}}
  - id: b
    uses: noop
    needs: [a]
    when: "${{ steps.a.outputs.v > 0 }}"
    outputs: [v]
    with: {outputs: {v: "${{ params.n * 2 }}"}, sleep: 10ms}
  - id: c
    uses: exec
    needs: [b]
    always: true
    timeout: 5m
    heartbeat: 10s
    task_queue: trainer
    retry: {max_attempts: 1}
    with: {command: [python, train.py, "${{ steps.b.outputs.v }}"], env: {A: "1"}, dir: sub, kill_grace: 3s}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, f := range append(files, every) {
		t.Run(filepath.Base(f), func(t *testing.T) {
			p, err := LoadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			b, err := json.Marshal(p)
			if err != nil {
				t.Fatal(err)
			}
			p2, err := LoadJSON(InlineSpec, b)
			if err != nil {
				t.Fatalf("%v\n%s", err, b)
			}
			b2, err := json.Marshal(p2)
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != string(b2) {
				t.Errorf("the JSON trip changed the pipeline:\n%s\n%s", b, b2)
			}
			// The workflow decodes it (every number a float64) and
			// encodes it again for continue-as-new: still the same.
			var typed Pipeline
			if err := json.Unmarshal(b, &typed); err != nil {
				t.Fatal(err)
			}
			b3, err := json.Marshal(&typed)
			if err != nil {
				t.Fatal(err)
			}
			if string(b3) != string(b) {
				t.Errorf("decoding and encoding changed the JSON:\n%s\n%s", b, b3)
			}
		})
	}
}

// TestInlineSpecChecksAsLoad: a spec written as JSON gets every check a file
// gets, with the same messages: each file of the YAML corpus that has a
// JSON form fails as JSON with the same problems. Positions, line numbers
// in messages and the masked excerpt of a file that is not a pipeline
// differ by nature; multiple documents and custom tags have no JSON form.
func TestInlineSpecChecksAsLoad(t *testing.T) {
	withFixtureType(t)
	files, err := filepath.Glob("testdata/invalid/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	lineRef := regexp.MustCompile(`line \d+`)
	problems := func(err error, yamlOnly bool) []string {
		var out []string
		for _, e := range err.(ErrorList) {
			switch {
			case yamlOnly && (strings.Contains(e.Msg, "found another here") || strings.Contains(e.Msg, "YAML tag")):
				continue
			case !yamlOnly && e.Field == "base_dir" && strings.Contains(e.Msg, "given as JSON"):
				continue
			}
			msg, _, _ := strings.Cut(lineRef.ReplaceAllString(e.tail(), "line N"), " reads ")
			out = append(out, msg)
		}
		sort.Strings(out)
		return out
	}
	compared := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var v any
		if yaml.Unmarshal(data, &v) != nil {
			continue // YAML syntax, aliases or duplicate keys: nothing to write as JSON
		}
		js, err := json.Marshal(v)
		if err != nil {
			continue // NaN, Inf: JSON has none
		}
		_, yerr := Load(f, data)
		_, jerr := LoadJSON(InlineSpec, js)
		if yerr == nil || jerr == nil {
			t.Fatalf("%s: YAML error %v, JSON error %v", f, yerr, jerr)
		}
		want, got := problems(yerr, true), problems(jerr, false)
		if strings.Join(want, "\n") != strings.Join(got, "\n") {
			t.Errorf("%s: as JSON\n  %s\nas YAML\n  %s", f, strings.Join(got, "\n  "), strings.Join(want, "\n  "))
		}
		compared++
	}
	if compared < 25 {
		t.Errorf("compared %d files, want at least 25", compared)
	}
}

func TestInlineSpecValues(t *testing.T) {
	data, err := os.ReadFile("testdata/json/escapes.json")
	if err != nil {
		t.Fatal(err)
	}
	// The name pattern refuses the decoded text, so the error quotes it.
	_, err = LoadJSON(InlineSpec, data)
	if err == nil || !strings.Contains(err.Error(), `"esc/😀" must match`) {
		t.Errorf("escapes decoded wrong: %v", err)
	}
	p, err := LoadJSON(InlineSpec, []byte(`{"version":1,"name":"v","base_dir":"/d","description":"a\/b \ud83d\ude00 \ud800 x`+"\u2028\u0085\x7f"+`y","steps":[{"id":"a","uses":"noop"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if want := "a/b 😀 \ufffd x\u2028\u0085\x7fy"; p.Description != want {
		t.Errorf("description %q, want %q", p.Description, want)
	}
}

func TestInlineSpecOversized(t *testing.T) {
	big := strings.Repeat("secret-file-line ", MaxSpecBytes/16)
	spec, err := json.Marshal(map[string]any{"version": 1, "name": "big", "base_dir": "/d", "description": big,
		"steps": []any{map[string]any{"id": "a", "uses": "noop"}}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = LoadJSON(InlineSpec, spec)
	if err == nil {
		t.Fatal("loaded")
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "spec:1:") || !strings.Contains(msg, "description: the pipeline is") || !strings.Contains(msg, "over the limit of 1.5 MiB") {
		t.Errorf("error %q", msg)
	}
	if strings.Contains(msg, "secret-file-line") {
		t.Errorf("the error quotes the value: %.200s", msg)
	}
	_, err = LoadJSON(InlineSpec, []byte(`{"description": "`+strings.Repeat("x", MaxFileBytes)+`"}`))
	if err == nil || !strings.Contains(err.Error(), "spec:1:1: file is too large") {
		t.Errorf("error %v", err)
	}
}

func TestSpecErrorsBrief(t *testing.T) {
	var list ErrorList
	for i := range 25 {
		list = append(list, &FieldError{File: "spec", Line: i + 1, Col: 1, Field: "steps", Msg: "bad"})
	}
	list[0].Msg = strings.Repeat("é", 400)
	got := strings.Split(Brief(list), "\n")
	if len(got) != 21 || got[20] != "... and 5 more problems (rlflow validate lists them all)" || got[1] != "spec:2:1: steps: bad" {
		t.Errorf("brief: %q", got)
	}
	if len(got[0]) > 500 || !strings.HasSuffix(got[0], "é...") {
		t.Errorf("line not clipped on a character: %d bytes, %q", len(got[0]), got[0][len(got[0])-10:])
	}
	if got := Brief(ErrorList{{File: "spec", Line: 1, Col: 1, Msg: "x"}}); got != "spec:1:1: x" {
		t.Errorf("brief of one: %q", got)
	}
}

func TestSpecParamsJSON(t *testing.T) {
	l := ParamList{{Name: "z", Type: ParamInt, Default: int64(3)}, {Name: "a", Type: ParamString, Required: true, Description: "d"}}
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"z":{"type":"int","default":3},"a":{"type":"string","required":true,"description":"d"}}`; string(b) != want {
		t.Errorf("got %s, want %s", b, want)
	}
	for _, in := range []string{string(b), `[{"name":"z","type":"int","default":3},{"name":"a","type":"string","required":true,"description":"d"}]`} {
		var back ParamList
		if err := json.Unmarshal([]byte(in), &back); err != nil {
			t.Fatal(err)
		}
		if len(back) != 2 || back[0].Name != "z" || back[0].Default != 3.0 || back[1].Name != "a" || !back[1].Required || back[1].Description != "d" {
			t.Errorf("%s decoded as %+v", in, back)
		}
	}
}

// FuzzLoadJSON: LoadJSON never panics, and what it loads loads again from
// its own JSON, unchanged.
func FuzzLoadJSON(f *testing.F) {
	files, err := filepath.Glob("testdata/json/*.json")
	if err != nil {
		f.Fatal(err)
	}
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte(`{"version": 1, "name": "f", "base_dir": "/d", "params": {"n": {"type": "float", "default": 1e16}}, "steps": [{"id": "a", "uses": "noop", "with": {"outputs": {"x": [1.0, 1e16, "\u2028\ud83d\ude00"]}}}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := LoadJSON(InlineSpec, data)
		if err != nil {
			if _, ok := err.(ErrorList); !ok {
				t.Fatalf("error is %T, want ErrorList", err)
			}
			return
		}
		b, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		p2, err := LoadJSON(InlineSpec, b)
		if err != nil {
			t.Fatalf("its own JSON does not load: %v\n%s", err, b)
		}
		if b2, _ := json.Marshal(p2); string(b2) != string(b) {
			t.Fatalf("the JSON trip changed it:\n%s\n%s", b, b2)
		}
	})
}
