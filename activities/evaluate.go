package activities

import (
	"context"
	"encoding/json"

	"github.com/rlflow/rlflow/pipelines"
)

// EvaluateInput is the `with` of an evaluate step: generate's arguments
// over an eval set (every line has an "answer") plus the scorer.
type EvaluateInput struct {
	GenerateInput
	Scorer json.RawMessage `json:"scorer"`
}

// EvaluateOutput is an evaluate step's outputs; the numbers are plain JSON
// numbers, usable in when and until expressions.
type EvaluateOutput struct {
	Score   float64 `json:"score"` // mean over every sample
	Samples int     `json:"samples"`
	// Path is the per-sample JSONL: Rollout rows with answer and score.
	Path          string  `json:"path"`
	Min           float64 `json:"min"`
	Max           float64 `json:"max"`
	WeightVersion string  `json:"weight_version"`
	// WeightCheck is the signal the servers' weights were checked with, as
	// GenerateOutput's.
	WeightCheck string `json:"weight_check"`
	// Unparsed counts the judge's replies without a usable number (each
	// scored 0); always 0 for the other scorers.
	Unparsed int `json:"unparsed"`
	Resumed  int `json:"resumed"`
	// VLLM is what the step learned of each server (metadata).
	VLLM    []pipelines.VLLMServer `json:"_vllm,omitempty"`
	Attempt int                    `json:"_attempt"`
}

// Evaluate generates from the eval set through the same path as Generate
// (bounded pool over every server, resumable, atomic output) and scores
// each sample as it arrives, so a retried attempt resumes scoring too.
func (a *Activities) Evaluate(ctx context.Context, in EvaluateInput) (*EvaluateOutput, error) {
	if err := resolveArgs(ctx, pipelines.StepEvaluate, &in); err != nil {
		return nil, err
	}
	spec, err := pipelines.ParseScorer(in.Scorer)
	if err != nil {
		return nil, badInput(ctx, "evaluate: %v", err)
	}
	run, err := a.newGenRun(ctx, pipelines.StepEvaluate, &in.GenerateInput, "scores.jsonl", true, in.Scorer)
	if err != nil {
		return nil, err
	}
	if run.score, err = a.newScorer(ctx, run, spec); err != nil {
		return nil, err
	}
	res, err := run.run(ctx)
	if err != nil {
		return nil, err
	}
	out := &EvaluateOutput{Samples: res.samples, Path: res.path, Min: res.minS, Max: res.maxS,
		WeightVersion: res.weightVersion, WeightCheck: res.weightCheck, Unparsed: res.unparsed, Resumed: res.resumed,
		VLLM: describeServers(ctx, run.fleet), Attempt: attemptOf(ctx)}
	if res.scored > 0 {
		out.Score = res.scoreSum / float64(res.scored)
	}
	return out, nil
}
