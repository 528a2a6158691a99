package pipelines

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/rlflow/rlflow/redact"
)

// ArgKind is the type a step argument must have after rendering.
type ArgKind string

const (
	KindString     ArgKind = "string"
	KindInt        ArgKind = "int"
	KindFloat      ArgKind = "float" // ints are accepted too
	KindBool       ArgKind = "bool"
	KindDuration   ArgKind = "duration" // a Go duration string
	KindStringList ArgKind = "list of strings"
	KindStringMap  ArgKind = "map of strings"
	KindObject     ArgKind = "object" // a mapping, checked by the step type itself
)

// StepType describes a registered `uses` value: its arguments and outputs.
// The activity implementing it is registered under the same name.
type StepType struct {
	Name string
	Doc  string
	Args []ArgSpec
	// Outputs lists the keys every successful run of the step returns.
	Outputs []string
	// DeclaredOutputs means the step also returns the keys listed in the
	// step's `outputs:` field (exec) and in its `with.outputs` mapping (noop).
	DeclaredOutputs bool
	// Validate runs extra checks on the raw `with` values that the kinds
	// cannot express; it returns problems keyed by argument name.
	Validate func(with map[string]any) map[string]string
	// NeedsServers: the step calls the pipeline's vLLM servers, so a
	// pipeline using it without servers: is invalid.
	NeedsServers bool
	// NeedsWeightTransfer: the step moves weights with the pipeline's
	// weight_transfer backend, so it must be configured.
	NeedsWeightTransfer bool
	// NeedsTrainer: the step calls the pipeline's resident trainer, so
	// trainer: must be declared.
	NeedsTrainer bool
}

// Arg returns the spec of the named argument.
func (t *StepType) Arg(name string) (ArgSpec, bool) {
	for _, a := range t.Args {
		if a.Name == name {
			return a, true
		}
	}
	return ArgSpec{}, false
}

// OutputsOf returns the output keys the given step of this type produces.
func (t *StepType) OutputsOf(s *Step) []string {
	out := append([]string(nil), t.Outputs...)
	if t.DeclaredOutputs {
		out = append(out, s.Outputs...)
		if m, ok := s.With["outputs"].(map[string]any); ok {
			for k := range m {
				out = append(out, k)
			}
		}
	}
	sort.Strings(out)
	return out
}

var stepTypes = map[string]*StepType{}

// RegisterStepType adds a step type; it panics on a duplicate name because
// that is a programming error caught at init.
func RegisterStepType(t *StepType) {
	if _, dup := stepTypes[t.Name]; dup {
		panic("pipelines: duplicate step type " + t.Name)
	}
	stepTypes[t.Name] = t
}

// LookupStepType returns the registered step type with that name.
func LookupStepType(name string) (*StepType, bool) {
	t, ok := stepTypes[name]
	return t, ok
}

// StepTypeNames returns every registered step type name, sorted.
func StepTypeNames() []string {
	names := make([]string, 0, len(stepTypes))
	for n := range stepTypes {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Step type names. The activity for each is registered under the same name.
const (
	StepExec = "exec"
	StepNoop = "noop"
)

// ExecMinimalEnv and ExecMinimalEnvPrefixes name the variables of the
// worker's environment an exec command gets by default (the worker's
// minimal exec environment): what finds programs, libraries, the locale
// and the GPUs, and nothing that holds a credential. A worker started with
// --exec-env inherit passes its whole environment instead.
var (
	ExecMinimalEnv = []string{"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
		"LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX"}
	ExecMinimalEnvPrefixes = []string{"LC_", "CUDA_", "NVIDIA_", "NCCL_"}
)

// execEnvDoc states an exec command's environment, from the lists above.
func execEnvDoc() string {
	prefixes := make([]string, len(ExecMinimalEnvPrefixes))
	for i, p := range ExecMinimalEnvPrefixes {
		prefixes[i] = p + "*"
	}
	return "The command's environment is the worker's " + strings.Join(ExecMinimalEnv, ", ") + " and " + strings.Join(prefixes, ", ") +
		" (its whole environment when the worker runs with --exec-env inherit), then each variable named in secrets with its value from the worker's environment, " +
		"then RLFLOW_OUTPUTS, RLFLOW_PIPELINE, RLFLOW_RUN_ID, RLFLOW_ITERATION, RLFLOW_STEP, RLFLOW_ATTEMPT, then env. " +
		"The worker masks every secret it holds (secrets and the servers' api_key_env keys) as `***` in the log tail of a failed step's error, in outputs (and in the outputs file on its disk), and in every error and result it reports; " +
		"the attempt's log file on the worker's disk keeps what the command wrote."
}

// CheckExecSecrets checks an exec step's secrets: each an environment
// variable name, none listed twice, none also a key of env (whose values
// are in the pipeline, and so in history).
func CheckExecSecrets(secrets []string, env map[string]string) error {
	var probs []string
	seen := map[string]bool{}
	for i, name := range secrets {
		switch {
		case !envVarRe.MatchString(name):
			probs = append(probs, fmt.Sprintf("item %d: must name an environment variable (%s), got %s", i, strings.Trim(envVarRe.String(), "^$"), describeValue(name)))
		case seen[name]:
			probs = append(probs, fmt.Sprintf("item %d: %s is listed twice", i, name))
		default:
			if _, ok := env[name]; ok {
				probs = append(probs, fmt.Sprintf("item %d: %s is also set in env; a variable is either a secret from the worker's environment or a value in the pipeline, not both", i, name))
			}
		}
		seen[name] = true
	}
	if len(probs) > 0 {
		return errors.New(strings.Join(probs, "; "))
	}
	return nil
}

// validateExec holds secrets to literal names: which of the worker's
// secrets a pipeline reads is then visible in its file, never chosen by a
// parameter or an earlier step's output.
func validateExec(with map[string]any) map[string]string {
	raw, ok := with["secrets"]
	if !ok {
		return nil
	}
	list, ok := raw.([]any)
	if !ok {
		return map[string]string{"secrets": "must list variable names literally, not as a ${{ }} expression: the secrets a pipeline reads are visible in its file"}
	}
	names := make([]string, len(list))
	for i, e := range list {
		names[i], _ = e.(string)
		if strings.Contains(names[i], "${{") {
			return map[string]string{"secrets": fmt.Sprintf("item %d: must be a variable name, not a ${{ }} expression: the secrets a pipeline reads are visible in its file", i)}
		}
	}
	env := map[string]string{}
	if m, ok := with["env"].(map[string]any); ok {
		for k := range m {
			env[k] = ""
		}
	}
	if err := CheckExecSecrets(names, env); err != nil {
		return map[string]string{"secrets": err.Error()}
	}
	return nil
}

func init() {
	RegisterStepType(&StepType{
		Name: StepExec,
		Doc:  "Runs a command (argv list). Output keys are read from key=value lines the command writes to the file named by $RLFLOW_OUTPUTS. " + execEnvDoc(),
		Args: []ArgSpec{
			{Name: "command", Kind: KindStringList, Required: true, MinItems: 1, Doc: "argv; the first element is the program, looked up in PATH"},
			{Name: "env", Kind: KindStringMap, DefaultDoc: "none", Doc: "environment variables set for the command, over the worker's; their values are in the pipeline and so in the run's history: never put a secret here, name it in secrets"},
			{Name: "secrets", Kind: KindStringList, DefaultDoc: "none", Doc: "names of variables of the worker's environment the command gets with their values (HF_TOKEN, WANDB_API_KEY): a secret's value never enters history and is masked as `***` in what the worker reports. " +
				fmt.Sprintf("Names are literal (no ${{ }}), listed once, not also in env; a named variable unset (or empty) in the worker's environment, or shorter than %d bytes (too short to mask), fails the step with BadInput", redact.MinLen)},
			{Name: "dir", Kind: KindString, DefaultDoc: "base_dir", Doc: "working directory, relative to the pipeline's base_dir"},
			{Name: "kill_grace", Kind: KindDuration, Min: seconds(minTimeout), Default: Duration(DefaultKillGrace), Doc: "time between SIGTERM and SIGKILL on cancel"},
		},
		Outputs:         []string{"exit_code", "log"},
		DeclaredOutputs: true,
		Validate:        validateExec,
	})
	RegisterStepType(&StepType{
		Name: StepNoop,
		Doc:  "Returns the mapping in with.outputs as its outputs, after an optional sleep. For wiring values between steps, tests and overhead benchmarks.",
		Args: []ArgSpec{
			{Name: "outputs", Kind: KindObject, DefaultDoc: "none", Doc: "output key -> value"},
			{Name: "sleep", Kind: KindDuration, Min: bound(0), Default: Duration(0), Doc: "how long to wait before returning (heartbeating)"},
		},
		DeclaredOutputs: true,
	})
}
