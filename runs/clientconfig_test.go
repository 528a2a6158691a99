package runs

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/testutil/tlstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// fakeEnv is an environment for Resolve: only its variables are set.
type fakeEnv map[string]string

func (e fakeEnv) Environ() []string {
	var out []string
	for k, v := range e {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

func (e fakeEnv) LookupEnv(k string) (string, bool) {
	v, ok := e[k]
	return v, ok
}

// configFile writes a Temporal config file with two profiles into dir.
const twoProfiles = `
[profile.default]
address = "file-default:7233"
namespace = "file-ns"

[profile.cloud]
address = "cloud.example:7233"
namespace = "cloud-ns"
api_key = "sk-profile-secret"
`

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

// noUserConfig points the Temporal CLI's default config file into an
// empty directory, so that the machine's own does not count.
func noUserConfig(t *testing.T) string {
	dir := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", dir)
	t.Setenv("HOME", dir)
	return dir
}

func TestResolvePrecedence(t *testing.T) {
	noUserConfig(t)
	dir := t.TempDir()
	file := writeFile(t, dir, "temporal.toml", twoProfiles)
	other := writeFile(t, dir, "other.toml", "[profile.default]\naddress = \"other-file:7233\"\n")
	for _, tc := range []struct {
		name               string
		s                  Settings
		env                fakeEnv
		address, namespace string
		security           string
	}{
		{"nothing set: the defaults", Settings{}, fakeEnv{}, DefaultAddress, DefaultNamespace,
			"plaintext, no client certificate or API key"},
		{"the environment", Settings{}, fakeEnv{"TEMPORAL_ADDRESS": "env:7233", "TEMPORAL_NAMESPACE": "env-ns"}, "env:7233", "env-ns",
			"plaintext, no client certificate or API key"},
		{"flags over the environment", Settings{Address: "flag:7233", Namespace: "flag-ns"},
			fakeEnv{"TEMPORAL_ADDRESS": "env:7233", "TEMPORAL_NAMESPACE": "env-ns"}, "flag:7233", "flag-ns",
			"plaintext, no client certificate or API key"},
		{"the file's default profile", Settings{}, fakeEnv{"TEMPORAL_CONFIG_FILE": file}, "file-default:7233", "file-ns",
			"plaintext, no client certificate or API key"},
		{"the environment over the profile", Settings{}, fakeEnv{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_NAMESPACE": "env-ns"},
			"file-default:7233", "env-ns", "plaintext, no client certificate or API key"},
		{"flags over the environment over the profile", Settings{Address: "flag:7233"},
			fakeEnv{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_ADDRESS": "env:7233"}, "flag:7233", "file-ns",
			"plaintext, no client certificate or API key"},
		{"TEMPORAL_PROFILE", Settings{}, fakeEnv{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "cloud"},
			"cloud.example:7233", "cloud-ns", `TLS on, server CA the system's roots, API key set (api_key of profile "cloud" in $DIR/temporal.toml)`},
		{"--profile over TEMPORAL_PROFILE", Settings{Profile: "default"}, fakeEnv{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "cloud"},
			"file-default:7233", "file-ns", "plaintext, no client certificate or API key"},
		{"--config-file over TEMPORAL_CONFIG_FILE", Settings{ConfigFile: other}, fakeEnv{"TEMPORAL_CONFIG_FILE": file},
			"other-file:7233", DefaultNamespace, "plaintext, no client certificate or API key"},
		{"the API key from the environment", Settings{}, fakeEnv{"TEMPORAL_API_KEY": "sk-env-secret"},
			DefaultAddress, DefaultNamespace, "TLS on, server CA the system's roots, API key set (TEMPORAL_API_KEY)"},
		{"TLS off in the environment over a profile's API key", Settings{},
			fakeEnv{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "cloud", "TEMPORAL_TLS": "false"},
			"cloud.example:7233", "cloud-ns", `TLS off (TEMPORAL_TLS), API key set (api_key of profile "cloud" in $DIR/temporal.toml)`},
		{"TLS on alone", Settings{}, fakeEnv{"TEMPORAL_TLS": "true"}, DefaultAddress, DefaultNamespace,
			"TLS on (TEMPORAL_TLS), server CA the system's roots, no client certificate or API key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.s.Env = tc.env
			got, err := Resolve(tc.s)
			require.NoError(t, err)
			assert.Equal(t, tc.address, got.Address)
			assert.Equal(t, tc.namespace, got.Namespace)
			assert.Equal(t, tc.security, strings.ReplaceAll(got.Security.String(), dir, "$DIR"))
		})
	}
}

// TestResolveMTLS loads a client certificate, its key and a server CA
// from the environment and from a profile, and says where each came from.
func TestResolveMTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "ca")
	client := ca.Client("worker")
	dir := t.TempDir()
	file := writeFile(t, dir, "temporal.toml", fmt.Sprintf(`
[profile.secure]
address = "secure.example:7233"
[profile.secure.tls]
client_cert_path = %q
client_key_path = %q
server_ca_cert_path = %q
server_name = "frontend.example"
`, client.CertPath, client.KeyPath, ca.CertPath))
	for _, tc := range []struct {
		name string
		s    Settings
		env  fakeEnv
		want string
	}{
		{"environment", Settings{}, fakeEnv{
			"TEMPORAL_TLS_CLIENT_CERT_PATH":    client.CertPath,
			"TEMPORAL_TLS_CLIENT_KEY_PATH":     client.KeyPath,
			"TEMPORAL_TLS_SERVER_CA_CERT_PATH": ca.CertPath,
		}, "TLS on, server CA $CA/ca.pem (TEMPORAL_TLS_SERVER_CA_CERT_PATH), client certificate $CA/worker.pem (TEMPORAL_TLS_CLIENT_CERT_PATH), client key $CA/worker-key.pem (TEMPORAL_TLS_CLIENT_KEY_PATH)"},
		{"profile", Settings{ConfigFile: file, Profile: "secure"}, fakeEnv{},
			`TLS on, server CA $CA/ca.pem (tls.server_ca_cert_path of profile "secure" in $DIR/temporal.toml), ` +
				`server name frontend.example (tls.server_name of profile "secure" in $DIR/temporal.toml), ` +
				`client certificate $CA/worker.pem (tls.client_cert_path of profile "secure" in $DIR/temporal.toml), ` +
				`client key $CA/worker-key.pem (tls.client_key_path of profile "secure" in $DIR/temporal.toml)`},
		{"inline PEM shows as set", Settings{}, fakeEnv{
			"TEMPORAL_TLS_CLIENT_CERT_DATA": readFile(t, client.CertPath),
			"TEMPORAL_TLS_CLIENT_KEY_DATA":  readFile(t, client.KeyPath),
		}, "TLS on, server CA the system's roots, client certificate set (TEMPORAL_TLS_CLIENT_CERT_DATA), client key set (TEMPORAL_TLS_CLIENT_KEY_DATA)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.s.Env = tc.env
			got, err := Resolve(tc.s)
			require.NoError(t, err)
			desc := strings.NewReplacer(filepath.Dir(ca.CertPath), "$CA", dir, "$DIR").Replace(got.Security.String())
			assert.Equal(t, tc.want, desc)
			assert.True(t, got.Security.clientCert)
			opts, err := clientOptions(got, quietLogger{})
			require.NoError(t, err)
			require.NotNil(t, opts.ConnectionOptions.TLS)
			assert.Len(t, opts.ConnectionOptions.TLS.Certificates, 1, "the client certificate is loaded")
			assert.Equal(t, got.Address, opts.HostPort)
		})
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	return string(b)
}

// TestSecurityPrintsNoSecret prints a target every way fmt can: neither
// the API key nor the client key may show.
func TestSecurityPrintsNoSecret(t *testing.T) {
	ca := tlstest.NewCA(t, "ca")
	client := ca.Client("worker")
	key := readFile(t, client.KeyPath)
	got, err := Resolve(Settings{Env: fakeEnv{
		"TEMPORAL_API_KEY":              "sk-env-secret",
		"TEMPORAL_TLS_CLIENT_CERT_DATA": readFile(t, client.CertPath),
		"TEMPORAL_TLS_CLIENT_KEY_DATA":  key,
	}})
	require.NoError(t, err)
	for _, verb := range []string{"%v", "%+v", "%#v", "%s"} {
		out := fmt.Sprintf(verb, got)
		assert.NotContains(t, out, "sk-env-secret", verb)
		assert.NotContains(t, out, "PRIVATE KEY", verb)
		assert.NotContains(t, out, strings.Split(key, "\n")[1], verb)
	}
}

// TestResolveErrors checks the message of every configuration Resolve
// refuses against testdata/resolve_errors.golden; none quotes a secret.
func TestResolveErrors(t *testing.T) {
	userConfig := noUserConfig(t)
	ca := tlstest.NewCA(t, "ca")
	client := ca.Client("worker")
	dir := t.TempDir()
	file := writeFile(t, dir, "temporal.toml", twoProfiles)
	badTOML := writeFile(t, dir, "bad.toml", "[profile.default]\naddress = \"x:7233\"\napi_key = sk-unquoted-secret\n")
	badCA := writeFile(t, dir, "notpem.pem", "not a certificate")
	missing := filepath.Join(dir, "missing.toml")
	for _, tc := range []struct {
		name string
		s    Settings
		env  fakeEnv
	}{
		{"--config-file missing", Settings{ConfigFile: missing}, fakeEnv{}},
		{"TEMPORAL_CONFIG_FILE missing", Settings{}, fakeEnv{"TEMPORAL_CONFIG_FILE": missing}},
		{"--profile not in the file", Settings{ConfigFile: file, Profile: "prod"}, fakeEnv{}},
		{"TEMPORAL_PROFILE not in the file", Settings{}, fakeEnv{"TEMPORAL_CONFIG_FILE": file, "TEMPORAL_PROFILE": "prod"}},
		{"--profile without a config file", Settings{Profile: "prod"}, fakeEnv{}},
		{"TOML syntax", Settings{ConfigFile: badTOML}, fakeEnv{}},
		{"client certificate file missing", Settings{}, fakeEnv{
			"TEMPORAL_TLS_CLIENT_CERT_PATH": filepath.Join(dir, "nope.pem"), "TEMPORAL_TLS_CLIENT_KEY_PATH": client.KeyPath}},
		{"client certificate without key", Settings{}, fakeEnv{"TEMPORAL_TLS_CLIENT_CERT_PATH": client.CertPath}},
		{"server CA not PEM", Settings{}, fakeEnv{"TEMPORAL_TLS_SERVER_CA_CERT_PATH": badCA, "TEMPORAL_API_KEY": "sk-env-secret"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.s.Env = tc.env
			_, err := Resolve(tc.s)
			require.Error(t, err)
			msg := err.Error()
			for _, secret := range []string{"sk-unquoted-secret", "sk-profile-secret", "sk-env-secret", "PRIVATE KEY"} {
				assert.NotContains(t, msg, secret)
			}
			checkGolden(t, "resolve_errors", tc.name, strings.NewReplacer(dir, "$DIR", filepath.Dir(ca.CertPath), "$CA").Replace(strings.ReplaceAll(msg, userConfig, "$USERCONFIG")))
		})
	}
}

// golden holds the error messages of a test, "name: message" a line, in
// testdata/<file>.golden; -update rewrites the file.
var golden = map[string]map[string]string{}

func checkGolden(t *testing.T, file, name, got string) {
	t.Helper()
	if *update {
		if golden[file] == nil {
			golden[file] = map[string]string{}
		}
		golden[file][name] = got
		return
	}
	data, err := os.ReadFile(filepath.Join("testdata", file+".golden"))
	require.NoError(t, err, "run with -update to create it")
	for _, line := range strings.Split(string(data), "\n") {
		if n, msg, ok := strings.Cut(line, ": "); ok && n == name {
			assert.Equal(t, msg, got, "testdata/%s.golden, %q (run with -update after checking the new message)", file, name)
			return
		}
	}
	t.Errorf("testdata/%s.golden has no line for %q (got %q); run with -update", file, name, got)
}

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if *update && code == 0 {
		for file, lines := range golden {
			names := make([]string, 0, len(lines))
			for n := range lines {
				names = append(names, n)
			}
			sort.Strings(names)
			var b strings.Builder
			for _, n := range names {
				fmt.Fprintf(&b, "%s: %s\n", n, lines[n])
			}
			if err := os.MkdirAll("testdata", 0o755); err != nil {
				panic(err)
			}
			if err := os.WriteFile(filepath.Join("testdata", file+".golden"), []byte(b.String()), 0o644); err != nil {
				panic(err)
			}
		}
	}
	os.Exit(code)
}
