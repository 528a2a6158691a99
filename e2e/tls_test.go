package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/internal/testutil/tlstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tlsPipeline: two quick steps; what matters is that the worker and the
// CLI reach Temporal through the TLS frontend.
const tlsPipeline = `version: 1
name: tls
steps:
  - {id: first, uses: noop}
  - {id: second, uses: noop, needs: [first]}
`

// isolateTemporalEnv leaves the rlflow processes the test starts only the
// TEMPORAL_* settings the test sets, and no Temporal config file but the
// test's.
func isolateTemporalEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "TEMPORAL_") {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
}

// setEnv sets the test's environment, which the rlflow processes it
// starts inherit.
func setEnv(t *testing.T, env map[string]string) {
	for k, v := range env {
		t.Setenv(k, v)
	}
}

// workerAndRun starts `rlflow worker` and then `rlflow run --wait` on
// queue, with the environment the test set, and requires the run to
// succeed; it returns both outputs.
func workerAndRun(t *testing.T, queue string, extra ...string) (worker, run string) {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, "tls.yaml")
	require.NoError(t, os.WriteFile(file, []byte(tlsPipeline), 0o644))
	common := append([]string{"--task-queue", queue}, extra...)
	w := startOutageProc(t, "worker", append([]string{"worker", "--log-dir", filepath.Join(dir, "logs"),
		"--data-dir", filepath.Join(dir, "data")}, common...)...)
	w.WaitFor(t, time.Minute, "rlflow worker running")
	r := startOutageProc(t, "run --wait", append([]string{"run", file, "--wait", "--id", queue + "-run"}, common...)...)
	require.Equal(t, 0, r.ExitCode(t, 2*time.Minute), "run --wait output:\n%s\nworker output:\n%s", r.Output(), w.Output())
	assert.Contains(t, r.Output(), "run "+queue+"-run succeeded: 1 iteration(s)")
	require.False(t, w.Exited(), "worker output:\n%s", w.Output())
	return w.Output(), r.Output()
}

// TestTLSConnections runs `rlflow worker` and `rlflow run --wait` against
// a dev server behind a TLS-terminating proxy with a CA made in the test,
// configured the Temporal way: mTLS through TEMPORAL_* variables, an API
// key with TLS through a config file profile; and a client certificate of
// another CA fails both commands at once, saying why.
func TestTLSConnections(t *testing.T) {
	isolateTemporalEnv(t)
	srv := testutil.DevServer(t)
	ca := tlstest.NewCA(t, "ca")
	server := ca.Server()
	mtls := tlstest.NewProxy(t, srv.Address, tlstest.ProxyOptions{Cert: server, ClientCA: ca})
	tlsOnly := tlstest.NewProxy(t, srv.Address, tlstest.ProxyOptions{Cert: server})

	t.Run("mTLS through the environment", func(t *testing.T) {
		client := ca.Client("rlflow-worker")
		setEnv(t, map[string]string{
			"TEMPORAL_ADDRESS":                 mtls.Address,
			"TEMPORAL_TLS_CLIENT_CERT_PATH":    client.CertPath,
			"TEMPORAL_TLS_CLIENT_KEY_PATH":     client.KeyPath,
			"TEMPORAL_TLS_SERVER_CA_CERT_PATH": ca.CertPath,
		})
		workerAndRun(t, "tls-mtls-env")
		assert.Empty(t, mtls.Refused(), "every handshake was accepted")
		assert.GreaterOrEqual(t, mtls.Served(), 2, "the worker and the CLI came through the mTLS frontend")
	})

	t.Run("API key and TLS through a config profile", func(t *testing.T) {
		const apiKey = "sk-rlflow-e2e-0123456789"
		config := filepath.Join(t.TempDir(), "temporal.toml")
		require.NoError(t, os.WriteFile(config, []byte(fmt.Sprintf(`
[profile.default]
address = "127.0.0.1:1"

[profile.secure]
address = %q
namespace = "default"
api_key = %q
[profile.secure.tls]
server_ca_cert_path = %q
`, tlsOnly.Address, apiKey, ca.CertPath)), 0o600))
		setEnv(t, map[string]string{"TEMPORAL_CONFIG_FILE": config, "TEMPORAL_PROFILE": "secure"})
		worker, run := workerAndRun(t, "tls-apikey-profile")
		auth := tlsOnly.Authorizations()
		require.NotEmpty(t, auth)
		for _, a := range auth {
			assert.Equal(t, "Bearer "+apiKey, a, "every connection's first request carried the API key")
		}
		assert.NotContains(t, worker+run, apiKey, "the API key is never printed")
	})

	t.Run("a client certificate of another CA", func(t *testing.T) {
		stranger := tlstest.NewCA(t, "stranger").Client("intruder")
		setEnv(t, map[string]string{
			"TEMPORAL_ADDRESS":                 mtls.Address,
			"TEMPORAL_TLS_CLIENT_CERT_PATH":    stranger.CertPath,
			"TEMPORAL_TLS_CLIENT_KEY_PATH":     stranger.KeyPath,
			"TEMPORAL_TLS_SERVER_CA_CERT_PATH": ca.CertPath,
		})
		before := len(mtls.Refused())
		dir := t.TempDir()
		file := filepath.Join(dir, "tls.yaml")
		require.NoError(t, os.WriteFile(file, []byte(tlsPipeline), 0o644))
		// The worker waits out outages with no limit by default: a
		// certificate error is not one, it must exit.
		w := startOutageProc(t, "worker", "worker", "--task-queue", "tls-stranger",
			"--log-dir", filepath.Join(dir, "logs"), "--data-dir", filepath.Join(dir, "data"))
		r := startOutageProc(t, "run", "run", file, "--task-queue", "tls-stranger")
		for _, p := range []*outageProc{w, r} {
			require.Equal(t, 1, p.ExitCode(t, time.Minute), "%s output:\n%s", p.name, p.Output())
			out := p.Output()
			t.Logf("%s output:\n%s", p.name, out)
			assert.Contains(t, out, "connecting to Temporal at "+mtls.Address+" (namespace default): TLS handshake failed: the server refused rlflow's client certificate", p.name)
			assert.Contains(t, out, "client certificate "+stranger.CertPath+" (TEMPORAL_TLS_CLIENT_CERT_PATH)", p.name)
			assert.Contains(t, out, "client key "+stranger.KeyPath+" (TEMPORAL_TLS_CLIENT_KEY_PATH)", p.name)
			assert.NotContains(t, out, "retrying", "%s: a certificate error is not retried", p.name)
			assert.NotContains(t, out, "PRIVATE KEY", p.name)
		}
		assert.Greater(t, len(mtls.Refused()), before, "the frontend refused the handshakes")
	})
}
