package main

import (
	"fmt"
	"os"
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
arguments, DAG, expression references). Errors go to stderr, one per line,
sorted; nothing is printed on stdout. The exit status is 1 if any file has an
error.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			bad := 0
			for _, f := range args {
				if _, err := pipelines.LoadFile(f); err != nil {
					bad++
					fmt.Fprintln(os.Stderr, strings.TrimRight(err.Error(), "\n"))
				}
			}
			if bad > 0 {
				return &exitError{code: 1, err: fmt.Errorf("%d of %d file(s) invalid", bad, len(args))}
			}
			return nil
		},
	}
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
