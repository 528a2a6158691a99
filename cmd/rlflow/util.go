package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"

	"github.com/rlflow/rlflow/runs"
	"github.com/spf13/cobra"
	"go.temporal.io/sdk/client"
)

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// withClient connects to the Temporal frontend, runs fn and closes the
// connection.
func (g *globalFlags) withClient(ctx context.Context, fn func(client.Client) error) error {
	c, err := runs.Connect(ctx, g.address, g.namespace)
	if err != nil {
		return err
	}
	defer c.Close()
	return fn(c)
}

// idCommand builds a command that takes one id, calls act with a connected
// client, and prints done on success; act's error exits with status 1.
func idCommand(g *globalFlags, use, short string, act func(ctx context.Context, c client.Client, id string) error, done string) *cobra.Command {
	return &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.withClient(cmd.Context(), func(c client.Client) error {
				if err := act(cmd.Context(), c, args[0]); err != nil {
					return &exitError{code: 1, err: err}
				}
				fmt.Fprintf(cmd.OutOrStdout(), done+"\n", args[0])
				return nil
			})
		},
	}
}
