package pipelines

import (
	"errors"
	"fmt"
	"math"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/vm/runtime"
)

// Arithmetic in expressions. expr-lang's own operators answer 1/0 with
// +Inf, 0/0 with NaN, 1e308*10 with +Inf, wrap int64 overflow silently and
// refuse `3 % 2.0`; none of that should reach a step's arguments. At run
// time every arithmetic operator is therefore rewritten into a call of
// checkedArith, which follows these rules (the reference states them):
//
//   - + - * of two integers is an integer, and an error on int64 overflow;
//     with a float operand it is a float, and an error if not finite.
//   - / is always a float (expr's meaning); dividing by zero is an error.
//   - % takes integers, and floats with an integral value (JSON, and so
//     step outputs, carry every number as a float); modulo by zero, or
//     by or of a fraction, is an error.
//   - ** and ^ are floats, and an error if not finite.
//
// Operands that are not both numbers (string +, durations) keep expr's
// meaning. The loader applies the same function to constant operands, so
// `1 / 0` and `1e308 * 10` are refused when the file loads.

// arithFunc is the name the rewritten calls use; it cannot be written in an
// expression, so no user code reaches it directly.
const arithFunc = "$arith"

// arithOps are the operators checkedArith replaces.
var arithOps = map[string]bool{"+": true, "-": true, "*": true, "/": true, "%": true, "**": true, "^": true}

// arithPatcher rewrites `a op b` into `$arith("op", a, b)`. ast.Walk visits
// children first, so nested operators are rewritten inside out.
type arithPatcher struct{}

func (arithPatcher) Visit(node *ast.Node) {
	b, ok := (*node).(*ast.BinaryNode)
	if !ok || !arithOps[b.Operator] {
		return
	}
	ast.Patch(node, &ast.CallNode{
		Callee:    &ast.IdentifierNode{Value: arithFunc},
		Arguments: []ast.Node{&ast.StringNode{Value: b.Operator}, b.Left, b.Right},
	})
}

// arithOptions install the checked operators; only the run-time compile
// uses them, so that the loader's type check reports expr's own messages.
func arithOptions() []expr.Option {
	return []expr.Option{
		expr.Function(arithFunc, func(args ...any) (any, error) {
			op, _ := args[0].(string)
			return checkedArith(op, args[1], args[2])
		}),
		expr.Patch(arithPatcher{}),
	}
}

// number is a numeric operand: an integer, or a float.
type number struct {
	i     int64
	f     float64
	isInt bool
}

func asNumber(v any) (number, bool) {
	switch x := v.(type) {
	case float64:
		return number{f: x}, true
	case float32:
		return number{f: float64(x)}, true
	}
	if i, ok := asInt64(v); ok {
		return number{i: i, f: float64(i), isInt: true}, true
	}
	return number{}, false
}

// integral returns n as an integer if it is one exactly.
func (n number) integral() (int64, bool) {
	if n.isInt {
		return n.i, true
	}
	if n.f == math.Trunc(n.f) && math.Abs(n.f) <= MaxExactInt {
		return int64(n.f), true
	}
	return 0, false
}

// checkedArith applies op to a and b by the rules above.
func checkedArith(op string, a, b any) (any, error) {
	x, xok := asNumber(a)
	y, yok := asNumber(b)
	if !xok || !yok {
		return exprArith(op, a, b)
	}
	switch op {
	case "/":
		if y.f == 0 {
			return nil, fmt.Errorf("division by zero: %s / %s", numText(x), numText(y))
		}
		return finite(x.f/y.f, x, op, y)
	case "%":
		xi, xint := x.integral()
		yi, yint := y.integral()
		switch {
		case !xint || !yint:
			return nil, fmt.Errorf("%% takes integers, got %s %% %s", numText(x), numText(y))
		case yi == 0:
			return nil, fmt.Errorf("modulo by zero: %s %% %s", numText(x), numText(y))
		}
		return intResult(xi % yi), nil
	case "**", "^":
		return finite(math.Pow(x.f, y.f), x, op, y)
	}
	if !x.isInt || !y.isInt {
		switch op {
		case "+":
			return finite(x.f+y.f, x, op, y)
		case "-":
			return finite(x.f-y.f, x, op, y)
		case "*":
			return finite(x.f*y.f, x, op, y)
		}
		return nil, fmt.Errorf("unknown operator %q", op)
	}
	r, overflow := int64(0), false
	switch op {
	case "+":
		r = x.i + y.i
		overflow = (r > x.i) != (y.i > 0)
	case "-":
		r = x.i - y.i
		overflow = (r < x.i) != (y.i > 0)
	case "*":
		r = x.i * y.i
		overflow = x.i != 0 && (r/x.i != y.i || (x.i == -1 && y.i == math.MinInt64))
	default:
		return nil, fmt.Errorf("unknown operator %q", op)
	}
	if overflow {
		return nil, fmt.Errorf("integer overflow: %d %s %d is beyond int64", x.i, op, y.i)
	}
	return intResult(r), nil
}

// intResult is an integer as expr's own integers are: int, which is 64-bit
// on every platform rlflow builds for.
func intResult(r int64) any {
	if int64(int(r)) == r {
		return int(r)
	}
	return r
}

func finite(r float64, x number, op string, y number) (any, error) {
	if math.IsInf(r, 0) || math.IsNaN(r) {
		return nil, fmt.Errorf("%s %s %s is not a finite number", numText(x), op, numText(y))
	}
	return r, nil
}

func numText(n number) string {
	if n.isInt {
		return fmt.Sprint(n.i)
	}
	return formatValue(n.f)
}

// exprArith is expr's own operator, for operands that are not both
// numbers; its panics on operands it does not take become errors.
func exprArith(op string, a, b any) (v any, err error) {
	defer func() {
		if r := recover(); r != nil {
			v, err = nil, fmt.Errorf("%v", r)
		}
	}()
	switch op {
	case "+":
		return runtime.Add(a, b), nil
	case "-":
		return runtime.Subtract(a, b), nil
	case "*":
		return runtime.Multiply(a, b), nil
	case "/":
		return runtime.Divide(a, b), nil
	case "%":
		return runtime.Modulo(a, b), nil
	case "**", "^":
		return runtime.Exponent(a, b), nil
	}
	return nil, fmt.Errorf("unknown operator %q", op)
}

// errNotFinite is returned when a rendered value holds a NaN or an
// infinity, which a builtin (float("inf"), mean([])) can still produce.
var errNotFinite = errors.New("is not a finite number")

// checkFinite refuses NaN and the infinities anywhere inside v: JSON, and
// so a step's arguments, cannot carry them.
func checkFinite(v any) error {
	switch x := v.(type) {
	case float64:
		if math.IsInf(x, 0) || math.IsNaN(x) {
			return fmt.Errorf("the value %v %w", x, errNotFinite)
		}
	case float32:
		return checkFinite(float64(x))
	case []any:
		for i, e := range x {
			if err := checkFinite(e); err != nil {
				return fmt.Errorf("[%d]: %w", i, err)
			}
		}
	case []float64:
		for i, e := range x {
			if err := checkFinite(e); err != nil {
				return fmt.Errorf("[%d]: %w", i, err)
			}
		}
	case map[string]any:
		for _, k := range sortedKeys(x) {
			if err := checkFinite(x[k]); err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
		}
	}
	return nil
}
