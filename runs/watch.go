package runs

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/rlflow/rlflow/workflows"
	"github.com/schollz/progressbar/v3"
	"go.temporal.io/sdk/client"
)

// WatchOptions control Watch's output.
type WatchOptions struct {
	Out io.Writer
	// Bar, when non-nil, receives an iteration progress bar (a terminal).
	Bar io.Writer
	// Total is the number of iterations expected (0 = unknown, for until).
	Total    int
	Interval time.Duration
	// Address is the Temporal frontend's host:port, named in the lines
	// that report an outage.
	Address string
	// OnIteration, when set, is called once per successful iteration, in
	// order, with the iteration's result (every step's outputs) as soon as
	// the watch sees it done.
	OnIteration func(workflows.IterationResult)
}

// Watch prints step transitions of a run as they happen and returns the
// run's result once it closes. It follows continue-as-new. It waits out
// Temporal outages of any length, saying when one starts and ends: only
// the run's outcome, an error the server answers, or ctx ending stop it.
func Watch(ctx context.Context, c client.Client, run client.WorkflowRun, o WatchOptions) (*workflows.PipelineResult, error) {
	if o.Interval <= 0 {
		o.Interval = 300 * time.Millisecond
	}
	var bar *progressbar.ProgressBar
	if o.Bar != nil {
		total := o.Total
		if total <= 0 {
			total = -1
		}
		bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(o.Bar), progressbar.OptionSetDescription("iterations"),
			progressbar.OptionShowCount(), progressbar.OptionClearOnFinish())
	}
	var sayMu sync.Mutex // the run's Get waits out outages on its own goroutine
	say := func(format string, args ...any) {
		sayMu.Lock()
		defer sayMu.Unlock()
		if bar != nil {
			_ = bar.Clear()
		}
		fmt.Fprintf(o.Out, format+"\n", args...)
		if bar != nil {
			_ = bar.RenderBlank()
		}
	}
	out := newOutages(o.Address, func(line string) { say("%s", line) })
	done := make(chan struct{})
	var res workflows.PipelineResult
	var runErr error
	go func() {
		// Get long-polls the history (65s per call) and follows
		// continue-as-new from the latest run it saw, so repeating it
		// after an outage loses nothing.
		runErr = out.do(ctx, func(ctx context.Context) error { return run.Get(ctx, &res) })
		close(done)
	}()
	seen := map[string]string{}
	lastIter, lastDone, reported := 0, 0, 0
	// show prints a step's line when its state changed since the last one.
	show := func(iter int, s workflows.StepResult, lastFailure string) {
		key := fmt.Sprintf("%d/%s", iter, s.ID)
		state := s.Status
		if s.Status == workflows.StatusRunning && s.Attempts > 1 {
			state = fmt.Sprintf("running (attempt %d)", s.Attempts)
		}
		if seen[key] == state {
			return
		}
		seen[key] = state
		line := fmt.Sprintf("  %-14s %-10s %s", s.ID, s.Uses, state)
		switch {
		case lastFailure != "" && s.Status == workflows.StatusRunning:
			line += "  last failure: " + firstLine(lastFailure)
		case s.Status == workflows.StatusFailed:
			line += "  " + firstLine(s.Error)
		case s.Status == workflows.StatusSkipped:
			line += "  (" + s.Reason + ")"
		case s.Status == workflows.StatusSucceeded:
			if outs := formatOutputs(s.Outputs); outs != "" {
				line += "  " + truncate(outs, 120)
			}
		}
		say("%s", line)
	}
	// report finishes every iteration up to done: the final states of its
	// steps that no poll saw (the next iteration starts within
	// milliseconds), then OnIteration. A finished iteration's child
	// workflow answers Get at once.
	report := func(done int) {
		for ; reported < done; reported++ {
			var ir workflows.IterationResult
			id := workflows.IterationWorkflowID(run.GetID(), reported+1)
			if err := out.do(ctx, func(ctx context.Context) error { return c.GetWorkflow(ctx, id, "").Get(ctx, &ir) }); err != nil {
				if ctx.Err() != nil {
					return
				}
				say("  (iteration %d result unavailable: %v)", reported+1, err)
				continue
			}
			for _, s := range ir.Steps {
				show(ir.Iteration, s, "")
			}
			if o.OnIteration == nil {
				continue
			}
			if bar != nil {
				_ = bar.Clear()
			}
			o.OnIteration(ir)
			if bar != nil {
				_ = bar.RenderBlank()
			}
		}
	}
	t := time.NewTicker(o.Interval)
	defer t.Stop()
	poll := func() {
		st, err := getStatus(ctx, c, run.GetID(), "", out.do)
		if err != nil || st.ProgressErr != "" {
			return
		}
		p := st.Progress
		report(p.IterationsDone) // before the next iteration's header
		if p.Iteration != lastIter && p.Iteration > 0 {
			lastIter = p.Iteration
			say("iteration %d  (%s)", p.Iteration, p.Child)
		}
		if p.IterationsDone != lastDone {
			lastDone = p.IterationsDone
			if bar != nil {
				sayMu.Lock()
				_ = bar.Set(lastDone)
				sayMu.Unlock()
			}
		}
		for _, s := range st.Steps {
			show(p.Iteration, s.StepResult, s.LastFailure)
		}
	}
	for {
		select {
		case <-done:
			poll()
			if bar != nil {
				_ = bar.Finish()
			}
			if runErr != nil {
				return nil, runErr
			}
			report(res.Iterations)
			return &res, nil
		case <-t.C:
			poll()
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}
