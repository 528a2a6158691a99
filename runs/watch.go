package runs

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/rlflow/rlflow/workflows"
	"github.com/schollz/progressbar/v3"
	enumspb "go.temporal.io/api/enums/v1"
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
	// NoWorkerAfter is how long the run may go without a worker on its
	// task queue before Watch says so (once; it keeps waiting). 0 means
	// DefaultNoWorkerAfter.
	NoWorkerAfter time.Duration
}

// DefaultNoWorkerAfter is WatchOptions.NoWorkerAfter's default: long
// enough for a worker started with the run to poll, short enough that a
// user does not stare at a silent terminal.
const DefaultNoWorkerAfter = 5 * time.Second

// Watch prints step transitions of a run as they happen and returns the
// run's result once it closes. It follows continue-as-new. It waits out
// Temporal outages of any length, saying when one starts and ends: only
// the run's outcome, an error the server answers, or ctx ending stop it.
// Every iteration gets its header, then its steps' final lines, in order,
// however fast iterations pass; outputs are printed whole. A run that did
// not succeed is a *RunError. When no worker polls the run's task queue
// after NoWorkerAfter, it says so once.
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
			progressbar.OptionShowCount())
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
	stopWorkerCheck := make(chan struct{})
	defer close(stopWorkerCheck)
	after := o.NoWorkerAfter
	if after <= 0 {
		after = DefaultNoWorkerAfter
	}
	go reportNoWorker(ctx, c, run.GetID(), after, stopWorkerCheck, func(line string) { say("%s", line) })
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
	headed, reported := 0, 0
	// header prints iteration n's header once, after every earlier one.
	header := func(n int) {
		for ; headed < n; headed++ {
			say("iteration %d  (%s)", headed+1, workflows.IterationWorkflowID(run.GetID(), headed+1))
		}
	}
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
			line += "  last failure: " + splitMessage(lastFailure).Sentence
		case s.Status == workflows.StatusFailed:
			line += "  " + splitMessage(s.Error).Sentence
		case s.Status == workflows.StatusSkipped:
			line += "  (" + s.Reason + ")"
		case s.Status == workflows.StatusSucceeded:
			if outs := formatOutputs(s.Outputs); outs != "" {
				line += "  " + outs
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
				header(reported + 1)
				say("  (iteration %d result unavailable: %s)", reported+1, ExplainError(err).Sentence)
				continue
			}
			header(ir.Iteration)
			for _, s := range ir.Steps {
				show(ir.Iteration, s, "")
			}
			if bar != nil {
				sayMu.Lock()
				_ = bar.Set(reported + 1)
				sayMu.Unlock()
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
	// poll prints what changed and returns the status it saw (nil when
	// none).
	poll := func() *RunStatus {
		st, err := getStatus(ctx, c, run.GetID(), "", out.do)
		if err != nil {
			return nil
		}
		if st.ProgressErr != "" {
			return st
		}
		p := st.Progress
		// Iterations run one at a time: every one before the running one
		// is done, even when IterationsDone (reset by continue-as-new)
		// does not say so yet. Their lines come before the next header.
		report(max(p.IterationsDone, p.Iteration-1))
		if p.Iteration > 0 {
			header(p.Iteration)
		}
		for _, s := range st.Steps {
			show(p.Iteration, s.StepResult, s.LastFailure)
		}
		return st
	}
	for {
		select {
		case <-done:
			st := poll()
			if runErr != nil {
				endBar(bar, o.Bar, &sayMu, 0)
				if ctx.Err() != nil {
					return nil, runErr
				}
				return nil, &RunError{WorkflowID: run.GetID(), Failure: runFailure(st, runErr), Err: runErr}
			}
			report(res.Iterations)
			endBar(bar, o.Bar, &sayMu, res.Iterations)
			return &res, nil
		case <-t.C:
			poll()
		case <-ctx.Done():
			endBar(bar, o.Bar, &sayMu, 0)
			return nil, ctx.Err()
		}
	}
}

// endBar leaves the bar on its own line: full at done iterations when the
// run succeeded (an until loop stops short of its max_iterations, and the
// bar's total becomes what ran), as it was otherwise.
func endBar(bar *progressbar.ProgressBar, w io.Writer, mu *sync.Mutex, done int) {
	if bar == nil {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	if done > 0 {
		bar.ChangeMax(done)
		_ = bar.Set(done)
	}
	_ = bar.Exit()
	fmt.Fprintln(w)
}

// reportNoWorker says once, after `after`, that no worker polls the run's
// task queue, if none does while the run is still open; it checks again
// every `after` until Temporal answers, and gives up once stop closes.
// Temporal lists a queue's pollers of the last minutes, so a worker that
// just stopped still counts.
func reportNoWorker(ctx context.Context, c client.Client, id string, after time.Duration, stop <-chan struct{}, say func(string)) {
	t := time.NewTimer(after)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-stop:
			return
		case <-ctx.Done():
			return
		}
		d, err := c.DescribeWorkflow(ctx, id, "")
		if err == nil {
			info := d.RawResponse.GetWorkflowExecutionInfo()
			if info.GetStatus() != enumspb.WORKFLOW_EXECUTION_STATUS_RUNNING {
				return
			}
			queue := d.RawResponse.GetExecutionConfig().GetTaskQueue().GetName()
			if queue == "" {
				queue = info.GetTaskQueue()
			}
			tq, err := c.DescribeTaskQueue(ctx, queue, enumspb.TASK_QUEUE_TYPE_WORKFLOW)
			if err == nil {
				if len(tq.GetPollers()) == 0 {
					say(NoWorkerMessage(queue))
				}
				return
			}
		}
		t.Reset(after)
	}
}

// NoWorkerMessage is what Watch says of a task queue no worker polls.
func NoWorkerMessage(queue string) string {
	return fmt.Sprintf("no worker is polling task queue %s; start one with `rlflow worker --task-queue %s`", queue, queue)
}
