package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/rlflow/rlflow/runs"
	"github.com/spf13/cobra"
	"go.temporal.io/sdk/client"
)

// exitRunUnsuccessful is the exit status of the commands that follow or
// show a run (run --wait, status, dev --exit) when they cannot say it
// succeeded or runs: it failed, was cancelled, terminated or timed out,
// Ctrl-C stopped following it, or Temporal answered an error; the message
// says which. 0 means it succeeded (or, for status, runs).
const exitRunUnsuccessful = 1

// errShown is an exitError's error when the command already printed why
// it exits non-zero (status prints the run's failure on stdout).
var errShown = errors.New("")

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// connectionAnnotation marks a command that reaches its Temporal server
// otherwise than through Temporal's client configuration.
const connectionAnnotation = "rlflow/connection"

// localConnection marks cmd as one that talks to a local dev server
// (rlflow dev): plaintext, at --address, else TEMPORAL_ADDRESS, else the
// default, and --namespace likewise; a profile (often a cloud cluster's)
// is not read.
func localConnection(cmd *cobra.Command) *cobra.Command {
	if cmd.Annotations == nil {
		cmd.Annotations = map[string]string{}
	}
	cmd.Annotations[connectionAnnotation] = "local"
	return cmd
}

// resolveConnection replaces the --address and --namespace flags with the
// connection cmd uses, once the flags are parsed: the flags over
// Temporal's client configuration (TEMPORAL_* over the --profile of the
// --config-file), as the Temporal CLI reads it. Its error waits in connErr
// for a command that connects: validate does not fail on a broken
// Temporal config file.
func (g *globalFlags) resolveConnection(cmd *cobra.Command) {
	if cmd.Annotations[connectionAnnotation] == "local" {
		g.address = cmp.Or(g.address, os.Getenv("TEMPORAL_ADDRESS"), runs.DefaultAddress)
		g.namespace = cmp.Or(g.namespace, os.Getenv("TEMPORAL_NAMESPACE"), runs.DefaultNamespace)
		return
	}
	t, err := runs.Resolve(runs.Settings{Address: g.address, Namespace: g.namespace, ConfigFile: g.configFile, Profile: g.profile})
	if err != nil {
		g.connErr = err
		return
	}
	g.address, g.namespace, g.security = t.Address, t.Namespace, t.Security
}

// target is the resolved connection, or why there is none.
func (g *globalFlags) target() (runs.Target, error) {
	if g.connErr != nil {
		return runs.Target{}, g.connErr
	}
	return runs.Target{Address: g.address, Namespace: g.namespace, Security: g.security}, nil
}

// withClient connects to the Temporal frontend, runs fn and closes the
// connection.
func (g *globalFlags) withClient(ctx context.Context, fn func(client.Client) error) error {
	t, err := g.target()
	if err != nil {
		return err
	}
	c, err := runs.ConnectTarget(ctx, t)
	if err != nil {
		return err
	}
	defer c.Close()
	return fn(c)
}

// dial is runs.Dial to the resolved connection; o's address, namespace
// and security are set here.
func (g *globalFlags) dial(ctx context.Context, o runs.DialOptions) (client.Client, error) {
	t, err := g.target()
	if err != nil {
		return nil, err
	}
	o.Address, o.Namespace, o.Security = t.Address, t.Namespace, t.Security
	return runs.Dial(ctx, o)
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
