package pipelines

import (
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/conf"
	"github.com/expr-lang/expr/file"
	"github.com/expr-lang/expr/parser"
	"gopkg.in/yaml.v3"
)

// exprScope says what an expression may reference.
type exprScope struct {
	// step is the id of the step the expression belongs to; "" for
	// loop.until, which runs after the whole iteration and may see any step.
	step string
	// paramsOnly is set where only launch values are known (servers[].url):
	// the value is fixed for the whole run, before any step ran.
	paramsOnly bool
}

// exprSite locates an expression inside a YAML scalar.
type exprSite struct {
	node   *yaml.Node
	path   string
	offset int // byte offset of the expression source in node.Value
}

func (l *loader) checkExprs() {
	p := l.p
	for i := range p.Steps {
		s := &p.Steps[i]
		path := indexPath("steps", i)
		scope := exprScope{step: s.ID}
		if s.When != "" {
			l.checkCondition(s.When, path+".when", scope)
		}
		if s.With != nil {
			l.walkStrings(s.With, path+".with", scope)
		}
	}
	if p.Loop.Until != "" {
		l.checkCondition(p.Loop.Until, "loop.until", exprScope{})
	}
}

// walkStrings checks every templated string in a `with` value, in a fixed
// order so that the expression budget is spent deterministically.
func (l *loader) walkStrings(v any, path string, scope exprScope) {
	switch x := v.(type) {
	case string:
		l.checkTemplate(x, path, scope)
	case []any:
		for i, e := range x {
			l.walkStrings(e, indexPath(path, i), scope)
		}
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			l.walkStrings(x[k], joinPath(path, k), scope)
		}
	}
}

func (l *loader) checkTemplate(s, path string, scope exprScope) {
	if !strings.Contains(s, "${{") {
		return
	}
	n := deref(l.pos[path])
	segs, err := ParseTemplate(s)
	if err != nil {
		line, col := l.scalarPos(n, templateErrOffset(err, s))
		l.errAt(line, col, path, "%v", err)
		return
	}
	for _, seg := range segs {
		if seg.IsExpr {
			l.checkExpr(seg.Text, exprSite{node: n, path: path, offset: seg.Offset}, scope, false)
		}
	}
}

// templateErrOffset recovers the offset ParseTemplate names in its errors.
func templateErrOffset(err error, s string) int {
	var off int
	msg := err.Error()
	if i := strings.LastIndex(msg, "offset "); i >= 0 {
		fmt.Sscanf(msg[i+len("offset "):], "%d", &off)
	}
	if off < 0 || off > len(s) {
		return 0
	}
	return off
}

func (l *loader) checkCondition(cond, path string, scope exprScope) {
	n := deref(l.pos[path])
	src, err := ConditionSource(cond)
	if err != nil {
		line, col := l.scalarPos(n, templateErrOffset(err, cond))
		l.errAt(line, col, path, "%v", err)
		return
	}
	if src == "" {
		l.errNode(n, path, "empty condition")
		return
	}
	off := strings.Index(cond, src)
	if off < 0 {
		off = 0
	}
	l.checkExpr(src, exprSite{node: n, path: path, offset: off}, scope, true)
}

// parserConfig matches what CompileExpr uses, so that disabled builtins
// such as now() parse as the unknown calls the compiler will see.
func parserConfig() *conf.Config {
	c := conf.CreateNew()
	for _, op := range exprOptions() {
		op(c)
	}
	return c
}

// checkExpr parses, reference-checks and compiles one expression.
func (l *loader) checkExpr(src string, site exprSite, scope exprScope, cond bool) {
	if len(src) > maxExprBytes {
		l.errAt(site.node.Line, site.node.Column, site.path, "expression is %d bytes long, the limit is %d", len(src), maxExprBytes)
		return
	}
	if l.exprs++; l.exprs > maxExprs {
		if l.exprs == maxExprs+1 {
			l.errAt(site.node.Line, site.node.Column, site.path, "too many expressions: the limit is %d per pipeline", maxExprs)
		}
		return
	}
	tree, err := safeParse(src)
	if err != nil {
		l.exprError(src, site, err)
		return
	}
	before := len(l.errs)
	l.checkRefs(tree.Node, src, site, scope)
	if len(l.errs) == before {
		l.checkArith(tree.Node, src, site)
	}
	if len(l.errs) != before {
		return
	}
	opts := append(exprOptions(), expr.Env(l.exprEnv()))
	if cond {
		opts = append(opts, expr.AsBool())
	}
	if err := safeCompile(src, opts); err != nil {
		l.exprError(src, site, err)
	}
}

func safeParse(src string) (tree *parser.Tree, err error) {
	defer func() {
		if r := recover(); r != nil {
			tree, err = nil, fmt.Errorf("expression parser failed: %v", r)
		}
	}()
	return parser.ParseWithConfig(src, parserConfig())
}

func safeCompile(src string, opts []expr.Option) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("expression compiler failed: %v", r)
		}
	}()
	_, err = expr.Compile(src, opts...)
	return err
}

// exprError reports an expr-lang error at its position inside the scalar,
// using expr's message without its multi-line source snippet.
func (l *loader) exprError(src string, site exprSite, err error) {
	msg, at := err.Error(), 0
	var fe *file.Error
	if errors.As(err, &fe) {
		msg = fe.Message
		if fe.Snippet != "" && fe.Line == 1 {
			at = runeOffset(src, fe.Column)
		}
	}
	if i := strings.IndexByte(msg, '\n'); i >= 0 {
		msg = msg[:i]
	}
	msg = strings.TrimSpace(msg)
	l.errExpr(site, at, "invalid expression %q: %s", clip(src), msg)
}

// runeOffset converts a rune index of s to a byte offset.
func runeOffset(s string, runes int) int {
	off := 0
	for i := 0; i < runes && off < len(s); i++ {
		_, w := utf8.DecodeRuneInString(s[off:])
		off += w
	}
	return off
}

func (l *loader) errExpr(site exprSite, at int, format string, args ...any) {
	line, col := l.scalarPos(site.node, site.offset+at)
	l.errAt(line, col, site.path, format, args...)
}

// prop is one step of a member chain: a literal name, or a computed one.
type prop struct {
	name    string
	literal bool
}

// refCollector gathers the pieces of an expression the reference check
// needs; it is filled by one ast.Walk.
type refCollector struct {
	members []*ast.MemberNode
	idents  []*ast.IdentifierNode
	inner   map[ast.Node]bool // nodes that are the object of a member access
	callees map[ast.Node]bool
	lets    map[string]bool
}

func (c *refCollector) Visit(n *ast.Node) {
	switch x := (*n).(type) {
	case *ast.MemberNode:
		c.members = append(c.members, x)
		c.inner[unchain(x.Node)] = true
	case *ast.IdentifierNode:
		c.idents = append(c.idents, x)
	case *ast.CallNode:
		c.callees[x.Callee] = true
	case *ast.VariableDeclaratorNode:
		c.lets[x.Name] = true
	}
}

func unchain(n ast.Node) ast.Node {
	for {
		c, ok := n.(*ast.ChainNode)
		if !ok {
			return n
		}
		n = c.Node
	}
}

// checkRefs checks every variable the expression reads: params.X must be
// declared, steps.X must be an upstream step and steps.X.outputs.Y one of
// its outputs, loop.iteration is the only loop field, and nothing else is
// defined. Computed member names (steps[x]) end the checked part.
func (l *loader) checkRefs(root ast.Node, src string, site exprSite, scope exprScope) {
	c := &refCollector{inner: map[ast.Node]bool{}, callees: map[ast.Node]bool{}, lets: map[string]bool{}}
	ast.Walk(&root, c)
	consumed := map[*ast.IdentifierNode]bool{}
	for _, m := range c.members {
		if c.inner[m] {
			continue
		}
		var props []prop
		var cur ast.Node = m
	chain:
		for {
			switch x := cur.(type) {
			case *ast.MemberNode:
				pr := prop{}
				if s, ok := x.Property.(*ast.StringNode); ok {
					pr = prop{name: s.Value, literal: true}
				}
				props = append(props, pr)
				cur = x.Node
			case *ast.ChainNode:
				cur = x.Node
			default:
				break chain
			}
		}
		id, ok := cur.(*ast.IdentifierNode)
		if !ok || c.lets[id.Value] {
			continue
		}
		consumed[id] = true
		for i, j := 0, len(props)-1; i < j; i, j = i+1, j-1 {
			props[i], props[j] = props[j], props[i]
		}
		for i, pr := range props {
			if !pr.literal {
				props = props[:i]
				break
			}
		}
		l.checkRoot(id, props, src, site, scope)
	}
	for _, id := range c.idents {
		switch {
		case consumed[id] || c.lets[id.Value]:
		case c.callees[id] && (id.Value == "now" || id.Value == "date"):
			l.errExpr(site, runeOffset(src, id.Location().From), "%s() is disabled: expressions run inside workflow code and must be deterministic", id.Value)
		case c.callees[id]:
			l.errExpr(site, runeOffset(src, id.Location().From), "unknown function %q", clip(id.Value))
		default:
			l.checkRoot(id, nil, src, site, scope)
		}
	}
}

func (l *loader) checkRoot(id *ast.IdentifierNode, props []prop, src string, site exprSite, scope exprScope) {
	at := runeOffset(src, id.Location().From)
	report := func(format string, args ...any) { l.errExpr(site, at, format, args...) }
	if scope.paramsOnly && id.Value != "params" {
		report("only params may be referenced here, not %q: the value is fixed when the run starts", clip(id.Value))
		return
	}
	switch id.Value {
	case "params":
		if len(props) == 0 {
			return
		}
		names := make([]string, len(l.p.Params))
		for i, p := range l.p.Params {
			names[i] = p.Name
		}
		if !contains(names, props[0].name) {
			report("unknown param %q%s", clip(props[0].name), didYouMean(props[0].name, names))
		}
	case "steps":
		if len(props) == 0 {
			return
		}
		target := props[0].name
		st, ok := l.p.StepByID(target)
		if !ok {
			ids := make([]string, 0, len(l.p.Steps))
			for _, s := range l.p.Steps {
				ids = append(ids, s.ID)
			}
			report("unknown step %q%s", clip(target), didYouMean(target, ids))
			return
		}
		if scope.step != "" {
			if target == scope.step {
				report("a step cannot reference itself")
				return
			}
			if !l.upstreamOf(scope.step)[target] {
				report("step %q is not upstream of %q; add it to needs", target, scope.step)
				return
			}
		}
		if len(props) < 2 {
			return
		}
		switch props[1].name {
		case "status":
		case "outputs":
			if len(props) < 3 {
				return
			}
			t, ok := LookupStepType(st.Uses)
			if !ok {
				return
			}
			outs := t.OutputsOf(st)
			key := props[2].name
			if contains(outs, key) {
				return
			}
			known := "it has no outputs"
			if len(outs) > 0 {
				known = "outputs: " + joinNames(outs)
			}
			if c := suggest(key, outs); c != "" {
				known = fmt.Sprintf("did you mean %q? %s", c, known)
			} else if t.DeclaredOutputs {
				known += "; declare it in the step's outputs"
			}
			report("step %q has no output %q (%s)", target, clip(key), known)
		default:
			report("steps.%s has no field %q (want outputs or status)", target, clip(props[1].name))
		}
	case "loop":
		if len(props) > 0 && props[0].name != "iteration" {
			report("loop has no field %q (want iteration)", clip(props[0].name))
		}
	default:
		report("unknown variable %q (want params, steps or loop)", clip(id.Value))
	}
}

// constFolder computes the constant operands of arithmetic, inside out
// (ast.Walk visits children first), with the run-time rules.
type constFolder struct {
	consts map[ast.Node]any
	found  []arithProblem
}

type arithProblem struct {
	at  ast.Node
	err error
}

func (c *constFolder) Visit(n *ast.Node) {
	switch x := (*n).(type) {
	case *ast.IntegerNode:
		c.consts[x] = x.Value
	case *ast.FloatNode:
		c.consts[x] = x.Value
	case *ast.UnaryNode:
		v, ok := c.consts[x.Node]
		if !ok || (x.Operator != "-" && x.Operator != "+") {
			return
		}
		if x.Operator == "+" {
			c.consts[x] = v
			return
		}
		if r, err := checkedArith("-", 0, v); err == nil {
			c.consts[x] = r
		}
	case *ast.BinaryNode:
		if !arithOps[x.Operator] {
			return
		}
		right, rok := c.consts[x.Right]
		left, lok := c.consts[x.Left]
		switch {
		case lok && rok:
			r, err := checkedArith(x.Operator, left, right)
			if err != nil {
				c.found = append(c.found, arithProblem{x, err})
				return
			}
			c.consts[x] = r
		case rok && (x.Operator == "/" || x.Operator == "%"):
			if n, ok := asNumber(right); ok && n.f == 0 {
				what := "division"
				if x.Operator == "%" {
					what = "modulo"
				}
				c.found = append(c.found, arithProblem{x, fmt.Errorf("%s by zero", what)})
			}
		}
	}
}

// checkArith refuses arithmetic that fails whatever the variables hold:
// a division or modulo by a literal zero, and constant operands that
// overflow (`1e308 * 10`) or break a rule of checkedArith (`3 % 1.5`).
func (l *loader) checkArith(root ast.Node, src string, site exprSite) {
	c := &constFolder{consts: map[ast.Node]any{}}
	ast.Walk(&root, c)
	for _, p := range c.found {
		l.errExpr(site, runeOffset(src, p.at.Location().From), "invalid expression %q: %v", clip(src), p.err)
	}
}

// exprEnv is a typed stand-in for the runtime Env, so that compiling
// catches type errors the variables' types reveal (`params.n + 1` is not a
// condition; `upper(params.n)` takes no int). Params are struct fields
// tagged with their names; step outputs stay untyped.
func (l *loader) exprEnv() any {
	if l.env != nil {
		return l.env
	}
	anyType := reflect.TypeOf((*any)(nil)).Elem()
	var fields []reflect.StructField
	seen := map[string]bool{}
	for _, p := range l.p.Params {
		if seen[p.Name] {
			continue
		}
		seen[p.Name] = true
		t := anyType
		switch p.Type {
		case ParamString, ParamDuration:
			t = reflect.TypeOf("")
		case ParamInt:
			t = reflect.TypeOf(int64(0))
		case ParamFloat:
			t = reflect.TypeOf(float64(0))
		case ParamBool:
			t = reflect.TypeOf(false)
		}
		fields = append(fields, reflect.StructField{
			Name: fmt.Sprintf("P%d", len(fields)), Type: t,
			Tag: reflect.StructTag(fmt.Sprintf("expr:%q", p.Name)),
		})
	}
	loopType := reflect.StructOf([]reflect.StructField{{Name: "Iteration", Type: reflect.TypeOf(0), Tag: `expr:"iteration"`}})
	envType := reflect.StructOf([]reflect.StructField{
		{Name: "Params", Type: reflect.StructOf(fields), Tag: `expr:"params"`},
		{Name: "Steps", Type: reflect.TypeOf(map[string]any{}), Tag: `expr:"steps"`},
		{Name: "Loop", Type: loopType, Tag: `expr:"loop"`},
	})
	l.env = reflect.New(envType).Elem().Interface()
	return l.env
}

// upstreamOf memoises Upstream for the reference check.
func (l *loader) upstreamOf(id string) map[string]bool {
	if l.upstream == nil {
		l.upstream = map[string]map[string]bool{}
	}
	u, ok := l.upstream[id]
	if !ok {
		u = l.p.Upstream(id)
		l.upstream[id] = u
	}
	return u
}
