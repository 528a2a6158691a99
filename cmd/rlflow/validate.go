package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/spf13/cobra"
)

func newValidateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "validate FILE...",
		Short: "Check pipeline files; print every error as file:line:col: field: message",
		Long: `Validate loads each pipeline file and runs every static check (schema, step
arguments, DAG, expression references, size). Errors go to stderr, one per
line, sorted; nothing is printed on stdout. The exit status is 1 if any file
has an error, 130 if SIGINT or SIGTERM stopped it. Only regular files are
read: a FIFO, device or directory is an error, not a wait.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return validateFiles(cmd.Context(), args, cmd.ErrOrStderr(), loadPipelineFile)
		},
	}
}

func loadPipelineFile(path string) error {
	_, err := pipelines.LoadFile(path)
	return err
}

// validateFiles loads each file with load, printing each one's errors to
// w. It returns as soon as ctx ends (main cancels it on SIGINT and
// SIGTERM) even while a load is stuck, in a read from a hung network
// mount say: that load's goroutine is left to the process's exit.
func validateFiles(ctx context.Context, files []string, w io.Writer, load func(string) error) error {
	bad := 0
	for _, f := range files {
		done := make(chan error, 1)
		go func() { done <- load(f) }()
		select {
		case <-ctx.Done():
			return &exitError{code: 130, err: fmt.Errorf("validate interrupted while reading %s", f)}
		case err := <-done:
			if err != nil {
				bad++
				fmt.Fprintln(w, strings.TrimRight(err.Error(), "\n"))
			}
		}
	}
	if bad > 0 {
		return &exitError{code: 1, err: fmt.Errorf("%d of %d file(s) invalid", bad, len(files))}
	}
	return nil
}

func newGraphCmd() *cobra.Command {
	var format string
	cmd := &cobra.Command{
		Use:   "graph FILE",
		Short: "Print a pipeline's step DAG as Mermaid or Graphviz DOT",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := pipelines.LoadFile(args[0])
			if err != nil {
				return &exitError{code: 1, err: err}
			}
			switch format {
			case "mermaid":
				fmt.Fprint(cmd.OutOrStdout(), runs.Mermaid(p))
			case "dot":
				fmt.Fprint(cmd.OutOrStdout(), runs.DOT(p))
			default:
				return &exitError{code: 2, err: fmt.Errorf("--format: want mermaid or dot, got %q", format)}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&format, "format", "mermaid", "mermaid or dot")
	return cmd
}

func newSchemaCmd() *cobra.Command {
	var reference bool
	cmd := &cobra.Command{
		Use:   "schema",
		Short: "Print the pipeline JSON Schema (for editors) or, with --reference, the YAML reference",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if reference {
				fmt.Fprint(cmd.OutOrStdout(), pipelines.Reference())
				return nil
			}
			b, err := pipelines.JSONSchema()
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), string(b))
			return nil
		},
	}
	cmd.Flags().BoolVar(&reference, "reference", false, "print the Markdown YAML reference instead")
	return cmd
}
