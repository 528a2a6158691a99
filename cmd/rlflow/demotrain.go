package main

import (
	"fmt"
	"os"

	"github.com/rlflow/rlflow/vllm/double/demotrain"
	"github.com/spf13/cobra"
)

func newDemoTrainCmd() *cobra.Command {
	var f demotrain.Files
	var o demotrain.Options
	cmd := &cobra.Command{
		Use:   "demo-train",
		Short: "DEMO TRAINER: one learning step for the vLLM double's bigram model (for the demo pipeline)",
		Long: `demo-train is the DEMO TRAINER shipped with rlflow, run by an exec step of
pipelines/examples/rlhf-demo.yaml. It is not a trainer for real models: it
updates the character bigram table that the vLLM test double serves.

One step: every rollout (a generate step's JSONL; each row carries its prompt) is scored against the
corpus' bigram statistics; the logits move by --lr toward the corpus' bigram
log-frequencies and along the reward-weighted log-likelihood gradient of the
rollouts. The result is written atomically to OUT/model.safetensors, and
checkpoint=<absolute OUT>, loss=..., reward=... are appended to
$RLFLOW_OUTPUTS when it is set. The step is deterministic given its inputs.

--init is a bigram checkpoint (file or directory) or random:SEED, the
untrained model the double serves when started without --model.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, dir, err := demotrain.Run(f, o)
			if err != nil {
				return &exitError{code: 1, err: fmt.Errorf("demo-train: %w", err)}
			}
			fmt.Fprintf(cmd.OutOrStdout(), "demo-train: %d rollouts, mean reward %.3f; corpus loss %.3f -> %.3f nats/char; wrote %s\n",
				res.Rollouts, res.MeanReward, res.LossBefore, res.LossAfter, dir)
			if out := os.Getenv("RLFLOW_OUTPUTS"); out != "" {
				if err := appendOutputs(out, fmt.Sprintf("checkpoint=%s\nloss=%.6f\nloss_before=%.6f\nreward=%.6f\n",
					dir, res.LossAfter, res.LossBefore, res.MeanReward)); err != nil {
					return &exitError{code: 1, err: fmt.Errorf("demo-train: %w", err)}
				}
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.Rollouts, "rollouts", "", "rollouts JSONL written by a generate step (required)")
	fl.StringVar(&f.Prompts, "prompts", "", "the prompts JSONL the rollouts came from, for rows without their own \"prompt\" (optional)")
	fl.StringVar(&f.Init, "init", "", "checkpoint to start from, or random:SEED (required)")
	fl.StringVar(&f.Corpus, "corpus", "", "text corpus, one text per line (required)")
	fl.StringVar(&f.Out, "out", "", "checkpoint directory to write (required)")
	fl.Float64Var(&o.LR, "lr", demotrain.DefaultLR, "learning rate, 0 < lr <= 1")
	fl.Float64Var(&o.RewardWeight, "reward-weight", demotrain.DefaultRewardWeight, "weight of the rollouts' reward term against the corpus term (0 = off)")
	for _, name := range []string{"rollouts", "init", "corpus", "out"} {
		_ = cmd.MarkFlagRequired(name)
	}
	return cmd
}

func appendOutputs(path, lines string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("outputs: %w", err)
	}
	if _, err := f.WriteString(lines); err != nil {
		f.Close()
		return fmt.Errorf("outputs %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("outputs %s: %w", path, err)
	}
	return nil
}
