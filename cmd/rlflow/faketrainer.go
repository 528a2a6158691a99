package main

import (
	"os"

	"github.com/rlflow/rlflow/trainer/trainertest"
	"github.com/spf13/cobra"
)

// newFakeTrainerCmd is the resident trainer TEST DOUBLE as a command, for
// the e2e tests' pipelines (trainer: {command: [rlflow, fake-trainer]}).
func newFakeTrainerCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "fake-trainer",
		Short:  "TEST DOUBLE of a resident trainer (trainer/PROTOCOL.md over fds 3 and 4); for rlflow's CPU tests only",
		Hidden: true,
		// Its flags and knobs are RLFLOW_FAKE_TRAINER_* variables.
		DisableFlagParsing: true,
		Run: func(*cobra.Command, []string) {
			os.Exit(trainertest.Main())
		},
	}
}
