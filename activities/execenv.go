package activities

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/redact"
)

// ExecEnv is how much of the worker's environment an exec command gets.
type ExecEnv string

const (
	// ExecEnvMinimal, the default, passes only pipelines.ExecMinimalEnv
	// and the variables with a pipelines.ExecMinimalEnvPrefixes prefix: a
	// credential in the worker's environment reaches a command only when
	// its step names it in secrets.
	ExecEnvMinimal ExecEnv = "minimal"
	// ExecEnvInherit passes the worker's whole environment, as rlflow did
	// before secrets existed. Besides the secrets it knows, the worker then
	// masks the values of inherited variables whose names look like
	// credentials (credentialName); any other secret in its environment is
	// the command's to print.
	ExecEnvInherit ExecEnv = "inherit"
)

// ParseExecEnv parses an --exec-env value; "" is the default, minimal.
func ParseExecEnv(s string) (ExecEnv, error) {
	switch e := ExecEnv(strings.TrimSpace(s)); e {
	case "":
		return ExecEnvMinimal, nil
	case ExecEnvMinimal, ExecEnvInherit:
		return e, nil
	}
	return "", fmt.Errorf("exec environment %q: want %s (the default: only the variables a trainer needs, and the step's secrets) or %s (the worker's whole environment)",
		s, ExecEnvMinimal, ExecEnvInherit)
}

func (a *Activities) environ() []string {
	if a.Environ != nil {
		return a.Environ()
	}
	return os.Environ()
}

// inherits reports whether the command gets the worker's whole environment.
func (a *Activities) inherits() bool { return a.ExecEnv == ExecEnvInherit }

// inMinimalEnv reports whether the minimal exec environment passes the
// worker's variable name.
func inMinimalEnv(name string) bool {
	if slices.Contains(pipelines.ExecMinimalEnv, name) {
		return true
	}
	for _, p := range pipelines.ExecMinimalEnvPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// credentialWords are the words of a variable name (split at "_") that
// mark its value a credential: OPENAI_API_KEY, HF_TOKEN,
// AWS_SECRET_ACCESS_KEY, PGPASSWORD's spelled-out kin.
var credentialWords = []string{"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}

func credentialName(name string) bool {
	for _, w := range strings.Split(strings.ToUpper(name), "_") {
		if slices.Contains(credentialWords, w) {
			return true
		}
	}
	return false
}

// learnSecrets reads the step's secrets from the worker's environment and
// adds them to the worker's masker, with the API keys of the pipeline's
// servers (a command could print one it got some other way) and, when the
// command inherits the environment, every credential-like variable. A
// requested secret that is unset or too short to mask fails the step,
// named, before anything runs.
func (a *Activities) learnSecrets(ctx context.Context, in ExecInput) error {
	if err := pipelines.CheckExecSecrets(in.Secrets, in.Env); err != nil {
		return badInput(ctx, "exec: secrets: %v", err)
	}
	for _, name := range in.Secrets {
		v := a.getenv(name)
		switch {
		case v == "":
			return badInput(ctx, "exec: secrets: %s is not set in the worker's environment (set it where the worker starts, or remove it from the step's secrets)", name)
		case !a.secrets.Add(v):
			return badInput(ctx, "exec: secrets: %s is shorter than %d bytes, too short to be masked in logs and errors; pass a value that short in env instead", name, redact.MinLen)
		}
	}
	for _, s := range in.Context.Servers {
		if s.APIKeyEnv != "" {
			a.secrets.Add(a.getenv(s.APIKeyEnv))
		}
	}
	if a.inherits() {
		for _, kv := range a.environ() {
			if k, v, ok := strings.Cut(kv, "="); ok && credentialName(k) {
				a.secrets.Add(v)
			}
		}
	}
	return nil
}

// commandEnv is the attempt's command's environment, in order (a later
// entry wins): the worker's variables (minimal or all), the step's
// secrets, rlflow's RLFLOW_* variables, the step's env. The caller appends
// the attempt's tag last. learnSecrets has checked and learnt the secrets.
func (a *Activities) commandEnv(in ExecInput, outputsPath string, attempt int) ([]string, error) {
	sc := in.Context
	return a.processEnv(in,
		"RLFLOW_OUTPUTS="+outputsPath,
		"RLFLOW_PIPELINE="+sc.Pipeline,
		"RLFLOW_RUN_ID="+sc.RunID,
		"RLFLOW_ITERATION="+strconv.Itoa(sc.Iteration),
		"RLFLOW_STEP="+sc.StepID,
		"RLFLOW_ATTEMPT="+strconv.Itoa(attempt),
	)
}

// processEnv is the environment of a process rlflow starts for a step (an
// exec command, the resident trainer), in order (a later entry wins): the
// worker's variables (minimal or all), in's secrets, rlflow's variables,
// in's env.
func (a *Activities) processEnv(in ExecInput, rlflowVars ...string) ([]string, error) {
	var env []string
	for _, kv := range a.environ() {
		if k, _, ok := strings.Cut(kv, "="); ok && (a.inherits() || inMinimalEnv(k)) {
			env = append(env, kv)
		}
	}
	for _, name := range in.Secrets {
		v := a.getenv(name)
		if v == "" {
			return nil, fmt.Errorf("secret %s left the worker's environment while the step started", name)
		}
		env = append(env, name+"="+v)
	}
	env = append(env, rlflowVars...)
	keys := make([]string, 0, len(in.Env))
	for k := range in.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+in.Env[k])
	}
	return env, nil
}
