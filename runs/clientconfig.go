package runs

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"

	"github.com/BurntSushi/toml"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/contrib/envconfig"
)

// Defaults of a connection that neither flags, environment nor profile set.
const (
	DefaultAddress   = "127.0.0.1:7233"
	DefaultNamespace = "default"
)

// Settings choose a Temporal connection the way the Temporal CLI does:
// Temporal's client configuration (a profile of its TOML config file, then
// the TEMPORAL_* environment variables over it, as go.temporal.io/sdk's
// envconfig reads them), then the command's explicit flags over both.
type Settings struct {
	// Address and Namespace are the command's flags; set, they override
	// the environment and the profile.
	Address, Namespace string
	// ConfigFile is the TOML file (--config-file); empty takes
	// TEMPORAL_CONFIG_FILE, else the Temporal CLI's default file, which
	// may be absent. A file named either way must exist.
	ConfigFile string
	// Profile is the file's profile (--profile); empty takes
	// TEMPORAL_PROFILE, else "default", which may be absent. A profile
	// named either way must exist.
	Profile string
	// Env is the environment; nil is the process's.
	Env envconfig.EnvLookup
}

// Resolve builds the Target that s chooses: the address and namespace
// (else DefaultAddress, DefaultNamespace) and the TLS, API key and gRPC
// metadata of the profile and environment, with the certificate files
// loaded now, so that a missing or malformed one fails here, named.
//
// A profile's codec settings (TEMPORAL_CODEC_ENDPOINT) are not used: a
// remote codec is for people's tools (the UI, the CLI); a worker would
// call it on every replay.
func Resolve(s Settings) (Target, error) {
	env := s.Env
	if env == nil {
		env = envconfig.EnvLookupOS
	}
	file, fileFrom := s.ConfigFile, "--config-file"
	if file == "" {
		file, _ = env.LookupEnv("TEMPORAL_CONFIG_FILE")
		fileFrom = "TEMPORAL_CONFIG_FILE"
	}
	if file == "" {
		file, fileFrom = envconfig.DefaultConfigFilePath(), ""
	}
	name, nameFrom := s.Profile, "--profile"
	if name == "" {
		name, _ = env.LookupEnv("TEMPORAL_PROFILE")
		nameFrom = "TEMPORAL_PROFILE"
	}
	if name == "" {
		name, nameFrom = envconfig.DefaultConfigFileProfile, ""
	}

	src := source{env: env, file: file, profile: name}
	prof, err := loadProfile(file, fileFrom, name, nameFrom)
	if err != nil {
		return Target{}, err
	}
	if prof != nil {
		src.fileProfile = prof
		cp := *prof
		if prof.TLS != nil {
			tlsCopy := *prof.TLS
			cp.TLS = &tlsCopy
		}
		prof = &cp
	} else {
		prof = &envconfig.ClientConfigProfile{}
	}
	if err := prof.ApplyEnvVars(env); err != nil {
		return Target{}, fmt.Errorf("reading the TEMPORAL_* environment: %w", err)
	}
	if s.Address != "" {
		prof.Address = s.Address
	}
	if s.Namespace != "" {
		prof.Namespace = s.Namespace
	}
	t := Target{Address: prof.Address, Namespace: prof.Namespace}
	if t.Address == "" {
		t.Address = DefaultAddress
	}
	if t.Namespace == "" {
		t.Namespace = DefaultNamespace
	}
	// Only the connection's security is taken from the SDK's options:
	// rlflow sets address and namespace itself, and never a remote codec.
	opts, err := prof.ToClientOptions(envconfig.ToClientOptionsRequest{})
	if err != nil {
		return Target{}, fmt.Errorf("the Temporal client configuration (%s): %w", src.describe(prof), err)
	}
	t.Security = Security{
		base: client.Options{
			ConnectionOptions: client.ConnectionOptions{
				TLS:         opts.ConnectionOptions.TLS,
				TLSDisabled: opts.ConnectionOptions.TLSDisabled,
				Authority:   opts.ConnectionOptions.Authority,
			},
			Credentials:     opts.Credentials,
			HeadersProvider: opts.HeadersProvider,
		},
		clientCert: prof.TLS != nil && (prof.TLS.ClientCertPath != "" || len(prof.TLS.ClientCertData) > 0),
		settings:   src.describe(prof),
	}
	return t, nil
}

// loadProfile reads profile name of file; nil when the file or the profile
// is absent and was not named (fileFrom, nameFrom empty).
func loadProfile(file, fileFrom, name, nameFrom string) (*envconfig.ClientConfigProfile, error) {
	if file == "" {
		return nil, nil
	}
	data, err := os.ReadFile(file)
	switch {
	case errors.Is(err, os.ErrNotExist) && fileFrom == "" && nameFrom == "":
		return nil, nil
	case errors.Is(err, os.ErrNotExist) && fileFrom == "":
		return nil, fmt.Errorf("the Temporal profile %q (%s): the config file %s does not exist", name, nameFrom, file)
	case errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("the Temporal config file %s (%s) does not exist", file, fileFrom)
	case err != nil:
		return nil, fmt.Errorf("the Temporal config file %s%s: %w", file, from(fileFrom), err)
	}
	var conf envconfig.ClientConfig
	if err := conf.FromTOML(data, envconfig.ClientConfigFromTOMLOptions{}); err != nil {
		return nil, tomlError(file, data, err)
	}
	prof := conf.Profiles[name]
	if prof == nil && nameFrom != "" {
		names := make([]string, 0, len(conf.Profiles))
		for n := range conf.Profiles {
			names = append(names, n)
		}
		slices.Sort(names)
		return nil, fmt.Errorf("the Temporal profile %q (%s) is not in %s (its profiles: %s)", name, nameFrom, file, strings.Join(names, ", "))
	}
	return prof, nil
}

func from(flagOrEnv string) string {
	if flagOrEnv == "" {
		return ""
	}
	return " (" + flagOrEnv + ")"
}

// quoted matches the pieces of the TOML parser's messages that quote the
// input: a value there may be an API key or a private key.
var quoted = regexp.MustCompile(`"[^"]*"|'[^']*'`)

// tomlError names the place of a TOML error, file:line:col, without the
// parser's quote of the input.
func tomlError(file string, data []byte, err error) error {
	var pe toml.ParseError
	if !errors.As(err, &pe) {
		return fmt.Errorf("the Temporal config file %s: %s", file, quoted.ReplaceAllString(err.Error(), "(value not shown)"))
	}
	col := pe.Position.Start + 1
	if i := strings.LastIndexByte(string(data[:min(pe.Position.Start, len(data))]), '\n'); i >= 0 {
		col = pe.Position.Start - i
	}
	msg := pe.Message
	if msg == "" { // the parser's errors without a Message say it only in Error
		msg = pe.Error()
		if i := strings.Index(msg, "): "); pe.LastKey != "" && i >= 0 {
			msg = msg[i+len("): "):]
		} else if _, after, ok := strings.Cut(msg, fmt.Sprintf("line %d: ", pe.Position.Line)); ok {
			msg = after
		}
	}
	key := ""
	if pe.LastKey != "" {
		key = " (after key " + pe.LastKey + ")"
	}
	return fmt.Errorf("the Temporal config file %s:%d:%d%s: %s", file, pe.Position.Line, col, key,
		quoted.ReplaceAllString(msg, "(value not shown)"))
}

// source tells where each setting of a profile came from, for messages:
// the environment variable when it is set, else the profile's key.
type source struct {
	env         envconfig.EnvLookup
	file        string
	profile     string
	fileProfile *envconfig.ClientConfigProfile
}

// setting is one TLS or credential setting as the user names it.
type setting struct {
	what, env, key string
	value          func(p *envconfig.ClientConfigProfile) string
}

// shown are the settings that messages show: paths and names, never key
// material (inline PEM and the API key show as "set").
var shown = []setting{
	{"server CA", "TEMPORAL_TLS_SERVER_CA_CERT_PATH", "tls.server_ca_cert_path", tlsField(func(t *envconfig.ClientConfigTLS) string { return t.ServerCACertPath })},
	{"server CA", "TEMPORAL_TLS_SERVER_CA_CERT_DATA", "tls.server_ca_cert_data", tlsField(func(t *envconfig.ClientConfigTLS) string { return set(t.ServerCACertData) })},
	{"server name", "TEMPORAL_TLS_SERVER_NAME", "tls.server_name", tlsField(func(t *envconfig.ClientConfigTLS) string { return t.ServerName })},
	{"host verification", "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION", "tls.disable_host_verification", tlsField(func(t *envconfig.ClientConfigTLS) string {
		if t.DisableHostVerification {
			return "disabled"
		}
		return ""
	})},
	{"client certificate", "TEMPORAL_TLS_CLIENT_CERT_PATH", "tls.client_cert_path", tlsField(func(t *envconfig.ClientConfigTLS) string { return t.ClientCertPath })},
	{"client certificate", "TEMPORAL_TLS_CLIENT_CERT_DATA", "tls.client_cert_data", tlsField(func(t *envconfig.ClientConfigTLS) string { return set(t.ClientCertData) })},
	{"client key", "TEMPORAL_TLS_CLIENT_KEY_PATH", "tls.client_key_path", tlsField(func(t *envconfig.ClientConfigTLS) string { return t.ClientKeyPath })},
	{"client key", "TEMPORAL_TLS_CLIENT_KEY_DATA", "tls.client_key_data", tlsField(func(t *envconfig.ClientConfigTLS) string { return set(t.ClientKeyData) })},
	{"API key", "TEMPORAL_API_KEY", "api_key", func(p *envconfig.ClientConfigProfile) string { return set([]byte(p.APIKey)) }},
}

func tlsField(f func(*envconfig.ClientConfigTLS) string) func(*envconfig.ClientConfigProfile) string {
	return func(p *envconfig.ClientConfigProfile) string {
		if p.TLS == nil {
			return ""
		}
		return f(p.TLS)
	}
}

func set(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return "set"
}

// describe lists p's TLS and credential settings with where each came
// from, e.g. `TLS on, client certificate /etc/rlflow/c.pem
// (TEMPORAL_TLS_CLIENT_CERT_PATH)`: paths and names, never key material.
func (s source) describe(p *envconfig.ClientConfigProfile) string {
	var parts []string
	switch {
	case p.TLS != nil && p.TLS.Disabled:
		parts = append(parts, "TLS off"+s.where("TEMPORAL_TLS", "tls.disabled"))
	case p.TLS != nil || p.APIKey != "":
		on := "TLS on"
		if v, ok := s.env.LookupEnv("TEMPORAL_TLS"); ok && v != "" {
			on += " (TEMPORAL_TLS)"
		}
		parts = append(parts, on)
	default:
		parts = append(parts, "plaintext")
	}
	tlsOn := !strings.HasPrefix(parts[0], "TLS off") && parts[0] != "plaintext"
	for _, st := range shown {
		if v := st.value(p); v != "" {
			parts = append(parts, st.what+" "+v+s.where(st.env, st.key))
		} else if st.env == "TEMPORAL_TLS_SERVER_CA_CERT_DATA" && tlsOn && !slices.ContainsFunc(parts, isCA) {
			parts = append(parts, "server CA the system's roots")
		}
	}
	if p.APIKey == "" && !slices.ContainsFunc(parts, func(s string) bool { return strings.HasPrefix(s, "client certificate") }) {
		parts = append(parts, "no client certificate or API key")
	}
	return strings.Join(parts, ", ")
}

func isCA(part string) bool { return strings.HasPrefix(part, "server CA ") }

// where is " (ENV)" when env is set, else " (key of profile "p" in file)".
func (s source) where(env, key string) string {
	if _, ok := s.env.LookupEnv(env); ok {
		return " (" + env + ")"
	}
	return fmt.Sprintf(" (%s of profile %q in %s)", key, s.profile, s.file)
}
