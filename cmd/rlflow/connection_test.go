package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/runs"
	"github.com/spf13/cobra"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cleanTemporalEnv unsets every TEMPORAL_* variable for the test and
// points the Temporal CLI's default config file into an empty directory.
func cleanTemporalEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "TEMPORAL_") {
			t.Setenv(k, "") // restored after the test
			os.Unsetenv(k)
		}
	}
	dir := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", dir)
	t.Setenv("HOME", dir)
}

func TestResolveConnection(t *testing.T) {
	cleanTemporalEnv(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "temporal.toml")
	require.NoError(t, os.WriteFile(file, []byte(`
[profile.default]
address = "profile-default:7233"

[profile.cloud]
address = "cloud.example:7233"
namespace = "cloud-ns"
api_key = "sk-profile-secret"
`), 0o600))
	for _, tc := range []struct {
		name               string
		flags              globalFlags
		env                map[string]string
		local              bool
		address, namespace string
		security           string
	}{
		{"defaults", globalFlags{}, nil, false, runs.DefaultAddress, runs.DefaultNamespace,
			"plaintext, no client certificate or API key"},
		{"environment", globalFlags{}, map[string]string{"TEMPORAL_ADDRESS": "env:7233", "TEMPORAL_NAMESPACE": "env-ns"}, false,
			"env:7233", "env-ns", "plaintext, no client certificate or API key"},
		{"--address and --namespace over the environment", globalFlags{address: "flag:7233", namespace: "flag-ns"},
			map[string]string{"TEMPORAL_ADDRESS": "env:7233", "TEMPORAL_NAMESPACE": "env-ns"}, false,
			"flag:7233", "flag-ns", "plaintext, no client certificate or API key"},
		{"TEMPORAL_CONFIG_FILE and TEMPORAL_PROFILE", globalFlags{},
			map[string]string{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "cloud"}, false,
			"cloud.example:7233", "cloud-ns", `TLS on, server CA the system's roots, API key set (api_key of profile "cloud" in $DIR/temporal.toml)`},
		{"--config-file and --profile", globalFlags{configFile: file, profile: "cloud"}, nil, false,
			"cloud.example:7233", "cloud-ns", `TLS on, server CA the system's roots, API key set (api_key of profile "cloud" in $DIR/temporal.toml)`},
		{"--profile over TEMPORAL_PROFILE, --address over the profile", globalFlags{profile: "cloud", address: "flag:7233"},
			map[string]string{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "default"}, false,
			"flag:7233", "cloud-ns", `TLS on, server CA the system's roots, API key set (api_key of profile "cloud" in $DIR/temporal.toml)`},
		// rlflow dev talks to its local dev server: a profile (often a
		// cloud cluster's) is not read.
		{"dev: the profile is not read", globalFlags{},
			map[string]string{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "cloud"}, true,
			runs.DefaultAddress, runs.DefaultNamespace, "plaintext, no client certificate or API key"},
		{"dev: the environment's address", globalFlags{},
			map[string]string{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_ADDRESS": "env:7233"}, true,
			"env:7233", runs.DefaultNamespace, "plaintext, no client certificate or API key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			g := tc.flags
			cmd := &cobra.Command{Use: "x"}
			if tc.local {
				cmd = localConnection(cmd)
			}
			g.resolveConnection(cmd)
			require.NoError(t, g.connErr)
			target, err := g.target()
			require.NoError(t, err)
			assert.Equal(t, tc.address, target.Address)
			assert.Equal(t, tc.namespace, target.Namespace)
			assert.Equal(t, tc.security, strings.ReplaceAll(target.Security.String(), dir, "$DIR"))
		})
	}
}

// TestDevIsLocal: rlflow dev is the command marked as talking to a local
// dev server.
func TestDevIsLocal(t *testing.T) {
	var local []string
	for _, c := range newRoot().Commands() {
		if c.Annotations[connectionAnnotation] == "local" {
			local = append(local, c.Name())
		}
	}
	assert.Equal(t, []string{"dev"}, local)
}

// runRoot runs the rlflow command line args in process and returns its
// error, failing the test if it hangs.
func runRoot(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	select {
	case err := <-done:
		return out.String(), err
	case <-time.After(hangGuard):
		t.Fatalf("rlflow %v did not return within %s", args, hangGuard)
		return "", nil
	}
}

// TestBrokenConfigFailsOnlyConnectingCommands: a Temporal config file that
// cannot be used fails the commands that connect, saying why, before any
// connection; a command that never connects does not read it.
func TestBrokenConfigFailsOnlyConnectingCommands(t *testing.T) {
	cleanTemporalEnv(t)
	missing := filepath.Join(t.TempDir(), "missing.toml")
	t.Setenv("TEMPORAL_CONFIG_FILE", missing)

	_, err := runRoot(t, "schema")
	require.NoError(t, err)

	for _, args := range [][]string{
		{"status", "some-run"},
		{"cancel", "some-run"},
		{"worker", "--log-dir", t.TempDir(), "--data-dir", t.TempDir()},
	} {
		_, err := runRoot(t, args...)
		require.Error(t, err, "%v", args)
		assert.Contains(t, err.Error(), "the Temporal config file "+missing+" (TEMPORAL_CONFIG_FILE) does not exist", "%v", args)
	}
	_, err = runRoot(t, "status", "some-run", "--config-file", missing+".flag")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the Temporal config file "+missing+".flag (--config-file) does not exist")
}
