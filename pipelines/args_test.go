package pipelines

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/vllm"
)

func TestArgSpecCheck(t *testing.T) {
	n := ArgSpec{Name: "n", Kind: KindInt, Min: bound(1), Max: bound(1024), Default: int64(1)}
	topP := ArgSpec{Name: "top_p", Kind: KindFloat, Min: bound(0), MinExclusive: true, Max: bound(1), DefaultDoc: "the server's"}
	temp := ArgSpec{Name: "temperature", Kind: KindFloat, Min: bound(0), Default: 1.0}
	seed := ArgSpec{Name: "seed", Kind: KindInt}
	timeout := ArgSpec{Name: "timeout", Kind: KindDuration, Min: seconds(time.Millisecond), Default: Duration(30 * time.Second)}
	sleep := ArgSpec{Name: "sleep", Kind: KindDuration, Min: bound(0), Default: Duration(0)}
	mode := ArgSpec{Name: "mode", Kind: KindString, Enum: []string{"abort", "wait", "keep"}, Default: "abort"}
	prompts := ArgSpec{Name: "prompts", Kind: KindString, Required: true}
	model := ArgSpec{Name: "model", Kind: KindString}
	command := ArgSpec{Name: "command", Kind: KindStringList, Required: true, MinItems: 1}
	env := ArgSpec{Name: "env", Kind: KindStringMap}
	verify := ArgSpec{Name: "verify", Kind: KindBool, Default: false}
	obj := ArgSpec{Name: "scorer", Kind: KindObject}
	url := ArgSpec{Name: "url", Kind: KindString, Format: FormatURL}
	re := ArgSpec{Name: "pattern", Kind: KindString, Format: FormatRegexp}
	envVar := ArgSpec{Name: "api_key_env", Kind: KindString, Format: FormatEnvVar}
	for _, tc := range []struct {
		spec ArgSpec
		v    any
		want string // "" for no error
	}{
		{n, int64(1), ""},
		{n, int64(1024), ""},
		{n, 4, ""},
		{n, 4.0, ""}, // JSON
		{n, json.Number("16"), ""},
		{n, int64(5000), "5000 is out of range 1..1024"},
		{n, int64(0), "0 is out of range 1..1024; leave it out for the default (1)"},
		{n, -3, "-3 is out of range 1..1024"},
		{n, 2.5, "must be an integer in 1..1024, got float 2.5"},
		{n, 1e300, "must be an integer in 1..1024, got float 1e+300"},
		{n, "4", `must be an integer in 1..1024, got string "4"`},
		{n, nil, "must be an integer in 1..1024, got null"},
		{seed, int64(-7), ""},
		{seed, 0, ""},
		{seed, true, "must be an integer, got bool true"},
		{topP, 1.0, ""},
		{topP, 0.5, ""},
		{topP, int64(1), ""},
		{topP, 3.0, "must be > 0 and <= 1, got 3"},
		{topP, 0.0, "must be > 0 and <= 1, got 0; leave it out for the default (the server's)"},
		{topP, -0.1, "must be > 0 and <= 1, got -0.1"},
		{temp, 0.0, ""},
		{temp, 1e6, ""},
		{temp, -1.0, "must be >= 0, got -1"},
		{timeout, "1ms", ""},
		{timeout, Duration(time.Minute), ""},
		{timeout, time.Second, ""},
		{timeout, "0s", "must be >= 1ms, got 0s; leave it out for the default (30s)"},
		{timeout, "999us", "must be >= 1ms, got 999µs"},
		{timeout, "soon", `invalid duration "soon" (want e.g. 30s, 5m, 1h30m)`},
		{timeout, "-1s", `duration "-1s" must not be negative`},
		{timeout, Duration(-1), "must not be negative, got -1ns"},
		{timeout, int64(5), "must be a duration string like 30s, got integer 5"},
		{sleep, "0s", ""},
		{sleep, Duration(0), ""},
		{mode, "wait", ""},
		{mode, "wiat", `"wiat" is not one of abort, wait, keep (did you mean "wait"?)`},
		{mode, "", `"" is not one of abort, wait, keep`},
		{prompts, "p.jsonl", ""},
		{prompts, "", "must not be empty"},
		{prompts, int64(4), "must be a string, got integer 4"},
		{model, "", ""},
		{command, []any{"python", "train.py"}, ""},
		{command, []string{"true"}, ""},
		{command, []any{}, "must not be empty"},
		{command, []string(nil), "must not be empty"},
		{command, []any{"a", int64(1)}, "item 1 must be a string, got integer 1"},
		{command, "python", `must be a list of strings, got string "python"`},
		{env, map[string]any{"A": "1"}, ""},
		{env, map[string]string{"A": "1"}, ""},
		{env, map[string]any{"A": []any{}}, "A must be a string, got a list"},
		{verify, true, ""},
		{verify, "true", `must be true or false, got string "true"`},
		{obj, map[string]any{"type": "x"}, ""},
		{obj, json.RawMessage(`{"type": "x"}`), ""},
		{obj, json.RawMessage(`null`), "must be a mapping, got JSON null"},
		{obj, []any{}, "must be a mapping, got a list"},
		{url, "https://judge:8000/v1", ""},
		{url, "ftp://x", `"ftp://x" must be an http:// or https:// URL with a host`},
		{url, "http://", `"http://" must be an http:// or https:// URL with a host`},
		{re, `answer: (\d+)`, ""},
		{re, `(`, "bad regular expression: error parsing regexp: missing closing ): `(`"},
		{envVar, "VLLM_KEY", ""},
		{envVar, "1KEY", `must name an environment variable ([A-Za-z_][A-Za-z0-9_]*), got string "1KEY"`},
	} {
		err := tc.spec.Check(tc.v)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if got != tc.want {
			t.Errorf("%s.Check(%#v) = %q, want %q", tc.spec.Name, tc.v, got, tc.want)
		}
	}
}

func TestArgSpecTexts(t *testing.T) {
	for _, tc := range []struct {
		spec         ArgSpec
		rng, def     string
		wantRangeDoc string
	}{
		{ArgSpec{Kind: KindInt, Min: bound(1), Max: bound(1024), Default: int64(64)}, "1..1024", "64", ""},
		{ArgSpec{Kind: KindInt, Min: bound(0), Max: bound(65535), Default: int64(0), DefaultDoc: "a free port"}, "0..65535", "0 (a free port)", ""},
		{ArgSpec{Kind: KindFloat, Min: bound(0), MinExclusive: true, Max: bound(1), DefaultDoc: "the server's"}, "> 0 and <= 1", "the server's", ""},
		{ArgSpec{Kind: KindFloat, Min: bound(0), Default: 1.0}, ">= 0", "1.0", ""},
		{ArgSpec{Kind: KindFloat, Max: bound(2147483647)}, "<= 2147483647", "", ""},
		{ArgSpec{Kind: KindDuration, Min: seconds(time.Millisecond), Default: Duration(6 * time.Minute)}, ">= 1ms", "6m", ""},
		{ArgSpec{Kind: KindDuration, Default: Duration(2 * time.Hour)}, "", "2h", ""},
		{ArgSpec{Kind: KindDuration, Default: Duration(90 * time.Second)}, "", "1m30s", ""},
		{ArgSpec{Kind: KindString, Default: ""}, "", `""`, ""},
		{ArgSpec{Kind: KindStringList, Default: []string{"a", "b"}}, "", "[a, b]", ""},
	} {
		if got := tc.spec.RangeText(); got != tc.rng {
			t.Errorf("RangeText of %+v = %q, want %q", tc.spec, got, tc.rng)
		}
		if got := tc.spec.DefaultText(); got != tc.def {
			t.Errorf("DefaultText of %+v = %q, want %q", tc.spec, got, tc.def)
		}
	}
}

// The input structs below mirror package activities' (which this package
// cannot import): they are what ResolveArgs and ArgsStructProblems serve.
type testGenerateInput struct {
	Context        StepContext `json:"context"`
	Prompts        string      `json:"prompts"`
	Model          string      `json:"model,omitempty"`
	N              int         `json:"n,omitempty"`
	MaxTokens      int         `json:"max_tokens,omitempty"`
	Temperature    *float64    `json:"temperature,omitempty"`
	TopP           float64     `json:"top_p,omitempty"`
	Seed           *int        `json:"seed,omitempty"`
	Stop           []string    `json:"stop,omitempty"`
	Logprobs       int         `json:"logprobs,omitempty"`
	Concurrency    int         `json:"concurrency,omitempty"`
	RequestTimeout Duration    `json:"request_timeout,omitempty"`
	Output         string      `json:"output,omitempty"`
}

type testEvaluateInput struct {
	testGenerateInput
	Scorer json.RawMessage `json:"scorer"`
}

type testExecInput struct {
	Context   StepContext       `json:"context"`
	Command   []string          `json:"command"`
	Env       map[string]string `json:"env,omitempty"`
	Secrets   []string          `json:"secrets,omitempty"`
	Dir       string            `json:"dir,omitempty"`
	KillGrace Duration          `json:"kill_grace,omitempty"`
}

type testNoopInput struct {
	Context StepContext    `json:"context"`
	Outputs map[string]any `json:"outputs,omitempty"`
	Sleep   Duration       `json:"sleep,omitempty"`
}

type testPauseInput struct {
	Context StepContext `json:"context"`
	Mode    string      `json:"mode,omitempty"`
	Timeout Duration    `json:"timeout,omitempty"`
}

type testControlInput struct {
	Context StepContext `json:"context"`
	Timeout Duration    `json:"timeout,omitempty"`
}

type testInitTransferInput struct {
	Context       StepContext `json:"context"`
	MasterAddress string      `json:"master_address,omitempty"`
	MasterPort    int         `json:"master_port,omitempty"`
	Timeout       Duration    `json:"timeout,omitempty"`
}

type testBroadcastInput struct {
	Context       StepContext `json:"context"`
	Checkpoint    string      `json:"checkpoint"`
	Version       string      `json:"version,omitempty"`
	DType         string      `json:"dtype,omitempty"`
	UpdateTimeout Duration    `json:"update_timeout,omitempty"`
	Verify        bool        `json:"verify,omitempty"`
}

type testTrainInput struct {
	Context  StepContext    `json:"context"`
	Rollouts string         `json:"rollouts"`
	Args     map[string]any `json:"args,omitempty"`
}

type testPublishInput struct {
	Context       StepContext `json:"context"`
	Version       string      `json:"version,omitempty"`
	DType         string      `json:"dtype,omitempty"`
	UpdateTimeout Duration    `json:"update_timeout,omitempty"`
	Verify        bool        `json:"verify,omitempty"`
}

type testSaveCheckpointInput struct {
	Context StepContext `json:"context"`
}

var testInputs = map[string]any{
	StepTrain:          testTrainInput{},
	StepPublish:        testPublishInput{},
	StepSaveCheckpoint: testSaveCheckpointInput{},
	StepGenerate:       testGenerateInput{},
	StepEvaluate:       testEvaluateInput{},
	StepExec:           testExecInput{},
	StepNoop:           testNoopInput{},
	StepPause:          testPauseInput{},
	StepResume:         testControlInput{},
	StepIsPaused:       testControlInput{},
	StepWorldSize:      testControlInput{},
	StepInitTransfer:   testInitTransferInput{},
	StepBroadcast:      testBroadcastInput{},
}

func TestArgsStructProblemsMirrors(t *testing.T) {
	for _, name := range StepTypeNames() {
		in, ok := testInputs[name]
		if !ok {
			t.Errorf("no test input struct for step type %s", name)
			continue
		}
		if probs := ArgsStructProblems(name, reflect.TypeOf(in)); len(probs) > 0 {
			t.Errorf("%s:\n%s", name, strings.Join(probs, "\n"))
		}
		if probs := ArgsStructProblems(name, reflect.PointerTo(reflect.TypeOf(in))); len(probs) > 0 {
			t.Errorf("%s (pointer): %v", name, probs)
		}
	}
}

func TestArgsStructProblems(t *testing.T) {
	type bad struct {
		Context     StepContext       `json:"context"`
		Prompts     int               `json:"prompts"`               // wrong type
		N           int64             `json:"n"`                     // fine: zero out of range
		Temperature float64           `json:"temperature,omitempty"` // ambiguous zero
		TopP        *float64          `json:"top_p"`                 // fine: a pointer is never ambiguous
		Seed        int               `json:"seed"`                  // ambiguous: no default
		Stop        []any             `json:"stop"`                  // wrong type
		Logprobs    int               `json:"logprobs"`              // fine: default 0
		Timeout     time.Duration     `json:"request_timeout"`       // wrong type
		Extra       string            `json:"extra"`                 // no spec
		Env         map[string]string `json:"-"`                     // ignored
		hidden      int               //nolint:unused // unexported: ignored
		Model       string            // no tag: JSON name "Model", no spec
	}
	want := []string{
		`argument "concurrency" of generate: no field has the JSON name "concurrency"`,
		`argument "max_tokens" of generate: no field has the JSON name "max_tokens"`,
		`argument "model" of generate: no field has the JSON name "model"`,
		`argument "output" of generate: no field has the JSON name "output"`,
		`field Extra (json "extra"): generate has no argument "extra"`,
		`field Model (json "Model"): generate has no argument "Model"`,
		`field Prompts (json "prompts"): is int; an argument of kind string needs string`,
		`field Seed (json "seed"): 0 is a valid value but it has no default: make the field a pointer so that an explicit 0 is not taken for unset`,
		`field Stop (json "stop"): is []interface {}; an argument of kind list of strings needs []string`,
		`field Temperature (json "temperature"): 0.0 is a valid value but its default is 1.0: make the field a pointer so that an explicit 0.0 is not taken for unset`,
		`field Timeout (json "request_timeout"): is time.Duration; an argument of kind duration needs pipelines.Duration`,
	}
	got := ArgsStructProblems(StepGenerate, reflect.TypeOf(bad{}))
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	_ = bad{}.hidden

	type flag struct {
		Verify bool `json:"verify"`
	}
	specs := []ArgSpec{{Name: "verify", Kind: KindBool, Default: true}}
	want = []string{`field Verify (json "verify"): false is a valid value but its default is true: make the field a pointer so that an explicit false is not taken for unset`}
	if got := argsStructProblems("x", specs, reflect.TypeOf(flag{}), nil); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q", got)
	}
	specs = []ArgSpec{{Name: "verify", Kind: KindBool, Default: "yes"}, {Name: "n", Kind: KindInt, Min: bound(1), Default: int64(0)}, {Name: "m", Kind: KindInt, Default: 3}}
	want = []string{
		`argument "m" of x: Default is int, want int64 for kind int`,
		`argument "m" of x: no field has the JSON name "m"`,
		`argument "n" of x: Default 0 fails its own check: 0 is out of range: must be >= 1, got 0`,
		`argument "n" of x: no field has the JSON name "n"`,
		`argument "verify" of x: Default is string, want bool for kind bool`,
		`field Verify (json "verify"): false is a valid value but its default is yes: make the field a pointer so that an explicit false is not taken for unset`,
	}
	got = argsStructProblems("x", specs, reflect.TypeOf(flag{}), nil)
	// The Default's own check message is Check's; compare its start only.
	for i := range got {
		if strings.HasPrefix(got[i], `argument "n" of x: Default 0 fails`) {
			got[i] = want[2]
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if got := ArgsStructProblems("nope", reflect.TypeOf(flag{})); len(got) != 1 || got[0] != `unknown step type "nope"` {
		t.Errorf("got %q", got)
	}
	if got := ArgsStructProblems(StepNoop, reflect.TypeOf(3)); len(got) != 1 {
		t.Errorf("got %q", got)
	}
}

func ptr[T any](v T) *T { return &v }

func TestResolveArgs(t *testing.T) {
	ctx := StepContext{RunID: "r", StepID: "s"}
	for _, tc := range []struct {
		name string
		step string
		in   any // a pointer
		want any // the struct after ResolveArgs, when no error
		err  string
	}{
		{"generate defaults", StepGenerate,
			&testGenerateInput{Context: ctx, Prompts: "p.jsonl"},
			testGenerateInput{Context: ctx, Prompts: "p.jsonl", N: 1, MaxTokens: 256, Temperature: ptr(1.0), Concurrency: 64, RequestTimeout: Duration(vllm.DefaultGenerateTimeout)}, ""},
		{"generate explicit zeros", StepGenerate,
			&testGenerateInput{Prompts: "p.jsonl", Temperature: ptr(0.0), Seed: ptr(0), N: 2},
			testGenerateInput{Prompts: "p.jsonl", N: 2, MaxTokens: 256, Temperature: ptr(0.0), Seed: ptr(0), Concurrency: 64, RequestTimeout: Duration(vllm.DefaultGenerateTimeout)}, ""},
		{"generate out of range", StepGenerate,
			&testGenerateInput{Prompts: "p.jsonl", N: 5000, TopP: 3, Concurrency: -4, MaxTokens: -1, Temperature: ptr(-1.0), Logprobs: -1, RequestTimeout: 1},
			nil, "n: 5000 is out of range 1..1024; max_tokens: must be >= 1, got -1; temperature: must be >= 0, got -1; top_p: must be > 0 and <= 1, got 3; logprobs: must be >= 0, got -1; concurrency: -4 is out of range 1..1024; request_timeout: must be >= 1ms, got 1ns"},
		{"generate without prompts", StepGenerate, &testGenerateInput{}, nil, "prompts: is required"},
		{"evaluate walks the embedded struct", StepEvaluate,
			&testEvaluateInput{testGenerateInput: testGenerateInput{Prompts: "e.jsonl"}, Scorer: json.RawMessage(`{"type": "exact_match"}`)},
			testEvaluateInput{testGenerateInput: testGenerateInput{Prompts: "e.jsonl", N: 1, MaxTokens: 256, Temperature: ptr(1.0), Concurrency: 64, RequestTimeout: Duration(vllm.DefaultGenerateTimeout)}, Scorer: json.RawMessage(`{"type": "exact_match"}`)}, ""},
		{"evaluate with a null scorer", StepEvaluate,
			&testEvaluateInput{testGenerateInput: testGenerateInput{Prompts: "e.jsonl"}, Scorer: json.RawMessage(`null`)}, nil, "scorer: is required"},
		{"evaluate with a list scorer", StepEvaluate,
			&testEvaluateInput{testGenerateInput: testGenerateInput{Prompts: "e.jsonl"}, Scorer: json.RawMessage(`[1]`)}, nil, "scorer: must be a mapping, got JSON [1]"},
		{"exec defaults", StepExec, &testExecInput{Command: []string{"true"}},
			testExecInput{Command: []string{"true"}, KillGrace: Duration(DefaultKillGrace)}, ""},
		{"exec empty command", StepExec, &testExecInput{Command: []string{}}, nil, "command: must not be empty"},
		{"exec nil command", StepExec, &testExecInput{}, nil, "command: is required"},
		{"noop", StepNoop, &testNoopInput{}, testNoopInput{}, ""},
		{"pause defaults", StepPause, &testPauseInput{},
			testPauseInput{Mode: "abort"}, ""}, // the timeout depends on the mode: the activity chooses
		{"pause bad mode", StepPause, &testPauseInput{Mode: "wiat"}, nil, `mode: "wiat" is not one of abort, wait, keep (did you mean "wait"?)`},
		{"resume defaults", StepResume, &testControlInput{}, testControlInput{Timeout: Duration(vllm.DefaultControlTimeout)}, ""},
		{"init_transfer defaults", StepInitTransfer, &testInitTransferInput{},
			testInitTransferInput{Timeout: Duration(vllm.DefaultInitTimeout)}, ""},
		{"init_transfer port", StepInitTransfer, &testInitTransferInput{MasterPort: 70000}, nil, "master_port: 70000 is out of range 0..65535"},
		{"broadcast defaults", StepBroadcast, &testBroadcastInput{Checkpoint: "/c"},
			testBroadcastInput{Checkpoint: "/c", DType: "keep"}, ""},
		{"unknown step type", "nope", &testNoopInput{}, nil, `unknown step type "nope"`},
		{"not a pointer", StepNoop, testNoopInput{}, nil, "noop arguments: want a non-nil pointer to a struct, got pipelines.testNoopInput"},
		{"nil pointer", StepNoop, (*testNoopInput)(nil), nil, "noop arguments: want a non-nil pointer to a struct, got *pipelines.testNoopInput"},
		{"field without a spec", StepNoop, &struct {
			Sleep Duration `json:"sleep"`
			Bogus int      `json:"bogus"`
		}{}, nil, "bogus: field Bogus has no argument spec in noop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ResolveArgs(tc.step, tc.in)
			if tc.err != "" {
				if err == nil || err.Error() != tc.err {
					t.Fatalf("got error %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := reflect.ValueOf(tc.in).Elem().Interface(); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// TestResolveArgsFromJSON decodes `with` values the way Temporal does and
// resolves them: what an activity sees.
func TestResolveArgsFromJSON(t *testing.T) {
	var in testGenerateInput
	if err := json.Unmarshal([]byte(`{"prompts": "p", "n": 4, "temperature": 0, "request_timeout": "1m"}`), &in); err != nil {
		t.Fatal(err)
	}
	if err := ResolveArgs(StepGenerate, &in); err != nil {
		t.Fatal(err)
	}
	if in.N != 4 || *in.Temperature != 0 || in.RequestTimeout != Duration(time.Minute) || in.MaxTokens != 256 || in.Seed != nil || in.TopP != 0 {
		t.Errorf("got %+v", in)
	}
}

// TestRegistrySpecs holds every step type's and scorer type's arguments to
// the rules the loader, the reference and ResolveArgs rely on.
func TestRegistrySpecs(t *testing.T) {
	check := func(owner string, specs []ArgSpec) {
		for _, p := range specProblems(owner, specs) {
			t.Error(p)
		}
		seen := map[string]bool{}
		for _, a := range specs {
			where := owner + "." + a.Name
			if seen[a.Name] {
				t.Errorf("%s: listed twice", where)
			}
			seen[a.Name] = true
			if a.Doc == "" {
				t.Errorf("%s: no Doc", where)
			}
			if kindDefaultType(a.Kind) == nil {
				t.Errorf("%s: unknown kind %q", where, a.Kind)
			}
			if !a.Required && a.Default == nil && a.DefaultDoc == "" {
				t.Errorf("%s: optional without a stated default (set Default or DefaultDoc)", where)
			}
			if a.Required && (a.Default != nil || a.DefaultDoc != "") {
				t.Errorf("%s: required with a default", where)
			}
			if strings.Contains(a.Doc, "default") {
				t.Errorf("%s: Doc mentions a default; state it in Default or DefaultDoc", where)
			}
			// A zero duration must not silently mean "the default".
			if a.Kind == KindDuration && where != "noop.sleep" && (a.Min == nil || *a.Min < minTimeout.Seconds()) {
				t.Errorf("%s: a timeout-like duration needs Min >= %s", where, minTimeout)
			}
			if len(a.Enum) > 0 && a.Kind != KindString {
				t.Errorf("%s: Enum on kind %s", where, a.Kind)
			}
		}
	}
	for _, name := range StepTypeNames() {
		st, _ := LookupStepType(name)
		check(name, st.Args)
	}
	for _, st := range scorerTypes {
		check("scorer "+st.Name, st.Args)
	}
}

// TestDefaultsToday pins the defaults the code used before the registry
// became their source, so moving them cannot change behaviour.
func TestDefaultsToday(t *testing.T) {
	gen, _ := LookupStepType(StepGenerate)
	for name, want := range map[string]any{"n": int64(1), "max_tokens": int64(256), "temperature": 1.0, "concurrency": int64(64), "request_timeout": Duration(10 * time.Minute), "logprobs": int64(0)} {
		if got := gen.Default(name); !reflect.DeepEqual(got, want) {
			t.Errorf("generate.%s default %#v, want %#v", name, got, want)
		}
	}
	init, _ := LookupStepType(StepInitTransfer)
	if got := init.Default("timeout"); got != Duration(6*time.Minute) {
		t.Errorf("init_transfer.timeout default %v", got)
	}
	exec, _ := LookupStepType(StepExec)
	if got := exec.Default("kill_grace"); got != Duration(10*time.Second) {
		t.Errorf("exec.kill_grace default %v", got)
	}
	for _, name := range []string{StepResume, StepIsPaused, StepWorldSize} {
		st, _ := LookupStepType(name)
		if got := st.Default("timeout"); got != Duration(30*time.Second) {
			t.Errorf("%s.timeout default %v", name, got)
		}
	}
	if DefaultStepTimeout != 2*time.Hour || DefaultMaxAttempts != 3 || DefaultGPUTaskQueue != "rlflow-gpu" ||
		DefaultGPUStartTimeout != 30*time.Second || DefaultPackedBufferBytes != 1<<30 || DefaultPackedNumBuffers != 2 {
		t.Error("a pipeline-level default changed")
	}
}

func TestErrorTypes(t *testing.T) {
	seen := map[string]bool{}
	for _, e := range ErrorTypes {
		if seen[e.Name] || e.Name == "" || e.Doc == "" {
			t.Errorf("bad entry %+v", e)
		}
		seen[e.Name] = true
	}
	for _, c := range []string{ErrTypeBadInput, ErrTypeCommandNotFound, ErrTypeOutputMissing, ErrTypeExit, ErrTypeSignal, ErrTypeIO,
		ErrTypeServerError, ErrTypeServerRejected, ErrTypeNoGPUWorker, ErrTypeNCCL, ErrTypeStaleWeights, ErrTypeGPUWorkerLost, ErrTypeGPUUnavailable,
		ErrTypeStepFailed, ErrTypeIterationFailed, ErrTypeStartToCloseTimeout, ErrTypeHeartbeatTimeout, ErrTypeTrainerDied, ErrTypeTrainerFailed} {
		if !seen[c] {
			t.Errorf("constant %s missing from ErrorTypes", c)
		}
	}
	if len(seen) != 19 {
		t.Errorf("ErrorTypes has %d entries, the constants 19", len(seen))
	}
	// The activities' list before it moved here, and the trainer's refusal.
	want := []string{"BadInput", "CommandNotFound", "OutputMissing", "ServerRejected", "NoGPUWorker", "TrainerFailed"}
	if got := NonRetryableErrorTypes(); !reflect.DeepEqual(got, want) {
		t.Errorf("NonRetryableErrorTypes() = %v, want %v", got, want)
	}
	for name, want := range map[string]bool{"BadInput": true, "ExitError": false, "ServerError": false, "StepFailed": true, "GPUWorkerLost": false, "nope": false} {
		if got := IsNonRetryable(name); got != want {
			t.Errorf("IsNonRetryable(%q) = %v", name, got)
		}
	}
	for name, want := range map[string]string{
		"ExitError":                 "",
		"TemporalTimeout:Heartbeat": "",
		"Badinput":                  `unknown error type "Badinput" (did you mean "BadInput"?); non_retryable takes BadInput, `,
		"StepFailed":                "StepFailed is not a step error",
	} {
		if got := nonRetryableProblem(name); !strings.HasPrefix(got, want) || (want == "") != (got == "") {
			t.Errorf("nonRetryableProblem(%q) = %q, want prefix %q", name, got, want)
		}
	}
}

func TestJSONSchemaBounds(t *testing.T) {
	b, err := JSONSchema()
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Defs map[string]struct {
			Properties map[string]json.RawMessage `json:"properties"`
		} `json:"$defs"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ def, prop, want string }{
		{"with_generate", "n", `"default":1`},
		{"with_generate", "n", `"maximum":1024,"minimum":1`},
		{"with_generate", "top_p", `"exclusiveMinimum":0,"maximum":1`},
		{"with_generate", "request_timeout", `"default":"10m"`},
		{"with_exec", "command", `"minItems":1`},
		{"with_pause", "mode", `"default":"abort"`},
		{"with_init_transfer", "timeout", `"default":"6m"`},
		{"with_evaluate", "scorer", `"const":"judge"`},
		{"with_evaluate", "scorer", `"maximum":1024,"minimum":1,"type":"integer"`},
		{"retry", "max_attempts", `"maximum":2147483647,"minimum":0`},
		{"retry", "non_retryable", `"BadInput"`},
		{"weight_transfer", "gpu_task_queue", `"default":"rlflow-gpu"`},
		{"weight_transfer", "num_buffers", `"default":2`},
		{"weight_transfer", "buffer_bytes", `"default":1073741824`},
		{"defaults", "timeout", `"default":"2h"`},
		{"loop", "continue_as_new_every", `"default":100`},
	} {
		var buf bytes.Buffer
		if err := json.Compact(&buf, doc.Defs[tc.def].Properties[tc.prop]); err != nil {
			t.Fatalf("%s.%s: %v", tc.def, tc.prop, err)
		}
		if got := buf.String(); !strings.Contains(got, tc.want) {
			t.Errorf("%s.%s lacks %s: %s", tc.def, tc.prop, tc.want, got)
		}
	}
}

// FuzzArgCheck feeds arbitrary JSON to every argument spec and to
// ResolveArgs through decoded input structs: no value panics them.
func FuzzArgCheck(f *testing.F) {
	for _, s := range []string{`1`, `-1`, `1e300`, `"0s"`, `"x"`, `[]`, `["a", 1]`, `{"a": 1}`, `null`, `true`, `2.5`, `"${{ x }}"`,
		`{"prompts": "p", "n": 5000, "temperature": -1}`, `{"command": [], "kill_grace": "0s"}`, `{"type": "judge", "scale": 0}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var v any
		if json.Unmarshal(data, &v) != nil {
			return
		}
		for _, name := range StepTypeNames() {
			st, _ := LookupStepType(name)
			for _, a := range st.Args {
				_ = a.Check(v)
			}
			if in, ok := testInputs[name]; ok {
				p := reflect.New(reflect.TypeOf(in))
				if json.Unmarshal(data, p.Interface()) == nil {
					_ = ResolveArgs(name, p.Interface())
				}
			}
		}
		for _, st := range scorerTypes {
			for _, a := range st.Args {
				_ = a.Check(v)
			}
		}
		if m, ok := v.(map[string]any); ok {
			_ = ScorerProblems(m, true)
			_, _ = ParseScorer(data)
		}
	})
}
