package pipelines

import (
	"encoding/json"
	"fmt"
)

// checkSpecSize refuses a pipeline too large to travel through Temporal:
// the loaded spec is JSON-encoded into the input of the pipeline workflow
// and of every iteration workflow (see MaxSpecBytes and MaxRunSpecBytes).
// It runs on an otherwise valid pipeline, whose size measure bounded
// (MaxExpandedBytes), so encoding it costs at most a few MiB.
func (l *loader) checkSpecSize() {
	b, err := json.Marshal(l.p)
	if err != nil {
		l.errAt(1, 1, "", "the pipeline does not encode as JSON, the form it travels in: %v", err)
		return
	}
	size := len(b)
	if size > MaxSpecBytes {
		msg := fmt.Sprintf("the pipeline is %d bytes as JSON (%s), over the limit of %s: it travels whole as workflow input, and Temporal refuses a payload over 2 MiB",
			size, bytesText(size), bytesText(MaxSpecBytes))
		if at := l.largestPart(); at != nil {
			l.errPath(at.path, "%s; this value is %s of it", msg, bytesText(at.size))
			return
		}
		l.errAt(1, 1, "", "%s", msg)
		return
	}
	every := l.p.Loop.ContinueAsNewEvery
	if every <= 0 {
		every = DefaultContinueAsNewEvery
	}
	if copies := every + SpecStartCopies; size*copies > MaxRunSpecBytes {
		l.errPath("loop.continue_as_new_every",
			"a workflow run's history holds the pipeline (%d bytes as JSON) once per iteration and %d times at its start (its input, and the input and result of its validation): %d copies, %s, over the %s allowed, for Temporal ends a run whose history passes 50 MiB; set continue_as_new_every (now %d) to at most %d, or make the pipeline smaller",
			size, SpecStartCopies, copies, bytesText(size*copies), bytesText(MaxRunSpecBytes), every, MaxRunSpecBytes/size-SpecStartCopies)
	}
}

// bytesText writes a byte count for messages: "1.6 MiB", "720.5 KiB".
func bytesText(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes", n)
}

// part is a value of the spec with its JSON size, for naming the largest.
type part struct {
	path string
	size int
	kids []*part
}

// largestPart finds the value that makes the spec large: starting from the
// largest free-form value (a step's argument or condition, a param's
// default, the description), it descends while one child holds at least
// half of its parent, so that a huge string inside a list is named rather
// than the list. It is nil when the free-form values are not the bulk.
func (l *loader) largestPart() *part {
	p := l.p
	var top []*part
	add := func(path string, v any) {
		if v != nil {
			top = append(top, measurePart(path, v))
		}
	}
	if p.Description != "" {
		add("description", p.Description)
	}
	for _, prm := range p.Params {
		add(joinPath("params", prm.Name)+".default", prm.Default)
		if prm.Description != "" {
			add(joinPath("params", prm.Name)+".description", prm.Description)
		}
	}
	for i, s := range p.Steps {
		path := indexPath("steps", i)
		if s.When != "" {
			add(path+".when", s.When)
		}
		for _, k := range sortedKeys(s.With) {
			add(joinPath(path+".with", k), s.With[k])
		}
	}
	var best *part
	for _, c := range top {
		if best == nil || c.size > best.size {
			best = c
		}
	}
	if best == nil || best.size < MaxSpecBytes/4 {
		return nil
	}
	for {
		var kid *part
		for _, c := range best.kids {
			if kid == nil || c.size > kid.size {
				kid = c
			}
		}
		if kid == nil || 2*kid.size < best.size {
			return best
		}
		best = kid
	}
}

// measurePart sizes v as encoding/json writes it. Scalars are encoded one
// by one; containers add their punctuation, so the sizes add up exactly.
func measurePart(path string, v any) *part {
	pt := &part{path: path}
	switch x := v.(type) {
	case map[string]any:
		pt.size = 2 + max(len(x)-1, 0) // {}, commas
		for _, k := range sortedKeys(x) {
			kb, _ := json.Marshal(k)
			c := measurePart(joinPath(path, k), x[k])
			pt.kids = append(pt.kids, c)
			pt.size += len(kb) + 1 + c.size
		}
	case []any:
		pt.size = 2 + max(len(x)-1, 0)
		for i, e := range x {
			c := measurePart(indexPath(path, i), e)
			pt.kids = append(pt.kids, c)
			pt.size += c.size
		}
	default:
		b, _ := json.Marshal(x)
		pt.size = len(b)
	}
	return pt
}
