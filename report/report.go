// Package report turns a pipeline run's Temporal history into a report a
// person reads: one chart per per-iteration metric, the step durations of
// every iteration, failures and retries marked, and the numbers in tables.
//
// Collect reads a run from Temporal's history only (never a query), so it
// works on closed runs and needs no worker: every run of the run's
// continue-as-new chain, every iteration's child workflow, its result or,
// for an iteration that did not complete, its activities. Rendering works on
// the plain Run it returns, so it is tested on fixed data.
//
// Invariants: a metric is a numeric output of a step ("eval.score" is the
// output score of step eval), one value per iteration; iterations are in
// order, each once; an HTML report is one self-contained file (charts are
// inline SVG, styles inline, nothing fetched when it is viewed).
package report

import (
	"cmp"
	"slices"
	"sort"
	"strings"
	"time"
)

// Run is a pipeline run as the report shows it.
type Run struct {
	// WorkflowID is the pipeline run's workflow id, the same across its
	// continue-as-new chain.
	WorkflowID string
	Pipeline   string
	// Status is Temporal's status of the chain's last run: Running,
	// Completed, Failed, Canceled, Terminated, TimedOut.
	Status string
	// Error is the last run's failure message, when it failed.
	Error string
	// RunIDs lists the chain's runs, first to last.
	RunIDs     []string
	Iterations []Iteration
}

// Iteration is one iteration's child workflow.
type Iteration struct {
	Number     int
	WorkflowID string
	RunID      string
	// Status is the iteration's outcome: the workflows package's
	// succeeded, failed, cancelled or running, or terminated, timed_out.
	Status string
	Error  string
	// Start and End bound the child workflow; End is zero while it runs.
	Start, End time.Time
	// Steps are in the pipeline file's order.
	Steps []Step
}

// Step is one step of an iteration.
type Step struct {
	ID, Uses string
	Status   string
	// Attempts is the attempt that produced the step's final state
	// (1 = no retry); 0 when it never ran.
	Attempts int
	// Executions counts the activities run for the step: more than one
	// when the interpreter ran it again (a GPU worker lost, a server found
	// on stale weights).
	Executions int
	Error      string
	// Metrics are the step's numeric outputs.
	Metrics map[string]float64
	// Scheduled is when the step's first activity was scheduled, Started
	// when its first attempt began, Closed when its last activity ended;
	// zero when that did not happen.
	Scheduled, Started, Closed time.Time
}

// Duration is the step's time from scheduling to its end, queueing and
// retries included; zero for a step that did not finish.
func (s Step) Duration() time.Duration {
	if s.Scheduled.IsZero() || s.Closed.IsZero() {
		return 0
	}
	return s.Closed.Sub(s.Scheduled)
}

// QueueWait is the time the step's first attempt waited for a worker.
func (s Step) QueueWait() time.Duration {
	if s.Scheduled.IsZero() || s.Started.IsZero() {
		return 0
	}
	return s.Started.Sub(s.Scheduled)
}

// Retried reports whether the step took more than one attempt.
func (s Step) Retried() bool { return s.Attempts > 1 || s.Executions > 1 }

// Metric is an iteration's value of a metric ("step.output").
func (it Iteration) Metric(name string) (float64, bool) {
	step, key, ok := strings.Cut(name, ".")
	if !ok {
		return 0, false
	}
	for _, s := range it.Steps {
		if s.ID == step {
			v, ok := s.Metrics[key]
			return v, ok
		}
	}
	return 0, false
}

// Retried reports whether any step of the iteration was retried.
func (it Iteration) Retried() bool {
	return slices.ContainsFunc(it.Steps, Step.Retried)
}

// Duration is the iteration's wall time; zero while it runs.
func (it Iteration) Duration() time.Duration {
	if it.Start.IsZero() || it.End.IsZero() {
		return 0
	}
	return it.End.Sub(it.Start)
}

// Metrics lists every metric some iteration has, ordered by the step's
// place in the pipeline, then by output name.
func (r *Run) Metrics() []string {
	type key struct {
		step   int
		name   string
		output string
	}
	seen := map[string]key{}
	for _, it := range r.Iterations {
		for i, s := range it.Steps {
			for out := range s.Metrics {
				name := s.ID + "." + out
				if k, ok := seen[name]; !ok || i < k.step {
					seen[name] = key{step: i, name: name, output: out}
				}
			}
		}
	}
	keys := make([]key, 0, len(seen))
	for _, k := range seen {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(a, b int) bool {
		return cmp.Or(cmp.Compare(keys[a].step, keys[b].step), cmp.Compare(keys[a].name, keys[b].name)) < 0
	})
	names := make([]string, len(keys))
	for i, k := range keys {
		names[i] = k.name
	}
	return names
}

// StepIDs lists the step ids of all iterations, in the pipeline's order.
func (r *Run) StepIDs() []string {
	var ids []string
	for _, it := range r.Iterations {
		for _, s := range it.Steps {
			if !slices.Contains(ids, s.ID) {
				ids = append(ids, s.ID)
			}
		}
	}
	return ids
}
