package pipelines

import "sort"

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

func init() {
	RegisterStepType(&StepType{
		Name: StepExec,
		Doc:  "Runs a command (argv list). Output keys are read from key=value lines the command writes to the file named by $RLFLOW_OUTPUTS.",
		Args: []ArgSpec{
			{Name: "command", Kind: KindStringList, Required: true, MinItems: 1, Doc: "argv; the first element is the program, looked up in PATH"},
			{Name: "env", Kind: KindStringMap, DefaultDoc: "none: the worker's environment is inherited", Doc: "extra environment variables"},
			{Name: "dir", Kind: KindString, DefaultDoc: "base_dir", Doc: "working directory, relative to the pipeline's base_dir"},
			{Name: "kill_grace", Kind: KindDuration, Min: seconds(minTimeout), Default: Duration(DefaultKillGrace), Doc: "time between SIGTERM and SIGKILL on cancel"},
		},
		Outputs:         []string{"exit_code", "log"},
		DeclaredOutputs: true,
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
