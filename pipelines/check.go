package pipelines

import (
	"fmt"
	"sort"
	"strings"

	"github.com/expr-lang/expr/ast"
	"github.com/expr-lang/expr/parser"
	"gopkg.in/yaml.v3"
)

// child returns the value node of key in mapping n (nil if absent).
func child(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			v := n.Content[i+1]
			if v.Kind == yaml.AliasNode {
				return v.Alias
			}
			return v
		}
	}
	return nil
}

func orNode(n, fallback *yaml.Node) *yaml.Node {
	if n != nil {
		return n
	}
	return fallback
}

// semantic runs the checks that span fields: ids, needs, cycles, per-type
// arguments and expression references.
func (l *loader) semantic(p *Pipeline, root *yaml.Node) {
	stepsNode := child(root, "steps")
	stepNode := func(i int) *yaml.Node {
		if stepsNode != nil && stepsNode.Kind == yaml.SequenceNode && i < len(stepsNode.Content) {
			return stepsNode.Content[i]
		}
		return root
	}
	firstLine := map[string]int{}
	for i, s := range p.Steps {
		if s.ID == "" {
			continue
		}
		if line, dup := firstLine[s.ID]; dup {
			l.addf(orNode(child(stepNode(i), "id"), stepNode(i)), fmt.Sprintf("steps[%d].id", i), "duplicate step id %q (first defined at line %d)", s.ID, line)
			continue
		}
		firstLine[s.ID] = orNode(child(stepNode(i), "id"), stepNode(i)).Line
	}
	ids := make([]string, 0, len(firstLine))
	for id := range firstLine {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for i, s := range p.Steps {
		field := fmt.Sprintf("steps[%d]", i)
		sn := stepNode(i)
		needsNode := child(sn, "needs")
		seen := map[string]bool{}
		for j, n := range s.Needs {
			nn := sn
			if needsNode != nil && j < len(needsNode.Content) {
				nn = needsNode.Content[j]
			}
			f := fmt.Sprintf("%s.needs[%d]", field, j)
			switch {
			case n == s.ID:
				l.addf(nn, f, "a step cannot need itself")
			case seen[n]:
				l.addf(nn, f, "%q is listed twice", n)
			case firstLine[n] == 0:
				l.addf(nn, f, "unknown step%s", suggest(n, ids))
			}
			seen[n] = true
		}
		if len(s.Outputs) > 0 {
			if t, ok := LookupStepType(s.Uses); ok && !t.DeclaredOutputs {
				l.addf(child(sn, "outputs"), field+".outputs", "step type %s has fixed outputs (%s); outputs: is only for types like exec", s.Uses, strings.Join(t.Outputs, ", "))
			}
			for j, o := range s.Outputs {
				if !identRe.MatchString(o) {
					l.addf(child(sn, "outputs"), fmt.Sprintf("%s.outputs[%d]", field, j), "%q is not an identifier", o)
				}
				if o == "exit_code" || o == "log" {
					l.addf(child(sn, "outputs"), fmt.Sprintf("%s.outputs[%d]", field, j), "%q is a built-in output", o)
				}
			}
		}
		timeout, hb := s.Timeout, s.Heartbeat
		if timeout == 0 {
			timeout = p.Defaults.Timeout
		}
		if hb == 0 {
			hb = p.Defaults.Heartbeat
		}
		if timeout > 0 && hb > 0 && hb >= timeout {
			l.addf(orNode(child(sn, "heartbeat"), sn), field+".heartbeat", "heartbeat %s must be shorter than timeout %s", hb, timeout)
		}
		if t, ok := LookupStepType(s.Uses); ok {
			l.checkWith(t, &s, child(sn, "with"), sn, field)
		}
	}
	for _, cyc := range cycles(p) {
		i := indexOf(p, cyc[0])
		l.addf(orNode(child(stepNode(i), "needs"), stepNode(i)), fmt.Sprintf("steps[%d].needs", i), "dependency cycle: %s", strings.Join(cyc, " -> "))
	}
	// Expressions, once the DAG is known.
	if len(cycles(p)) == 0 {
		for i := range p.Steps {
			s := &p.Steps[i]
			field := fmt.Sprintf("steps[%d]", i)
			up := p.Upstream(s.ID)
			if s.When != "" {
				l.checkCondition(p, s.When, up, child(stepNode(i), "when"), field+".when")
			}
			l.checkTemplates(p, s.With, up, child(stepNode(i), "with"), field+".with")
		}
	}
	if p.Loop.Until != "" {
		all := map[string]bool{}
		for _, s := range p.Steps {
			all[s.ID] = true
		}
		l.checkCondition(p, p.Loop.Until, all, child(child(root, "loop"), "until"), "loop.until")
	}
}

func indexOf(p *Pipeline, id string) int {
	for i, s := range p.Steps {
		if s.ID == id {
			return i
		}
	}
	return 0
}

// cycles returns each dependency cycle once, starting at its first step in
// file order and closed by repeating it.
func cycles(p *Pipeline) [][]string {
	index := map[string]int{}
	for i, s := range p.Steps {
		if _, dup := index[s.ID]; !dup {
			index[s.ID] = i
		}
	}
	state := make([]int, len(p.Steps)) // 0 new, 1 on stack, 2 done
	var stack []string
	var out [][]string
	seen := map[string]bool{}
	var visit func(i int)
	visit = func(i int) {
		state[i] = 1
		stack = append(stack, p.Steps[i].ID)
		for _, n := range p.Steps[i].Needs {
			j, ok := index[n]
			if !ok || n == p.Steps[i].ID {
				continue
			}
			if state[j] == 1 {
				k := len(stack) - 1
				for stack[k] != n {
					k--
				}
				cyc := append([]string(nil), stack[k:]...)
				// rotate to start at the cycle's first step in file order
				best := 0
				for x := range cyc {
					if index[cyc[x]] < index[cyc[best]] {
						best = x
					}
				}
				cyc = append(cyc[best:], cyc[:best]...)
				// needs point backwards (a needs b: b runs first); print in run order
				for a, b := 1, len(cyc)-1; a < b; a, b = a+1, b-1 {
					cyc[a], cyc[b] = cyc[b], cyc[a]
				}
				key := strings.Join(sortedCopy(cyc), ",")
				if !seen[key] {
					seen[key] = true
					out = append(out, append(cyc, cyc[0]))
				}
			} else if state[j] == 0 {
				visit(j)
			}
		}
		stack = stack[:len(stack)-1]
		state[i] = 2
	}
	for i := range p.Steps {
		if state[i] == 0 {
			visit(i)
		}
	}
	return out
}

func sortedCopy(s []string) []string {
	c := append([]string(nil), s...)
	sort.Strings(c)
	return c
}

// Upstream returns every step id the given step transitively needs.
func (p *Pipeline) Upstream(id string) map[string]bool {
	up := map[string]bool{}
	var walk func(string)
	walk = func(x string) {
		s, ok := p.StepByID(x)
		if !ok {
			return
		}
		for _, n := range s.Needs {
			if !up[n] {
				up[n] = true
				walk(n)
			}
		}
	}
	walk(id)
	return up
}

// Order returns the step ids in a topological order, ties in file order.
func (p *Pipeline) Order() ([]string, error) {
	if c := cycles(p); len(c) > 0 {
		return nil, fmt.Errorf("dependency cycle: %s", strings.Join(c[0], " -> "))
	}
	done := map[string]bool{}
	var out []string
	for len(out) < len(p.Steps) {
		progressed := false
		for _, s := range p.Steps {
			if done[s.ID] {
				continue
			}
			ready := true
			for _, n := range s.Needs {
				if !done[n] {
					ready = false
				}
			}
			if ready {
				done[s.ID] = true
				out = append(out, s.ID)
				progressed = true
				break
			}
		}
		if !progressed {
			return nil, fmt.Errorf("steps need unknown steps")
		}
	}
	return out, nil
}

func (l *loader) checkWith(t *StepType, s *Step, withNode, stepNode *yaml.Node, field string) {
	names := make([]string, 0, len(t.Args))
	for _, a := range t.Args {
		names = append(names, a.Name)
	}
	keys := make([]string, 0, len(s.With))
	for k := range s.With {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		a, ok := t.Arg(k)
		node := orNode(child(withNode, k), orNode(withNode, stepNode))
		if !ok {
			l.addf(keyNode(withNode, k, node), field+".with."+k, "%s takes no argument%s", t.Name, suggest(k, names))
			continue
		}
		if msg := checkKind(a, s.With[k]); msg != "" {
			l.addf(node, field+".with."+k, "%s", msg)
		}
	}
	for _, a := range t.Args {
		if _, ok := s.With[a.Name]; a.Required && !ok {
			l.addf(orNode(withNode, stepNode), field+".with."+a.Name, "required by %s: %s", t.Name, a.Doc)
		}
	}
	if t.Validate != nil {
		probs := t.Validate(s.With)
		ks := make([]string, 0, len(probs))
		for k := range probs {
			ks = append(ks, k)
		}
		sort.Strings(ks)
		for _, k := range ks {
			l.addf(orNode(child(withNode, k), orNode(withNode, stepNode)), field+".with."+k, "%s", probs[k])
		}
	}
}

func keyNode(m *yaml.Node, key string, fallback *yaml.Node) *yaml.Node {
	if m != nil && m.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(m.Content); i += 2 {
			if m.Content[i].Value == key {
				return m.Content[i]
			}
		}
	}
	return fallback
}

// isExprString reports a string whose type is only known at run time.
func isExprString(v any) bool {
	s, ok := v.(string)
	return ok && strings.Contains(s, "${{")
}

func checkKind(a ArgSpec, v any) string {
	if isExprString(v) && a.Kind != KindStringList && a.Kind != KindStringMap && a.Kind != KindObject {
		return ""
	}
	switch a.Kind {
	case KindString:
		s, ok := v.(string)
		if !ok {
			return fmt.Sprintf("want a string, got %s", describe(v))
		}
		if len(a.Enum) > 0 && !contains(a.Enum, s) {
			return fmt.Sprintf("%q is not one of %s", s, strings.Join(a.Enum, ", "))
		}
	case KindInt:
		if _, ok := v.(int64); !ok {
			return fmt.Sprintf("want an integer, got %s", describe(v))
		}
	case KindFloat:
		switch v.(type) {
		case int64, float64:
		default:
			return fmt.Sprintf("want a number, got %s", describe(v))
		}
	case KindBool:
		if _, ok := v.(bool); !ok {
			return fmt.Sprintf("want true or false, got %s", describe(v))
		}
	case KindDuration:
		s, ok := v.(string)
		if !ok {
			return fmt.Sprintf("want a duration like 30s, got %s", describe(v))
		}
		if _, err := ParseDuration(s); err != nil {
			return err.Error()
		}
	case KindStringList:
		if isExprString(v) {
			return ""
		}
		list, ok := v.([]any)
		if !ok {
			return fmt.Sprintf("want a list of strings, got %s", describe(v))
		}
		if len(list) == 0 {
			return "must not be empty"
		}
		for i, e := range list {
			if _, ok := e.(string); !ok {
				return fmt.Sprintf("[%d]: want a string, got %s (quote numbers)", i, describe(e))
			}
		}
	case KindStringMap:
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Sprintf("want a mapping of strings, got %s", describe(v))
		}
		for _, k := range sortedKeys(m) {
			if _, ok := m[k].(string); !ok {
				return fmt.Sprintf("%s: want a string, got %s (quote numbers)", k, describe(m[k]))
			}
		}
	case KindObject:
		if _, ok := v.(map[string]any); !ok {
			return fmt.Sprintf("want a mapping, got %s", describe(v))
		}
	}
	return ""
}

func sortedKeys(m map[string]any) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func describe(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("%q", x)
	case []any:
		return "a list"
	case map[string]any:
		return "a mapping"
	default:
		return fmt.Sprintf("%v", x)
	}
}

func (l *loader) checkTemplates(p *Pipeline, v any, up map[string]bool, node *yaml.Node, field string) {
	switch x := v.(type) {
	case string:
		segs, err := ParseTemplate(x)
		if err != nil {
			l.addf(node, field, "%v", err)
			return
		}
		for _, seg := range segs {
			if seg.IsExpr {
				l.checkExpr(p, seg.Text, up, node, field)
			}
		}
	case []any:
		for i, e := range x {
			var n *yaml.Node
			if node != nil && node.Kind == yaml.SequenceNode && i < len(node.Content) {
				n = node.Content[i]
			}
			l.checkTemplates(p, e, up, orNode(n, node), fmt.Sprintf("%s[%d]", field, i))
		}
	case map[string]any:
		for _, k := range sortedKeys(x) {
			l.checkTemplates(p, x[k], up, orNode(child(node, k), node), field+"."+k)
		}
	}
}

func (l *loader) checkCondition(p *Pipeline, cond string, up map[string]bool, node *yaml.Node, field string) {
	src, err := ConditionSource(cond)
	if err != nil {
		l.addf(node, field, "%v", err)
		return
	}
	l.checkExpr(p, src, up, node, field)
}

// checkExpr compiles an expression and checks what it references.
func (l *loader) checkExpr(p *Pipeline, src string, up map[string]bool, node *yaml.Node, field string) {
	if _, err := CompileExpr(src); err != nil {
		l.addf(node, field, "expression %q: %s", src, firstLineOf(err.Error()))
		return
	}
	tree, err := parser.Parse(src)
	if err != nil {
		l.addf(node, field, "expression %q: %s", src, firstLineOf(err.Error()))
		return
	}
	v := &refChecker{}
	ast.Walk(&tree.Node, v)
	for _, ref := range v.refs {
		if msg := checkRef(p, ref, up); msg != "" {
			l.addf(node, field, "expression %q: %s", src, msg)
		}
	}
}

func firstLineOf(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// refChecker collects dotted references like steps.a.outputs.b.
type refChecker struct {
	refs [][]string
}

func (r *refChecker) Visit(node *ast.Node) {
	switch n := (*node).(type) {
	case *ast.IdentifierNode:
		r.refs = append(r.refs, []string{n.Value})
	case *ast.MemberNode:
		path, ok := memberPath(n)
		if ok {
			r.refs = append(r.refs, path)
		}
	}
}

// memberPath flattens a.b.c; non-literal member access is left unchecked.
func memberPath(n *ast.MemberNode) ([]string, bool) {
	prop, ok := n.Property.(*ast.StringNode)
	if !ok {
		return nil, false
	}
	switch base := n.Node.(type) {
	case *ast.IdentifierNode:
		return []string{base.Value, prop.Value}, true
	case *ast.MemberNode:
		p, ok := memberPath(base)
		if !ok {
			return nil, false
		}
		return append(p, prop.Value), true
	}
	return nil, false
}

func checkRef(p *Pipeline, ref []string, up map[string]bool) string {
	switch ref[0] {
	case "params":
		if len(ref) < 2 {
			return ""
		}
		for _, pr := range p.Params {
			if pr.Name == ref[1] {
				return ""
			}
		}
		names := make([]string, 0, len(p.Params))
		for _, pr := range p.Params {
			names = append(names, pr.Name)
		}
		if len(names) == 0 {
			return fmt.Sprintf("unknown param %q (the pipeline declares no params)", ref[1])
		}
		return "unknown param" + suggest(ref[1], names)
	case "loop":
		if len(ref) >= 2 && ref[1] != "iteration" {
			return fmt.Sprintf("loop has no %q (want loop.iteration)", ref[1])
		}
		return ""
	case "steps":
		if len(ref) < 2 {
			return ""
		}
		s, ok := p.StepByID(ref[1])
		if !ok {
			return fmt.Sprintf("unknown step %q", ref[1])
		}
		if !up[ref[1]] {
			return fmt.Sprintf("step %q is not upstream of this step (add it to needs)", ref[1])
		}
		if len(ref) < 3 {
			return ""
		}
		switch ref[2] {
		case "status":
			return ""
		case "outputs":
			if len(ref) < 4 {
				return ""
			}
			t, ok := LookupStepType(s.Uses)
			if !ok {
				return ""
			}
			outs := t.OutputsOf(s)
			if contains(outs, ref[3]) {
				return ""
			}
			if len(outs) == 0 {
				return fmt.Sprintf("step %q (%s) has no outputs; declare %q in its outputs:", ref[1], s.Uses, ref[3])
			}
			hint := ""
			if t.DeclaredOutputs {
				hint = " (declare it in the step's outputs:)"
			}
			return fmt.Sprintf("step %q (%s) has no output %q; it has %s%s", ref[1], s.Uses, ref[3], strings.Join(outs, ", "), hint)
		default:
			return fmt.Sprintf("steps.%s has no %q (want outputs or status)", ref[1], ref[2])
		}
	}
	if len(ref) == 1 {
		// A bare identifier: builtin function names are fine (expr resolves
		// them itself); anything else is an unknown variable.
		return ""
	}
	return fmt.Sprintf("unknown variable %q (want params, steps or loop)", ref[0])
}
