package activities

import (
	"context"
	"encoding/base64"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/procs"
	"github.com/rlflow/rlflow/redact"
)

// Secret-like values the tests hand the worker; none may reach a step's
// error or outputs.
const (
	execSecret = "hf_SeCrEt-VaLuE-0123456789"
	serverKey  = "sk-server-key-abcdefghijklmnop"
	otherToken = "ghp_other-token-in-the-worker-env"
)

// workerEnv is a worker's environment: some variables the minimal
// environment passes, some it does not, three credentials.
func workerEnv() map[string]string {
	return map[string]string{
		"PATH": os.Getenv("PATH"), "HOME": "/home/trainer", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
		"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "all", "NCCL_DEBUG": "WARN", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
		"EDITOR": "vi", "RLFLOW_LOG_DIR": "/var/rlflow", "AWS_PROFILE": "prod",
		"MY_SECRET": execSecret, "OPENAI_API_KEY": serverKey, "GITHUB_TOKEN": otherToken, "SHORT_SECRET": "abc",
	}
}

func newSecretActivities(t *testing.T, mode ExecEnv) *Activities {
	env := workerEnv()
	return New(Deps{LogDir: t.TempDir(), DataDir: t.TempDir(), HeartbeatEvery: 20 * time.Millisecond, ExecEnv: mode,
		Getenv: func(k string) string { return env[k] },
		Environ: func() []string {
			out := make([]string, 0, len(env))
			for k, v := range env {
				out = append(out, k+"="+v)
			}
			return out
		}})
}

func secretStepContext(t *testing.T) pipelines.StepContext {
	sc := stepContext(t, "train")
	sc.Servers = []pipelines.Server{{URL: "http://127.0.0.1:1", APIKeyEnv: "OPENAI_API_KEY"}}
	return sc
}

// envKeys reads the variable names of `env`'s output.
func envKeys(t *testing.T, logPath string) []string {
	t.Helper()
	b, err := os.ReadFile(logPath)
	require.NoError(t, err)
	var keys []string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		k, _, ok := strings.Cut(line, "=")
		require.True(t, ok, "env line %q", line)
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// A command sees the minimal environment, its secrets, rlflow's variables
// and its env; with inherit, the worker's whole environment.
func TestExecEnvironment(t *testing.T) {
	rlflow := []string{"RLFLOW_ATTEMPT", procs.TagEnv, "RLFLOW_ITERATION", "RLFLOW_OUTPUTS", "RLFLOW_PIPELINE", "RLFLOW_RUN_ID", "RLFLOW_STEP"}
	step := []string{"MY_SECRET", "STEP_VAR"}
	minimal := []string{"CUDA_VISIBLE_DEVICES", "HOME", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "NCCL_DEBUG", "NVIDIA_VISIBLE_DEVICES", "PATH", "TZ"}
	for _, tc := range []struct {
		mode ExecEnv
		want []string
	}{
		{"", append(append(append([]string(nil), minimal...), rlflow...), step...)},
		{ExecEnvMinimal, append(append(append([]string(nil), minimal...), rlflow...), step...)},
		{ExecEnvInherit, append(append(append([]string(nil), minimal...), rlflow...), "MY_SECRET", "STEP_VAR",
			"AWS_PROFILE", "EDITOR", "GITHUB_TOKEN", "OPENAI_API_KEY", "RLFLOW_LOG_DIR", "SHORT_SECRET")},
	} {
		t.Run("mode "+string(tc.mode), func(t *testing.T) {
			a := newSecretActivities(t, tc.mode)
			out, err := a.exec(context.Background(), ExecInput{Context: secretStepContext(t), Command: []string{"env"},
				Env: map[string]string{"STEP_VAR": "x"}, Secrets: []string{"MY_SECRET"}}, attemptN(1))
			require.NoError(t, err)
			want := append([]string(nil), tc.want...)
			sort.Strings(want)
			assert.Equal(t, want, envKeys(t, out.Log))
		})
	}
}

// The secret reaches the command, which prints it, URL-encodes and
// base64-encodes it, writes it to its outputs and fails: the step's error
// (log tail) holds none of it, nor do the outputs file or, for a
// successful step, its outputs. The log file keeps what the command wrote.
func TestExecSecretMaskedInErrorAndOutputs(t *testing.T) {
	script := `env
echo "the secret is $MY_SECRET, the key $OPENAI_API_KEY, the token $GITHUB_TOKEN"
echo "in a URL: https://hub.example/?token=$ENCODED"
echo "in base64: $(printf 'user:%s' "$MY_SECRET" | base64 -w0)"
echo "token=$MY_SECRET" >> "$RLFLOW_OUTPUTS"
echo "url=https://hub.example/?token=$ENCODED" >> "$RLFLOW_OUTPUTS"
echo "note=key $OPENAI_API_KEY" >> "$RLFLOW_OUTPUTS"
exit $CODE`
	for _, mode := range []ExecEnv{ExecEnvMinimal, ExecEnvInherit} {
		for _, code := range []string{"3", "0"} {
			t.Run(string(mode)+" exit "+code, func(t *testing.T) {
				a := newSecretActivities(t, mode)
				sc := secretStepContext(t)
				sc.Outputs = []string{"token", "url"}
				in := ExecInput{Context: sc, Command: []string{"sh", "-c", script}, Secrets: []string{"MY_SECRET"},
					Env: map[string]string{"CODE": code, "ENCODED": url.QueryEscape(execSecret)}}
				out, err := a.exec(context.Background(), in, attemptN(1))
				logFile := filepath.Join(stepDir(a.LogDir, sc), "attempt-1.log")
				outputsFile := filepath.Join(stepDir(a.LogDir, sc), "attempt-1.outputs")
				var reported string
				if code == "0" {
					require.NoError(t, err)
					assert.Equal(t, redact.Mask, out.Values["token"])
					assert.Equal(t, "https://hub.example/?token="+redact.Mask, out.Values["url"])
					if mode == ExecEnvInherit {
						assert.Equal(t, "key "+redact.Mask, out.Values["note"])
					}
					b, err := out.MarshalJSON()
					require.NoError(t, err)
					reported = string(b)
				} else {
					require.Error(t, err)
					require.True(t, IsType(err, pipelines.ErrTypeExit), "%v", err)
					reported = err.Error()
					assert.Contains(t, reported, "the secret is ***, the key")
					assert.Contains(t, reported, "in a URL: https://hub.example/?token=***")
				}
				outputs, rerr := os.ReadFile(outputsFile)
				require.NoError(t, rerr)
				assert.Contains(t, string(outputs), "token=***")
				secrets := []string{execSecret, url.QueryEscape(execSecret), base64.StdEncoding.EncodeToString([]byte("user:" + execSecret))[8:20], serverKey}
				if mode == ExecEnvInherit {
					// Inherited, and named like a credential: masked too.
					secrets = append(secrets, otherToken)
				}
				for _, s := range secrets {
					assert.NotContains(t, reported, s)
					assert.NotContains(t, string(outputs), s)
				}
				log, rerr := os.ReadFile(logFile)
				require.NoError(t, rerr)
				assert.Contains(t, string(log), "the secret is "+execSecret, "the log on the worker's disk is the command's own")
			})
		}
	}
}

// A requested secret the worker cannot give fails the step with BadInput
// naming it, never quoting its value; names are checked as the loader
// checks them.
func TestExecSecretErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		secrets []string
		env     map[string]string
		want    string
	}{
		{"unset", []string{"NOT_THERE"}, nil, "exec: secrets: NOT_THERE is not set in the worker's environment"},
		{"too short", []string{"SHORT_SECRET"}, nil, "exec: secrets: SHORT_SECRET is shorter than 8 bytes, too short to be masked"},
		{"bad name", []string{"MY-SECRET"}, nil, `exec: secrets: item 0: must name an environment variable ([A-Za-z_][A-Za-z0-9_]*), got string "MY-SECRET"`},
		{"listed twice", []string{"MY_SECRET", "MY_SECRET"}, nil, "exec: secrets: item 1: MY_SECRET is listed twice"},
		{"also in env", []string{"MY_SECRET"}, map[string]string{"MY_SECRET": "x"}, "exec: secrets: item 0: MY_SECRET is also set in env"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newSecretActivities(t, ExecEnvMinimal)
			_, err := a.exec(context.Background(), ExecInput{Context: secretStepContext(t), Command: []string{"true"}, Secrets: tc.secrets, Env: tc.env}, attemptN(1))
			require.Error(t, err)
			assert.True(t, IsType(err, pipelines.ErrTypeBadInput), "%v", err)
			assert.Contains(t, err.Error(), tc.want)
			assert.NotContains(t, err.Error(), "abc")
			var app *temporal.ApplicationError
			require.ErrorAs(t, err, &app)
			assert.True(t, app.NonRetryable())
		})
	}
}

func TestParseExecEnv(t *testing.T) {
	for in, want := range map[string]ExecEnv{"": ExecEnvMinimal, "minimal": ExecEnvMinimal, "inherit": ExecEnvInherit, " inherit ": ExecEnvInherit} {
		got, err := ParseExecEnv(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	_, err := ParseExecEnv("all")
	require.EqualError(t, err, `exec environment "all": want minimal (the default: only the variables a trainer needs, and the step's secrets) or inherit (the worker's whole environment)`)
}

func TestCredentialName(t *testing.T) {
	for name, want := range map[string]bool{
		"OPENAI_API_KEY": true, "HF_TOKEN": true, "AWS_SECRET_ACCESS_KEY": true, "DB_PASSWORD": true, "wandb_api_key": true,
		"TOKENIZERS_PARALLELISM": false, "SSH_AUTH_SOCK": false, "MONKEY": false, "PATH": false, "KEYBOARD": false,
	} {
		assert.Equal(t, want, credentialName(name), name)
	}
}
