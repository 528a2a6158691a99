package pipelines

import (
	"encoding/json"
	"math"
	"math/big"
	"reflect"
	"strings"
	"testing"
)

// launchParams resolves params as the pipeline workflow does, sends them
// through JSON as the iteration workflow receives them (an int param as a
// float64), and types them again as it does.
func launchParams(t *testing.T, p *Pipeline, given map[string]any) map[string]any {
	t.Helper()
	resolved, err := p.ResolveParamValues(given)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(resolved)
	if err != nil {
		t.Fatal(err)
	}
	var wire map[string]any
	if err := json.Unmarshal(b, &wire); err != nil {
		t.Fatal(err)
	}
	if _, ok := wire["every"].(float64); !ok {
		t.Fatalf("an int param crossed JSON as %T, want float64", wire["every"])
	}
	return p.TypedParams(wire)
}

func TestRenderArithmetic(t *testing.T) {
	p, err := Load("arith.yaml", []byte(`version: 1
name: arith
params:
  every: {type: int, default: 3}
  big: {type: int, default: 9007199254740992}
  rate: {type: float, default: 0.5}
  whole: {type: float, default: 2.0}
  zero: {type: float, default: 0}
  izero: {type: int, default: 0}
  name: {type: string, default: run}
steps: [{id: a, uses: noop}]
`))
	if err != nil {
		t.Fatal(err)
	}
	params := launchParams(t, p, nil)
	if _, ok := params["every"].(int64); !ok {
		t.Fatalf("int param after the JSON round trip is %T, want int64", params["every"])
	}
	env := Env{Params: params, Iteration: 7, Steps: map[string]StepState{
		"gen": {Status: "succeeded", Outputs: map[string]any{"count": 12.0, "score": 0.75}}, // as JSON delivers them
	}}
	for _, c := range []struct {
		src  string
		want any    // when err is ""
		err  string // substring of the error
	}{
		{src: "${{ loop.iteration % params.every }}", want: 1},
		{src: "${{ loop.iteration % params.every == 1 }}", want: true},
		{src: "${{ params.every * 2 }}", want: 6},
		{src: "${{ params.every / 2 }}", want: 1.5},
		{src: "${{ params.every + params.rate }}", want: 3.5},
		{src: "${{ params.whole % 2 }}", want: 0},            // integral float
		{src: "${{ steps.gen.outputs.count % 5 }}", want: 2}, // a JSON number
		{src: "${{ params.every ** 2 }}", want: 9.0},         // ** is a float
		{src: "${{ -params.every - 1 }}", want: -4},          // unary minus
		{src: "${{ params.name + '-' + string(loop.iteration) }}", want: "run-7"},
		{src: "iter-${{ loop.iteration * 10 }}-${{ params.rate * 4 }}", want: "iter-70-2"},
		{src: "${{ 1 / params.zero }}", err: `evaluating "1 / params.zero": division by zero: 1 / 0 (column 3)`},
		{src: "${{ 0 / params.zero }}", err: "division by zero: 0 / 0"},
		{src: "${{ loop.iteration % params.izero }}", err: "modulo by zero: 7 % 0"},
		{src: "${{ loop.iteration % params.rate }}", err: "% takes integers, got 7 % 0.5"},
		{src: "${{ steps.gen.outputs.score % 2 }}", err: "% takes integers, got 0.75 % 2"},
		{src: "${{ params.big * 512 }}", want: 1 << 62},
		{src: "${{ -params.big * 1024 }}", want: math.MinInt64}, // exactly fits
		{src: "${{ params.big * 1024 }}", err: "integer overflow: 9007199254740992 * 1024 is beyond int64"},
		{src: "${{ -params.big * 1024 - 1 }}", err: "integer overflow: -9223372036854775808 - 1 is beyond int64"},
		{src: "${{ params.big * params.big }}", err: "integer overflow"},
		{src: "${{ params.rate * 1e308 * 1e308 }}", err: "is not a finite number"},
		{src: "${{ 10.0 ** params.big }}", err: "is not a finite number"},
		{src: "${{ float('inf') }}", err: "the value +Inf is not a finite number"},
		{src: "${{ [1.0, float('nan')] }}", err: "[1]: the value NaN is not a finite number"},
		{src: "x ${{ 1 / params.zero }}", err: "division by zero"}, // inside text too
		{src: "${{ params.name * 2 }}", err: "invalid operation: string * int"},
	} {
		got, err := RenderString(c.src, env)
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s: got %v, %v; want error containing %q", c.src, got, err, c.err)
		case c.err != "" && strings.Contains(err.Error(), "\n"):
			t.Errorf("%s: error on several lines: %q", c.src, err)
		case c.err == "" && err != nil:
			t.Errorf("%s: %v", c.src, err)
		case c.err == "" && !reflect.DeepEqual(got, c.want):
			t.Errorf("%s = %#v, want %#v", c.src, got, c.want)
		}
	}
}

// TestRenderNamesField checks the run-time error names the argument, as
// the interpreter reports it with the step.
func TestRenderNamesField(t *testing.T) {
	with := map[string]any{"command": []any{"train", "--lr=${{ 1 / params.z }}"}}
	_, err := Render(with, Env{Params: map[string]any{"z": 0.0}})
	want := `command: [1]: evaluating "1 / params.z": division by zero: 1 / 0 (column 3)`
	if err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}
}

func TestCheckedArithInts(t *testing.T) {
	for _, c := range []struct {
		op   string
		a, b int64
	}{
		{"+", math.MaxInt64, 1}, {"+", math.MinInt64, -1}, {"+", math.MaxInt64, math.MinInt64},
		{"-", math.MinInt64, 1}, {"-", 0, math.MinInt64}, {"-", -1, math.MinInt64},
		{"*", math.MinInt64, -1}, {"*", -1, math.MinInt64}, {"*", math.MinInt64, 1},
		{"*", 1 << 32, 1 << 31}, {"*", -(1 << 32), 1 << 31}, {"*", 3037000500, 3037000500},
		{"%", math.MinInt64, -1}, {"%", 7, -3},
	} {
		checkIntArith(t, c.op, c.a, c.b)
	}
}

// checkIntArith holds checkedArith on two integers to exact arithmetic: the
// int64 result when it fits, an overflow error when it does not.
func checkIntArith(t *testing.T, op string, a, b int64) {
	t.Helper()
	x, y := big.NewInt(a), big.NewInt(b)
	var want *big.Int
	switch op {
	case "+":
		want = new(big.Int).Add(x, y)
	case "-":
		want = new(big.Int).Sub(x, y)
	case "*":
		want = new(big.Int).Mul(x, y)
	case "%":
		if b == 0 {
			if _, err := checkedArith(op, a, b); err == nil || !strings.Contains(err.Error(), "modulo by zero") {
				t.Errorf("%d %% 0: got %v", a, err)
			}
			return
		}
		want = new(big.Int).Rem(x, y) // Go's %: the sign of the dividend
	default:
		return
	}
	got, err := checkedArith(op, a, b)
	if !want.IsInt64() {
		if err == nil || !strings.Contains(err.Error(), "integer overflow") {
			t.Errorf("%d %s %d: got %v, %v; want an overflow error", a, op, b, got, err)
		}
		return
	}
	n, ok := asInt64(got)
	if err != nil || !ok || n != want.Int64() {
		t.Errorf("%d %s %d = %v, %v; want %s", a, op, b, got, err, want)
	}
}

// FuzzCheckedArith holds the checked operators to exact integer arithmetic
// and to finite float results.
func FuzzCheckedArith(f *testing.F) {
	f.Add(int64(math.MaxInt64), int64(1), 1e308, 10.0, uint8(0))
	f.Add(int64(math.MinInt64), int64(-1), 0.0, 0.0, uint8(2))
	f.Add(int64(7), int64(0), 1.5, math.Copysign(0, -1), uint8(3))
	ops := []string{"+", "-", "*", "%", "/", "**"}
	f.Fuzz(func(t *testing.T, a, b int64, x, y float64, pick uint8) {
		op := ops[int(pick)%len(ops)]
		checkIntArith(t, op, a, b)
		for _, pair := range [][2]any{{x, y}, {a, y}, {x, b}} {
			got, err := checkedArith(op, pair[0], pair[1])
			if err != nil {
				continue
			}
			if e := checkFinite(got); e != nil {
				t.Fatalf("%v %s %v = %v: %v", pair[0], op, pair[1], got, e)
			}
		}
	})
}

// FuzzRender checks that rendering any expression over numeric params
// never panics, never yields a NaN or an infinity, and reports errors on
// one line.
func FuzzRender(f *testing.F) {
	for _, s := range []string{
		"${{ 1 / params.z }}", "${{ params.n % params.z }}", "${{ params.f * 1e308 * 10 }}",
		"a${{ loop.iteration % params.n }}b", "${{ float('inf') }}", "${{ -params.n - 9223372036854775807 }}",
		"${{ params.f ** params.n }}", "${{ [params.f / 3, 0 / params.f] }}", "${{ {'a': 1 / params.z} }}",
		"${{ mean([]) }}", "${{ max(params.f, 1e308) * 2 }}", "${{ params.n .. 3 }}",
	} {
		f.Add(s, int64(3), 0.5)
	}
	f.Fuzz(func(t *testing.T, src string, n int64, x float64) {
		if len(src) > maxExprBytes {
			return
		}
		env := Env{Params: map[string]any{"n": n, "f": x, "z": 0.0}, Iteration: 2}
		got, err := RenderString(src, env)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("%q: error on several lines: %q", src, err)
			}
			return
		}
		if e := checkFinite(got); e != nil {
			t.Fatalf("%q rendered %v: %v", src, got, e)
		}
	})
}

func TestTypedParams(t *testing.T) {
	p := &Pipeline{Params: []Param{{Name: "n", Type: ParamInt}, {Name: "f", Type: ParamFloat}, {Name: "s", Type: ParamString}, {Name: "odd", Type: ParamInt}}}
	in := map[string]any{"n": 4.0, "f": 2.0, "s": "x", "odd": 1.5, "extra": 3.0}
	got := p.TypedParams(in)
	want := map[string]any{"n": int64(4), "f": 2.0, "s": "x", "odd": 1.5, "extra": 3.0}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("TypedParams = %#v, want %#v", got, want)
	}
	if in["n"] != 4.0 {
		t.Error("TypedParams modified its input")
	}
}
