package pipelines

import (
	"container/heap"
	"fmt"
	"strings"
)

// Order returns the step ids in a topological order of needs; among steps
// ready at the same time, file order wins, so the order is deterministic.
func (p *Pipeline) Order() ([]string, error) {
	idx := p.indexByID()
	indeg := make([]int, len(p.Steps))
	dependents := make([][]int, len(p.Steps))
	for i, s := range p.Steps {
		seen := map[int]bool{}
		for _, n := range s.Needs {
			j, ok := idx[n]
			if !ok {
				return nil, fmt.Errorf("step %q needs unknown step %q", s.ID, n)
			}
			if seen[j] {
				continue
			}
			seen[j] = true
			indeg[i]++
			dependents[j] = append(dependents[j], i)
		}
	}
	ready := &intHeap{}
	for i := range p.Steps {
		if indeg[i] == 0 {
			heap.Push(ready, i)
		}
	}
	order := make([]string, 0, len(p.Steps))
	for ready.Len() > 0 {
		i := heap.Pop(ready).(int)
		order = append(order, p.Steps[i].ID)
		for _, d := range dependents[i] {
			if indeg[d]--; indeg[d] == 0 {
				heap.Push(ready, d)
			}
		}
	}
	if len(order) < len(p.Steps) {
		var cs []string
		for _, c := range p.cycles() {
			cs = append(cs, strings.Join(c.ids, " -> "))
		}
		return nil, fmt.Errorf("dependency cycle: %s", strings.Join(cs, "; "))
	}
	return order, nil
}

// Upstream returns the ids of every step id needs, directly or
// transitively; id itself is never included, even inside a cycle.
func (p *Pipeline) Upstream(id string) map[string]bool {
	idx := p.indexByID()
	out := map[string]bool{}
	start, ok := idx[id]
	if !ok {
		return out
	}
	stack := []int{start}
	for len(stack) > 0 {
		i := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for _, n := range p.Steps[i].Needs {
			j, ok := idx[n]
			if !ok || out[n] || n == id {
				continue
			}
			out[n] = true
			stack = append(stack, j)
		}
	}
	return out
}

// indexByID maps each id to its first step; later duplicates are a load
// error and never reach the interpreter.
func (p *Pipeline) indexByID() map[string]int {
	idx := make(map[string]int, len(p.Steps))
	for i, s := range p.Steps {
		if _, dup := idx[s.ID]; !dup && s.ID != "" {
			idx[s.ID] = i
		}
	}
	return idx
}

// cycle is one dependency cycle: ids[0] == ids[len-1], and step ids[k]
// needs ids[k+1] through its needs entry at index need of the first step.
type cycle struct {
	ids  []string
	need int
}

// cycles returns one cycle per strongly connected component with more than
// one step, starting at the component's first step in file order. Self
// needs are left to the needs check.
func (p *Pipeline) cycles() []cycle {
	idx := p.indexByID()
	n := len(p.Steps)
	adj := make([][]int, n)
	for i, s := range p.Steps {
		for _, need := range s.Needs {
			if j, ok := idx[need]; ok && j != i {
				adj[i] = append(adj[i], j)
			}
		}
	}
	comp := tarjan(adj)
	var out []cycle
	done := map[int]bool{}
	for start := 0; start < n; start++ {
		c := comp[start]
		if done[c] {
			continue
		}
		done[c] = true
		// Shortest path back to start inside the component, breadth first
		// over needs in written order: the shortest cycle reads best.
		prev := map[int]int{start: -1}
		queue := []int{start}
		end := -1
		for len(queue) > 0 && end < 0 {
			i := queue[0]
			queue = queue[1:]
			for _, j := range adj[i] {
				if comp[j] != c {
					continue
				}
				if j == start {
					end = i
					break
				}
				if _, seen := prev[j]; !seen {
					prev[j] = i
					queue = append(queue, j)
				}
			}
		}
		if end < 0 {
			continue // a single step, no cycle
		}
		var path []int
		for i := end; i >= 0; i = prev[i] {
			path = append([]int{i}, path...)
		}
		ids := make([]string, 0, len(path)+1)
		for _, i := range path {
			ids = append(ids, p.Steps[i].ID)
		}
		ids = append(ids, p.Steps[start].ID)
		need := 0
		for k, s := range p.Steps[start].Needs {
			if s == ids[1] {
				need = k
				break
			}
		}
		out = append(out, cycle{ids: ids, need: need})
	}
	return out
}

// tarjan labels each vertex with its strongly connected component. It is
// iterative so that a long chain of steps cannot exhaust the stack.
func tarjan(adj [][]int) []int {
	n := len(adj)
	index := make([]int, n)
	low := make([]int, n)
	onStack := make([]bool, n)
	comp := make([]int, n)
	for i := range index {
		index[i] = -1
	}
	var stack []int
	next, ncomp := 0, 0
	type frame struct{ v, edge int }
	for root := 0; root < n; root++ {
		if index[root] >= 0 {
			continue
		}
		call := []frame{{root, 0}}
		index[root], low[root] = next, next
		next++
		stack = append(stack, root)
		onStack[root] = true
		for len(call) > 0 {
			f := &call[len(call)-1]
			v := f.v
			if f.edge < len(adj[v]) {
				w := adj[v][f.edge]
				f.edge++
				if index[w] < 0 {
					index[w], low[w] = next, next
					next++
					stack = append(stack, w)
					onStack[w] = true
					call = append(call, frame{w, 0})
				} else if onStack[w] {
					low[v] = min(low[v], index[w])
				}
				continue
			}
			if low[v] == index[v] {
				for {
					w := stack[len(stack)-1]
					stack = stack[:len(stack)-1]
					onStack[w] = false
					comp[w] = ncomp
					if w == v {
						break
					}
				}
				ncomp++
			}
			call = call[:len(call)-1]
			if len(call) > 0 {
				u := call[len(call)-1].v
				low[u] = min(low[u], low[v])
			}
		}
	}
	return comp
}

type intHeap []int

func (h intHeap) Len() int           { return len(h) }
func (h intHeap) Less(i, j int) bool { return h[i] < h[j] }
func (h intHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *intHeap) Push(x any)        { *h = append(*h, x.(int)) }
func (h *intHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
