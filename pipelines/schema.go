package pipelines

import (
	"fmt"
	"math"
	"reflect"
	"regexp"
	"strings"

	"github.com/rlflow/rlflow/vllm"
)

// The tables below are the single description of the YAML schema: the
// decoder enforces them, and JSONSchema and Reference are generated from
// them, so the three cannot drift apart. Go types come from the structs in
// types.go, matched by JSON field name (which equals the YAML name).

// fieldKind marks fields whose YAML form the Go type alone does not say.
type fieldKind int

const (
	kindAuto      fieldKind = iota // derived from the Go type
	kindSize                       // int64 bytes, written as 1073741824 or "1GiB"
	kindParams                     // mapping name -> param
	kindWith                       // free-form mapping, checked per step type
	kindCondition                  // a string holding one expression
	kindAny                        // any YAML value (a param default)
)

// field describes one key of a YAML mapping.
type field struct {
	name     string
	doc      string
	required bool
	kind     fieldKind
	enum     []string
	pattern  *regexp.Regexp // for strings, or each string of a list
	maxLen   int
	min, max *float64 // inclusive bounds of a number
	minItems int      // for lists
	// check is a string's (or each list entry's) own test, in place of
	// the enum's generic message; it returns the problem or "".
	check func(s string) string
	// def is the value the code uses when the key is absent, typed as the
	// JSON Schema's "default" (Durations as such); defDoc states it in
	// words where there is no single value, or qualifies it.
	def    any
	defDoc string
	index  int // Go struct field index, resolved at init
}

// object describes one YAML mapping with a fixed set of keys.
type object struct {
	name   string // $defs name in the JSON Schema
	title  string // heading in the reference
	doc    string
	typ    reflect.Type
	fields []field
}

// spec is a number or duration field's bounds and default as an ArgSpec,
// so that fields and step arguments state and check them alike.
func (f *field) spec(t reflect.Type) ArgSpec {
	a := ArgSpec{Kind: KindInt, Min: f.min, Max: f.max, Default: f.def, DefaultDoc: f.defDoc}
	switch {
	case t == durationType:
		a.Kind = KindDuration
	case t.Kind() == reflect.Float64:
		a.Kind = KindFloat
	}
	return a
}

func (o *object) field(name string) *field {
	for i := range o.fields {
		if o.fields[i].name == name {
			return &o.fields[i]
		}
	}
	return nil
}

func (o *object) keyNames() []string {
	names := make([]string, len(o.fields))
	for i, f := range o.fields {
		names[i] = f.name
	}
	return names
}

// maxInt32 bounds counts that reach Temporal (MaximumAttempts is an
// int32) or are multiplied into one, so a file cannot overflow them.
const maxInt32 = math.MaxInt32

var (
	nameRe     = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]*$`)
	stepIDRe   = regexp.MustCompile(`^[a-z][a-z0-9_-]*$`)
	identRe    = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	headlineRe = regexp.MustCompile(`^[a-z][a-z0-9_-]*\.[A-Za-z_][A-Za-z0-9_]*$`)
	envVarRe   = identRe
	durationRe = `^(0|([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+$`
	sizeRe     = regexp.MustCompile(`^\s*([0-9]+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$`)
	paramTypes = []string{string(ParamString), string(ParamInt), string(ParamFloat), string(ParamBool), string(ParamDuration)}
	serverAPIs = func() []string {
		out := make([]string, len(vllm.Generations))
		for i, g := range vllm.Generations {
			out[i] = string(g)
		}
		return out
	}()
	transferKind = []string{BackendNCCL, BackendDisk, BackendIPC}
	// rendezvousKinds are weight_transfer.rendezvous's values.
	rendezvousKinds = []string{RendezvousAuto, RendezvousTCPStore, RendezvousUniqueID}
)

var retryObj = &object{
	name: "retry", title: "retry",
	doc: "A Temporal retry policy for a step's activity.",
	typ: reflect.TypeOf(RetryPolicy{}),
	fields: []field{
		{name: "max_attempts", min: bound(0), max: bound(maxInt32), defDoc: fmt.Sprintf("in a step's retry, defaults.retry's max_attempts; else %d, as for a step with no retry policy", DefaultMaxAttempts),
			doc: "attempts in all, the first included; 1 means no retry, and 0 (only when written) means unlimited, Temporal's meaning"},
		{name: "initial_interval", min: seconds(minTimeout), max: seconds(MaxRetryInterval), defDoc: "Temporal's, 1s", doc: "wait before the first retry"},
		{name: "backoff", min: bound(1), defDoc: "Temporal's, 2.0", doc: "factor the wait grows by after each retry"},
		{name: "max_interval", min: seconds(minTimeout), max: seconds(MaxRetryInterval), defDoc: "Temporal's, 100 × initial_interval", doc: "cap on the wait between retries; at least initial_interval"},
		{name: "non_retryable", enum: StepErrorTypes(), check: nonRetryableProblem, defDoc: "none",
			doc: "error types (see Error types) that fail the step at once, without retrying; " + joinNames(NonRetryableErrorTypes()) + " always do"},
	},
}

var defaultsObj = &object{
	name: "defaults", title: "defaults",
	doc: "Values for every step that does not set its own.",
	typ: reflect.TypeOf(StepDefaults{}),
	fields: []field{
		{name: "timeout", min: seconds(minTimeout), def: Duration(DefaultStepTimeout), doc: "start-to-close timeout of one attempt"},
		{name: "heartbeat", min: seconds(MinHeartbeat), defDoc: "none", doc: "heartbeat timeout; must be shorter than the timeout"},
		{name: "retry", defDoc: fmt.Sprintf("max_attempts %d, Temporal's intervals", DefaultMaxAttempts), doc: "retry policy"},
		{name: "task_queue", defDoc: "the pipeline workflow's task queue", doc: "Temporal task queue the step's activity is scheduled on"},
	},
}

var serverObj = &object{
	name: "server", title: "servers[]",
	doc: "One vLLM instance. Control calls (pause, resume, weight transfer) fan out to every server.",
	typ: reflect.TypeOf(Server{}),
	fields: []field{
		{name: "url", required: true, doc: "base URL, http or https; may use `${{ params.* }}` (only params), so one file serves any address given at launch"},
		{name: "api_key_env", pattern: envVarRe, defDoc: "none: no API key is sent", doc: "environment variable on the worker holding the API key; the key never enters workflow history"},
		{name: "api", enum: serverAPIs, defDoc: "probe the server", doc: "weight-transfer API generation"},
	},
}

var weightTransferObj = &object{
	name: "weight_transfer", title: "weight_transfer",
	doc: "How new weights reach the servers.",
	typ: reflect.TypeOf(WeightTransfer{}),
	fields: []field{
		{name: "backend", required: true, enum: transferKind, doc: "nccl broadcasts from the trainer's GPU; disk hands the servers a checkpoint path; ipc hands vLLM's ipc backend CUDA IPC handles of the resident trainer's weights (trainer and vLLM on one GPU; needs trainer:, publish steps only)"},
		{name: "packed", def: false, doc: "pack tensors into large buffers before broadcasting"},
		{name: "buffer_bytes", kind: kindSize, def: int64(DefaultPackedBufferBytes), doc: "packed: size of one packing buffer: bytes, or a number with B, KiB, MiB, GiB, KB, MB or GB"},
		{name: "num_buffers", min: bound(1), max: bound(maxInt32), def: int64(DefaultPackedNumBuffers), doc: "packed: packing buffers in flight"},
		{name: "rendezvous", enum: rendezvousKinds, def: RendezvousAuto, doc: "nccl: how each server gets the NCCL unique id: auto passes it in init_info.nccl_unique_id_b64 to servers of API generation E and through the trainer's TCPStore (pickled) to the others; tcpstore and unique_id force one way for every server (unique_id also suits the newest generation-D builds)"},
		{name: "gpu_task_queue", def: DefaultGPUTaskQueue, doc: "nccl and ipc: task queue the GPU workers poll for gpu_acquire"},
		{name: "gpu_start_timeout", def: Duration(DefaultGPUStartTimeout), doc: fmt.Sprintf("nccl and ipc: how long a GPU step waits for its worker to pick it up before the worker counts as lost and another is acquired; at least %s", MinGPUStartTimeout)},
	},
}

var trainerObj = &object{
	name: "trainer", title: "trainer",
	doc: "The run's resident trainer: a process the GPU worker starts on first use and keeps up across iterations, so model and optimizer stay on the GPU; the train, publish and save_checkpoint steps call it (protocol: trainer/PROTOCOL.md; a helper for any torch.nn.Module: trainer/python/rlflow_trainer.py). When it dies, the next step restarts it from its last checkpoint and replays the iterations trained since from their rollouts. Needs weight_transfer backend nccl.",
	typ: reflect.TypeOf(Trainer{}),
	fields: []field{
		{name: "command", required: true, minItems: 1, doc: "argv; the first element is the program, looked up in PATH (or relative to dir when it holds a /)"},
		{name: "dir", defDoc: "base_dir", doc: "working directory, relative to base_dir"},
		{name: "env", defDoc: "none", doc: "environment variables set for the trainer; their values are in the pipeline and so in history: name secrets in secrets"},
		{name: "secrets", pattern: envVarRe, defDoc: "none", doc: "names of variables of the GPU worker's environment the trainer gets with their values; masked as `***` in what the worker reports"},
		{name: "checkpoint_dir", required: true, doc: "directory of the durable checkpoints and the training journal, relative to base_dir; each run uses `<checkpoint_dir>/<run id>/`"},
		{name: "checkpoint_every", min: bound(1), max: bound(maxInt32), def: int64(DefaultCheckpointEvery), doc: "train saves a checkpoint after every iteration that is a multiple of this; a restart replays at most this many iterations less one"},
		{name: "keep_checkpoints", min: bound(0), max: bound(maxInt32), def: int64(0), doc: "keep only the newest this many checkpoints (ckpt-<n>), deleting older ones after each save; the one a restart loads is always kept; 0 keeps every one"},
		{name: "start_timeout", min: seconds(minTimeout), def: Duration(DefaultTrainerStartTimeout), doc: "deadline of starting the trainer: its process, hello and the load of its last checkpoint"},
		{name: "kill_grace", min: seconds(minTimeout), def: Duration(DefaultKillGrace), doc: "time between SIGTERM and SIGKILL when the trainer is stopped"},
	},
}

var loopObj = &object{
	name: "loop", title: "loop",
	doc: "How many times the DAG runs. Set iterations, or until with max_iterations; neither means one iteration.",
	typ: reflect.TypeOf(Loop{}),
	fields: []field{
		{name: "iterations", min: bound(1), max: bound(maxInt32), def: int64(1), defDoc: "without until", doc: "fixed number of iterations"},
		{name: "until", kind: kindCondition, doc: "condition checked after each iteration; true stops the loop. May reference any step"},
		{name: "max_iterations", min: bound(1), max: bound(maxInt32), doc: "bound on the iterations of an until loop (required with until)"},
		{name: "continue_as_new_every", min: bound(1), max: bound(MaxContinueAsNewEvery), def: int64(DefaultContinueAsNewEvery), doc: "iterations per workflow run before it continues as new; each run's history holds a copy of the pipeline per iteration, so a large pipeline may need fewer"},
	},
}

var metricsObj = &object{
	name: "metrics", title: "metrics",
	doc: "Outputs the Temporal UI shows for a run.",
	typ: reflect.TypeOf(Metrics{}),
	fields: []field{
		{name: "headline", pattern: headlineRe, doc: "`<step>.<output>`: a numeric output of a declared step (one its type produces or the step declares); its latest value is the run's `RlflowHeadline` search attribute (a Double), to filter and sort runs by, e.g. `eval.score`"},
	},
}

var paramObj = &object{
	name: "param", title: "params.<name>",
	doc: "A launch parameter, referenced as `${{ params.<name> }}`. Names are identifiers: `[A-Za-z_][A-Za-z0-9_]*`.",
	typ: reflect.TypeOf(Param{}),
	fields: []field{
		{name: "type", required: true, enum: paramTypes, doc: "value type; duration values are Go duration strings"},
		{name: "default", kind: kindAny, doc: "value used when the launch does not set one; must match type"},
		{name: "required", def: false, doc: "the launch must set a value; not allowed with a default"},
		{name: "description", doc: "shown in the CLI and the Temporal UI"},
	},
}

var stepObj = &object{
	name: "step", title: "steps[]",
	doc: "One node of the DAG: an activity of the type named by uses.",
	typ: reflect.TypeOf(Step{}),
	fields: []field{
		{name: "id", required: true, pattern: stepIDRe, maxLen: 100, doc: "unique step id: a lowercase letter, then lowercase letters, digits, _ or -"},
		{name: "uses", required: true, doc: "step type (see Step types)"},
		{name: "needs", defDoc: "none", doc: "ids of steps that must finish first"},
		{name: "with", kind: kindWith, doc: "arguments of the step type; strings may hold `${{ }}` expressions"},
		{name: "when", kind: kindCondition, doc: "condition; false skips the step. May reference upstream steps"},
		{name: "always", def: false, doc: "run once the needs have finished even if one failed or was skipped, or the run is cancelled"},
		{name: "outputs", pattern: identRe, doc: "output keys the step produces, for step types with declared outputs"},
		{name: "retry", defDoc: "defaults.retry", doc: "retry policy"},
		{name: "timeout", min: seconds(minTimeout), defDoc: "defaults.timeout", doc: "start-to-close timeout of one attempt"},
		{name: "heartbeat", min: seconds(MinHeartbeat), defDoc: "defaults.heartbeat", doc: "heartbeat timeout"},
		{name: "task_queue", defDoc: "defaults.task_queue", doc: "task queue"},
	},
}

var pipelineObj = &object{
	name: "pipeline", title: "Top level",
	doc: "A pipeline file holds one YAML document, a mapping with these keys.",
	typ: reflect.TypeOf(Pipeline{}),
	fields: []field{
		{name: "version", required: true, doc: fmt.Sprintf("schema version; must be %d", SchemaVersion)},
		{name: "name", required: true, pattern: nameRe, maxLen: 100, doc: "pipeline name: lowercase letters, digits, _, . or -, starting with a letter or digit"},
		{name: "description", doc: "free text"},
		{name: "base_dir", defDoc: "the file's directory", doc: "absolute directory relative paths resolve against"},
		{name: "params", kind: kindParams, doc: "launch parameters: a mapping from name to param"},
		{name: "servers", doc: "vLLM servers"},
		{name: "weight_transfer", doc: "weight transfer settings"},
		{name: "trainer", doc: "the resident trainer"},
		{name: "loop", doc: "iteration control"},
		{name: "metrics", doc: "the run's key outputs, shown in the Temporal UI"},
		{name: "max_parallel", min: bound(0), max: bound(maxInt32), def: int64(0), defDoc: "unbounded", doc: "most steps of one iteration running at once; 0 means unbounded"},
		{name: "defaults", doc: "step defaults"},
		{name: "steps", required: true, minItems: 1, doc: "the DAG's steps, in file order"},
	},
}

// objects is every schema object, in reference order.
var objects = []*object{pipelineObj, paramObj, serverObj, weightTransferObj, trainerObj, loopObj, metricsObj, defaultsObj, retryObj, stepObj}

var objectByType = map[reflect.Type]*object{}

func init() {
	for _, o := range objects {
		objectByType[o.typ] = o
		for i := range o.fields {
			f := &o.fields[i]
			idx, ok := jsonFieldIndex(o.typ, f.name)
			if !ok {
				// A programming error: the tables and types.go disagree.
				panic(fmt.Sprintf("pipelines: schema field %s.%s has no Go field", o.name, f.name))
			}
			f.index = idx
		}
	}
}

// jsonFieldIndex finds the struct field whose JSON name is name.
func jsonFieldIndex(t reflect.Type, name string) (int, bool) {
	for i := 0; i < t.NumField(); i++ {
		if jsonName(t.Field(i)) == name {
			return i, true
		}
	}
	return 0, false
}

func jsonName(f reflect.StructField) string {
	tag := f.Tag.Get("json")
	n, _, _ := strings.Cut(tag, ",")
	if n == "" {
		return f.Name
	}
	return n
}

var durationType = reflect.TypeOf(Duration(0))
