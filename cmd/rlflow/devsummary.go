package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm/double/demotrain"
	"github.com/rlflow/rlflow/workflows"
)

// demoSummary prints, after each iteration of a dev run, one sample of each
// generate step (the demo's before/after text) and each evaluate step's
// score, and at the end the scores of every iteration.
type demoSummary struct {
	out    io.Writer
	scores []string
}

// samplesShown is how many samples of a generate step the summary prints.
const samplesShown = 2

func (d *demoSummary) iteration(ir workflows.IterationResult) {
	var lines []string
	for _, s := range ir.Steps {
		if s.Status != workflows.StatusSucceeded {
			continue
		}
		switch s.Uses {
		case pipelines.StepGenerate:
			for _, line := range d.samples(s) {
				lines = append(lines, fmt.Sprintf("  %-8s %s", s.ID, line))
			}
		case pipelines.StepEvaluate:
			score := fmt.Sprint(s.Outputs["score"])
			lines = append(lines, fmt.Sprintf("  %-8s score %s (%v samples)", s.ID, score, s.Outputs["samples"]))
			d.scores = append(d.scores, fmt.Sprintf("%d: %s", ir.Iteration, score))
		}
	}
	if len(lines) > 0 { // pipelines without generate or evaluate steps show nothing
		fmt.Fprintf(d.out, "── iteration %d ──\n%s\n", ir.Iteration, strings.Join(lines, "\n"))
	}
}

// samples reads one rollout of each of the first prompts of a generate step (each row carries
// its prompt); a problem is shown in place of the samples.
func (d *demoSummary) samples(s workflows.StepResult) []string {
	path, _ := s.Outputs["path"].(string)
	if path == "" {
		return nil
	}
	rs, err := demotrain.ReadRollouts(path, nil)
	if err != nil {
		return []string{fmt.Sprintf("(samples unavailable: %v)", err)}
	}
	var out []string
	seen := map[string]bool{}
	for _, r := range rs { // the first sample of the first prompts (the file is in prompt order)
		if len(out) == samplesShown {
			break
		}
		if !seen[r.Prompt] {
			seen[r.Prompt] = true
			out = append(out, fmt.Sprintf("%q -> %q", r.Prompt, r.Text))
		}
	}
	return out
}

func (d *demoSummary) finish() {
	if len(d.scores) > 0 {
		fmt.Fprintf(d.out, "eval score by iteration: %s\n", strings.Join(d.scores, ", "))
	}
}
