package runs

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"

	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/client"
)

// iterationFetchers bounds the iteration results read at once.
const iterationFetchers = 8

// FillIterations sets st.Iterations to the outputs of the last `last`
// finished iterations (every one when last <= 0), oldest first. The parent
// workflow keeps only workflows.RecentIterations summaries, so each is read
// from its iteration workflow's result instead: one history read of a
// closed workflow's last event per iteration. Iterations whose results are
// gone (past the namespace's retention) or unreadable are named in
// st.IterationsErr; the others are still listed.
func FillIterations(ctx context.Context, c client.Client, st *RunStatus, last int) {
	done := st.Progress.IterationsDone
	first := 1
	if last > 0 && done-last+1 > first {
		first = done - last + 1
	}
	if done < first {
		return
	}
	sums := make([]workflows.IterationSummary, done-first+1)
	failed := map[int]error{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, iterationFetchers)
	for n := first; n <= done; n++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(n int) {
			defer func() { <-sem; wg.Done() }()
			id := workflows.IterationWorkflowID(st.WorkflowID, n)
			var ir workflows.IterationResult
			err := c.GetWorkflow(ctx, id, "").Get(ctx, &ir)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed[n] = err
				return
			}
			sums[n-first] = summarize(id, ir)
		}(n)
	}
	wg.Wait()
	st.Iterations = st.Iterations[:0]
	for _, s := range sums {
		if s.WorkflowID != "" {
			st.Iterations = append(st.Iterations, s)
		}
	}
	if len(failed) > 0 {
		ns := make([]int, 0, len(failed))
		for n := range failed {
			ns = append(ns, n)
		}
		sort.Ints(ns)
		names := make([]string, len(ns))
		for i, n := range ns {
			names[i] = fmt.Sprint(n)
		}
		st.IterationsErr = fmt.Sprintf("results of iteration(s) %s unavailable: %s", strings.Join(names, ", "), ExplainError(failed[ns[0]]).Sentence)
	}
}

// summarize is what the parent workflow keeps of an iteration (see
// workflows.pipelineRun.record): its succeeded steps' outputs.
func summarize(id string, ir workflows.IterationResult) workflows.IterationSummary {
	s := workflows.IterationSummary{Iteration: ir.Iteration, WorkflowID: id, Status: workflows.StatusSucceeded, Outputs: map[string]map[string]any{}}
	for _, st := range ir.Steps {
		if st.Status == workflows.StatusSucceeded && len(st.Outputs) > 0 {
			s.Outputs[st.ID] = st.Outputs
		}
	}
	return s
}
