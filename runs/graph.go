package runs

import (
	"fmt"
	"strings"

	"github.com/rlflow/rlflow/pipelines"
)

// Mermaid renders the step DAG as a Mermaid flowchart.
func Mermaid(p *pipelines.Pipeline) string {
	var b strings.Builder
	b.WriteString("flowchart TD\n")
	for _, s := range p.Steps {
		label := fmt.Sprintf("%s<br/><i>%s</i>", s.ID, s.Uses)
		shape := "[\"%s\"]"
		if s.Always {
			shape = "([\"%s\"])" // stadium: runs even after failures
		}
		fmt.Fprintf(&b, "  %s"+shape+"\n", mermaidID(s.ID), label)
	}
	for _, s := range p.Steps {
		for _, n := range s.Needs {
			fmt.Fprintf(&b, "  %s --> %s\n", mermaidID(n), mermaidID(s.ID))
		}
	}
	return b.String()
}

func mermaidID(id string) string { return "s_" + strings.NewReplacer("-", "_", ".", "_").Replace(id) }

// DOT renders the step DAG in Graphviz DOT.
func DOT(p *pipelines.Pipeline) string {
	var b strings.Builder
	fmt.Fprintf(&b, "digraph %q {\n  rankdir=TB;\n  node [shape=box, fontname=\"Helvetica\"];\n", p.Name)
	for _, s := range p.Steps {
		style := ""
		if s.Always {
			style = ", style=rounded"
		}
		fmt.Fprintf(&b, "  %q [label=%q%s];\n", s.ID, s.ID+"\n("+s.Uses+")", style)
	}
	for _, s := range p.Steps {
		for _, n := range s.Needs {
			fmt.Fprintf(&b, "  %q -> %q;\n", n, s.ID)
		}
	}
	b.WriteString("}\n")
	return b.String()
}
