package pipelines

import (
	"bytes"
	"encoding/json"
	"flag"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite the golden files and REFERENCE.md")

// withFixtureType registers, for one test, a step type with an argument of
// every kind, fixed outputs and a Validate hook, so the corpus can cover
// checks the built-in types do not reach. It is removed afterwards so that
// Reference stays the production one.
func withFixtureType(tb testing.TB) {
	tb.Helper()
	if _, ok := LookupStepType("fixture"); ok {
		return
	}
	RegisterStepType(&StepType{
		Name: "fixture",
		Doc:  "Test-only step type.",
		Args: []ArgSpec{
			{Name: "mode", Kind: KindString, Required: true, Enum: []string{"fast", "slow"}},
			{Name: "count", Kind: KindInt},
			{Name: "ratio", Kind: KindFloat},
			{Name: "flag", Kind: KindBool},
			{Name: "wait", Kind: KindDuration},
			{Name: "tags", Kind: KindStringList},
			{Name: "labels", Kind: KindStringMap},
			{Name: "config", Kind: KindObject},
		},
		Outputs: []string{"path", "score"},
		Validate: func(with map[string]any) map[string]string {
			if n, ok := with["count"].(int64); ok && n > 100 {
				return map[string]string{"count": "must be at most 100"}
			}
			return nil
		},
	})
	tb.Cleanup(func() { delete(stepTypes, "fixture") })
}

// pipelineFiles lists every example: pipelines/examples/** and pipelines/*.yaml.
func pipelineFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir("examples", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && (strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".yml")) {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	top, _ := filepath.Glob("*.yaml")
	files = append(files, top...)
	if len(files) < 3 {
		t.Fatalf("found only %v", files)
	}
	return files
}

func TestExamplesLoad(t *testing.T) {
	for _, f := range pipelineFiles(t) {
		t.Run(f, func(t *testing.T) {
			p, err := LoadFile(f)
			if err != nil {
				t.Fatalf("load:\n%v", err)
			}
			if _, err := p.Order(); err != nil {
				t.Fatal(err)
			}
			if !filepath.IsAbs(p.BaseDir) {
				t.Errorf("base_dir %q is not absolute", p.BaseDir)
			}
			if _, err := p.ResolveParams(nil); err != nil {
				t.Errorf("defaults do not resolve: %v", err)
			}
			// The spec is workflow input: it must survive JSON unchanged.
			b, err := json.Marshal(p)
			if err != nil {
				t.Fatal(err)
			}
			var back Pipeline
			if err := json.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			b2, _ := json.Marshal(&back)
			if !bytes.Equal(b, b2) {
				t.Errorf("JSON round trip changed the spec:\n%s\n%s", b, b2)
			}
		})
	}
}

func TestHelloShape(t *testing.T) {
	p, err := LoadFile("examples/hello.yaml")
	if err != nil {
		t.Fatal(err)
	}
	order, _ := p.Order()
	want := []string{"prepare", "count", "shout", "report", "celebrate", "cleanup"}
	if !reflect.DeepEqual(order, want) {
		t.Errorf("order %v, want %v", order, want)
	}
	if p.Loop.Iterations != 3 {
		t.Errorf("iterations %d", p.Loop.Iterations)
	}
	up := p.Upstream("cleanup")
	for _, id := range want[:5] {
		if !up[id] {
			t.Errorf("cleanup upstream lacks %s: %v", id, up)
		}
	}
	if up["cleanup"] {
		t.Error("a step is not its own upstream")
	}
	if p.Params[1].Default != int64(2) {
		t.Errorf("int default %#v, want int64(2)", p.Params[1].Default)
	}
}

func TestInvalidCorpus(t *testing.T) {
	withFixtureType(t)
	files, err := filepath.Glob("testdata/invalid/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 35 {
		t.Fatalf("corpus has %d files, want at least 35", len(files))
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			p, err := LoadFile(f)
			if err == nil {
				t.Fatalf("loaded without error: %+v", p)
			}
			if _, ok := err.(ErrorList); !ok {
				t.Fatalf("error is %T, want ErrorList", err)
			}
			got := err.Error() + "\n"
			golden := strings.TrimSuffix(f, ".yaml") + ".golden"
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

// bounded runs load and checks it fails quickly, with bounded allocation.
func bounded(t *testing.T, name string, maxAlloc uint64, load func() error, wantMsg string) {
	t.Helper()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	err := load()
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatalf("%s: no error", name)
	}
	if !strings.Contains(err.Error(), wantMsg) {
		t.Errorf("%s: error %q does not mention %q", name, err, wantMsg)
	}
	if elapsed > time.Second {
		t.Errorf("%s: took %v", name, elapsed)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > maxAlloc {
		t.Errorf("%s: allocated %d MB", name, alloc>>20)
	}
}

func TestHostileInput(t *testing.T) {
	huge := filepath.Join(t.TempDir(), "huge.yaml")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	// Sparse: 100 MB of file without 100 MB of disk.
	if err := f.Truncate(100 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	bounded(t, "100MB file", 1<<20, func() error { _, err := LoadFile(huge); return err }, "file is too large: 104857600 bytes")

	big := bytes.Repeat([]byte("a: b\n"), 20<<20)
	bounded(t, "100MB slice", 1<<20, func() error { _, err := Load("big.yaml", big); return err }, "the limit is 4194304")

	bomb := []byte("version: 1\nname: bomb\nl0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n")
	for i := 1; i < 20; i++ {
		bomb = append(bomb, []byte(strings.NewReplacer("N", itoa(i), "P", itoa(i-1)).Replace("lN: &lN [*lP, *lP, *lP, *lP, *lP, *lP, *lP, *lP, *lP, *lP]\n"))...)
	}
	bomb = append(bomb, "steps: [{id: a, uses: noop, with: {outputs: {x: *l19}}}]\n"...)
	bounded(t, "alias bomb", 16<<20, func() error { _, err := Load("bomb.yaml", bomb); return err }, "aliases expanded")

	for _, depth := range []int{5000, 10000} {
		deep := "version: 1\nname: deep\nsteps: [{id: a, uses: noop, with: {outputs: {x: " + strings.Repeat("[", depth) + strings.Repeat("]", depth) + "}}}]\n"
		// yaml.v3 itself refuses 10000 levels; below that our limit does.
		want := "deeper than 64"
		if depth == 10000 {
			want = "exceeded max depth"
		}
		bounded(t, itoa(depth)+"-deep flow nesting", 64<<20, func() error { _, err := Load("deep.yaml", []byte(deep)); return err }, want)
	}

	var blk strings.Builder
	blk.WriteString("version: 1\nname: deep\nx:\n")
	for i := 1; i < 2000; i++ {
		blk.WriteString(strings.Repeat(" ", i) + "- \n")
	}
	bounded(t, "deep block nesting", 64<<20, func() error { _, err := Load("deepblock.yaml", []byte(blk.String())); return err }, "deeper than 64")

	flow := "[" + strings.Repeat("1,", 2<<20-10) + "1]"
	bounded(t, "4MiB flow list", 64<<20, func() error { _, err := Load("flow.yaml", []byte(flow)); return err }, "too complex")

	var keys strings.Builder
	for i := 0; i < 60000; i++ {
		keys.WriteString("k" + itoa(i) + ",")
	}
	// A flow set: one comma per two nodes, under the token pre-check.
	nodes := "version: 1\nname: nodes\nx: {" + keys.String() + "}\n"
	bounded(t, "too many nodes", 256<<20, func() error { _, err := Load("nodes.yaml", []byte(nodes)); return err }, "more than 100000 YAML nodes")

	long := "version: 1\nname: long\nsteps: [{id: a, uses: noop, with: {outputs: {x: \"${{ " + strings.Repeat("1 + ", 2000) + "1 }}\"}}}]\n"
	bounded(t, "long expression", 64<<20, func() error { _, err := Load("long.yaml", []byte(long)); return err }, "the limit is 4096")

	parens := "version: 1\nname: parens\nsteps: [{id: a, uses: noop, when: \"" + strings.Repeat("(", 1000) + "true" + strings.Repeat(")", 1000) + "\"}]\n"
	if _, err := Load("parens.yaml", []byte(parens)); err != nil {
		t.Errorf("1000 nested parens should load: %v", err)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

func TestTooManySteps(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: 1\nname: many\nsteps:\n")
	for i := 0; i <= MaxSteps; i++ {
		b.WriteString("  - {id: s" + strings.Repeat("x", i%3) + itoa(i%100) + "-" + itoa(i/100) + ", uses: noop}\n")
	}
	_, err := Load("many.yaml", []byte(b.String()))
	if err == nil || !strings.Contains(err.Error(), "many.yaml:4:3: steps: too many steps: 1001, the limit is 1000") {
		t.Fatalf("got %v", err)
	}
}

func TestManyErrorsAreCapped(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: 1\nname: capped\nsteps:\n")
	for i := 0; i < 600; i++ {
		b.WriteString("  - {id: BAD, uses: nope}\n")
	}
	_, err := Load("capped.yaml", []byte(b.String()))
	list, ok := err.(ErrorList)
	if !ok {
		t.Fatalf("got %T %v", err, err)
	}
	if len(list) != maxErrors+1 || !strings.Contains(list[maxErrors].Msg, "too many errors") {
		t.Fatalf("got %d errors, last %v", len(list), list[len(list)-1])
	}
}

func TestLoadFileMissing(t *testing.T) {
	_, err := LoadFile("testdata/does-not-exist.yaml")
	if err == nil || !os.IsNotExist(unwrapAll(err)) {
		t.Fatalf("got %v", err)
	}
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}

func TestDefaultsAndCoercion(t *testing.T) {
	src := `
version: 1
name: coerce
params:
  f: {type: float, default: 2}
  i: {type: int, default: 0x10}
  s: {type: string, default: 1.50}
  d: {type: duration, default: 90s}
  b: {type: bool, default: false}
  r: {type: int, required: true}
weight_transfer: {backend: nccl, packed: true, buffer_bytes: 1GiB, num_buffers: 2}
steps:
  - id: a
    uses: exec
    with:
      command: [echo, 4, 2.50, true]
      env: {N: 4}
`
	p, err := Load("/abs/dir/coerce.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	defaults := map[string]any{}
	for _, prm := range p.Params {
		defaults[prm.Name] = prm.Default
	}
	want := map[string]any{"f": 2.0, "i": int64(16), "s": "1.50", "d": "90s", "b": false, "r": nil}
	if !reflect.DeepEqual(defaults, want) {
		t.Errorf("defaults %#v, want %#v", defaults, want)
	}
	if p.WeightTransfer.BufferBytes != 1<<30 {
		t.Errorf("buffer_bytes %d", p.WeightTransfer.BufferBytes)
	}
	if got := p.Steps[0].With["command"]; !reflect.DeepEqual(got, []any{"echo", "4", "2.50", "true"}) {
		t.Errorf("command %#v", got)
	}
	if got := p.Steps[0].With["env"]; !reflect.DeepEqual(got, map[string]any{"N": "4"}) {
		t.Errorf("env %#v", got)
	}
	if p.BaseDir != "/abs/dir" || p.Loop.Iterations != 1 {
		t.Errorf("base_dir %q iterations %d", p.BaseDir, p.Loop.Iterations)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1024": 1024, "1GiB": 1 << 30, "64 MiB": 64 << 20, "2KB": 2000, "3B": 3, "1GB": 1e9} {
		got, err := ParseSize(in)
		if err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "1TB", "-1", "1.5GiB", "9223372036854775807GiB", "GiB"} {
		if _, err := ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) succeeded", in)
		}
	}
}

func TestOrderAndUpstream(t *testing.T) {
	p := &Pipeline{Steps: []Step{
		{ID: "d", Needs: []string{"b", "c"}},
		{ID: "b", Needs: []string{"a"}},
		{ID: "c", Needs: []string{"a"}},
		{ID: "a"},
		{ID: "e"},
	}}
	order, err := p.Order()
	if err != nil {
		t.Fatal(err)
	}
	// a and e are ready first; a comes after e in the file, so e... no:
	// ties go to file order among ready steps: a (index 3) before e (4).
	want := []string{"a", "b", "c", "d", "e"}
	if !reflect.DeepEqual(order, want) {
		t.Errorf("order %v, want %v", order, want)
	}
	up := p.Upstream("d")
	if !reflect.DeepEqual(up, map[string]bool{"a": true, "b": true, "c": true}) {
		t.Errorf("upstream %v", up)
	}
	if len(p.Upstream("nope")) != 0 {
		t.Error("unknown id has upstream")
	}

	cyc := &Pipeline{Steps: []Step{{ID: "x", Needs: []string{"y"}}, {ID: "y", Needs: []string{"x"}}, {ID: "z"}}}
	if _, err := cyc.Order(); err == nil || err.Error() != "dependency cycle: x -> y -> x" {
		t.Errorf("got %v", err)
	}
	if up := cyc.Upstream("x"); !reflect.DeepEqual(up, map[string]bool{"y": true}) {
		t.Errorf("upstream in a cycle %v", up)
	}
	bad := &Pipeline{Steps: []Step{{ID: "x", Needs: []string{"q"}}}}
	if _, err := bad.Order(); err == nil {
		t.Error("unknown need accepted")
	}
}

func TestResolveParams(t *testing.T) {
	p, err := Load("p.yaml", []byte(`
version: 1
name: params
params:
  lr: {type: float, default: 0.1}
  steps: {type: int, default: 10}
  name: {type: string, required: true}
  quick: {type: bool}
  wait: {type: duration, default: 5s}
steps: [{id: a, uses: noop}]
`))
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.ResolveParams(map[string]string{"lr": "0.5", "name": "run1", "quick": "true"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"lr": 0.5, "steps": int64(10), "name": "run1", "quick": true, "wait": "5s"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %#v\nwant %#v", got, want)
	}

	_, err = p.ResolveParams(map[string]string{"lrr": "1", "steps": "ten", "wait": "soon", "extra": "x"})
	wantErr := `param "name" is required
param "steps": must be an integer, got string "ten"
param "wait": invalid duration "soon" (want e.g. 30s, 5m, 1h30m)
unknown param "extra" (declared: lr, steps, name, quick, wait)
unknown param "lrr" (did you mean "lr"?)`
	if err == nil || err.Error() != wantErr {
		t.Errorf("got:\n%v\nwant:\n%s", err, wantErr)
	}

	// JSON from the Temporal UI: numbers arrive as float64.
	var values map[string]any
	json.Unmarshal([]byte(`{"steps": 3, "lr": 1, "name": "x", "quick": false}`), &values)
	got, err = p.ResolveParamValues(values)
	if err != nil {
		t.Fatal(err)
	}
	if got["steps"] != int64(3) || got["lr"] != 1.0 || got["quick"] != false {
		t.Errorf("got %#v", got)
	}
	json.Unmarshal([]byte(`{"steps": 3.5, "lr": "x", "name": 5, "quick": "maybe"}`), &values)
	_, err = p.ResolveParamValues(values)
	wantErr = `param "lr": must be a finite number, got string "x"
param "name": must be a string, got float 5
param "quick": must be true or false, got string "maybe"
param "steps": must be an integer, got float 3.5`
	if err == nil || err.Error() != wantErr {
		t.Errorf("got:\n%v\nwant:\n%s", err, wantErr)
	}

	// After a JSON round trip int defaults are float64; they still resolve.
	b, _ := json.Marshal(p)
	var back Pipeline
	json.Unmarshal(b, &back)
	got, err = back.ResolveParamValues(map[string]any{"name": "y"})
	if err != nil || got["steps"] != int64(10) {
		t.Errorf("round-tripped defaults: %#v, %v", got, err)
	}
}

func TestParseParamFlags(t *testing.T) {
	got, err := ParseParamFlags([]string{"a=1", "b=x=y", "c="})
	if err != nil || !reflect.DeepEqual(got, map[string]string{"a": "1", "b": "x=y", "c": ""}) {
		t.Errorf("got %v, %v", got, err)
	}
	_, err = ParseParamFlags([]string{"a=1", "a=2", "novalue", "=x"})
	if err == nil || strings.Count(err.Error(), "\n") != 2 {
		t.Errorf("got %v", err)
	}
}

func TestReference(t *testing.T) {
	got := Reference()
	if *update {
		if err := os.WriteFile("REFERENCE.md", []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile("REFERENCE.md")
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Error("REFERENCE.md is stale: run go test ./pipelines/ -run TestReference -update")
	}
	for _, name := range StepTypeNames() {
		if !strings.Contains(got, "### "+name+"\n") {
			t.Errorf("reference lacks step type %s", name)
		}
	}
}

func TestJSONSchema(t *testing.T) {
	withFixtureType(t)
	b, err := JSONSchema()
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if doc["$schema"] != "https://json-schema.org/draft/2020-12/schema" {
		t.Errorf("$schema %v", doc["$schema"])
	}
	defs := doc["$defs"].(map[string]any)
	for _, name := range append(StepTypeNames(), "pipeline", "step", "param", "loop", "retry") {
		key := name
		if _, ok := LookupStepType(name); ok {
			key = "with_" + name
		}
		if defs[key] == nil {
			t.Errorf("$defs lacks %s", key)
		}
	}
	exec := defs["with_exec"].(map[string]any)
	if !reflect.DeepEqual(exec["required"], []any{"command"}) {
		t.Errorf("with_exec required %v", exec["required"])
	}
	fixture := defs["with_fixture"].(map[string]any)["properties"].(map[string]any)
	if !strings.Contains(string(mustJSON(fixture["mode"])), `"fast"`) {
		t.Errorf("enum missing: %s", mustJSON(fixture["mode"]))
	}
}

func mustJSON(v any) []byte { b, _ := json.Marshal(v); return b }

// TestSchemaTablesCoverTypes keeps the schema tables and types.go in step:
// every JSON field of a schema struct must be described.
func TestSchemaTablesCoverTypes(t *testing.T) {
	for _, o := range objects {
		for i := 0; i < o.typ.NumField(); i++ {
			name := jsonName(o.typ.Field(i))
			if o == paramObj && name == "name" {
				continue // the key of the params mapping
			}
			if o.field(name) == nil {
				t.Errorf("%s: field %s (%s) missing from the schema table", o.name, name, o.typ.Field(i).Name)
			}
		}
	}
}

func TestExprColumns(t *testing.T) {
	src := "version: 1\nname: cols\nsteps:\n  - id: a\n    uses: noop\n    with: {outputs: {x: \"é ${{ params.nope }}\", y: 'a ${{ loop.it }}', z: \"b ${{ zz }}\"}}\n"
	_, err := Load("c.yaml", []byte(src))
	want := `c.yaml:6:32: steps[0].with.outputs.x: unknown param "nope"
c.yaml:6:59: steps[0].with.outputs.y: loop has no field "it" (want iteration)
c.yaml:6:82: steps[0].with.outputs.z: unknown variable "zz" (want params, steps or loop)`
	if err == nil || err.Error() != want {
		t.Errorf("got:\n%v\nwant:\n%s", err, want)
	}
}

// FuzzLoad checks that no input panics Load and that every error line is
// positioned.
func FuzzLoad(f *testing.F) {
	withFixtureType(f)
	for _, glob := range []string{"examples/*.yaml", "testdata/invalid/*.yaml"} {
		files, _ := filepath.Glob(glob)
		for _, file := range files {
			b, err := os.ReadFile(file)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Load("fuzz.yaml", data)
		if err == nil {
			if p == nil {
				t.Fatal("nil pipeline without error")
			}
			if _, err := json.Marshal(p); err != nil {
				t.Fatalf("valid pipeline does not marshal: %v", err)
			}
			if _, err := p.Order(); err != nil {
				t.Fatalf("valid pipeline has no order: %v", err)
			}
			return
		}
		if p != nil {
			t.Fatal("pipeline returned with an error")
		}
		msg := err.Error()
		if msg == "" {
			t.Fatal("empty error")
		}
		for _, line := range strings.Split(msg, "\n") {
			if !fuzzLineRe.MatchString(line) {
				t.Fatalf("error line without file:line:col: %q", line)
			}
			if strings.Contains(line, "internal error") {
				t.Fatalf("internal error: %s", line)
			}
		}
	})
}

var fuzzLineRe = regexp.MustCompile(`^fuzz\.yaml:[1-9][0-9]*:[1-9][0-9]*: \S`)
