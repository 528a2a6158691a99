// Package pipelines defines the rlflow pipeline schema, loads and validates
// pipeline YAML files (Load) and the same pipelines written as JSON in a
// run's input (LoadJSON, the same checks and messages), and evaluates the
// ${{ }} expressions in them.
//
// The step registry (steptypes*.go: each argument's kind, range, enum and
// default; scorer.go: the scorer keys), the schema tables (schema.go), the
// defaults (defaults.go) and the error types (errtypes.go) are each the one
// source of what they describe: Load, JSONSchema, Reference and, through
// ResolveArgs and ParseScorer, the activities all read them.
//
// Invariants: a *Pipeline returned by Load has passed every static check
// (schema, per-type arguments, DAG, expression references and constant
// arithmetic) and fits Temporal's limits (MaxSpecBytes, MaxRunSpecBytes,
// int32 counts, durations Temporal can multiply), so the workflow
// interpreter can trust step ids, needs and expression syntax. Expressions
// never yield NaN or an infinity: arithmetic is checked (arith.go). A Pipeline is
// plain data that round-trips through JSON unchanged: it is the workflow input
// frozen in Temporal history, so it must never hold weights, rollouts or
// secrets (secrets are named by environment variable, never stored). Its
// JSON is a pipeline file's keys and values, which LoadJSON loads back.
package pipelines

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"
)

var durationSyntaxRe = regexp.MustCompile(durationRe)

// SchemaVersion is the only pipeline format version this build understands.
const SchemaVersion = 1

// Pipeline is a validated pipeline: a DAG of steps run once per loop iteration.
type Pipeline struct {
	Version     int    `json:"version" yaml:"version"`
	Name        string `json:"name" yaml:"name"`
	Description string `json:"description,omitempty" yaml:"description,omitempty"`
	// BaseDir is the absolute directory relative paths in step arguments are
	// resolved against. Load sets it to the pipeline file's directory unless
	// the file sets it.
	BaseDir string `json:"base_dir,omitempty" yaml:"base_dir,omitempty"`
	// Params are declared in file order; values are supplied at launch.
	Params         ParamList       `json:"params,omitempty" yaml:"-"`
	Servers        []Server        `json:"servers,omitempty" yaml:"servers,omitempty"`
	WeightTransfer *WeightTransfer `json:"weight_transfer,omitempty" yaml:"weight_transfer,omitempty"`
	Trainer        *Trainer        `json:"trainer,omitempty" yaml:"trainer,omitempty"`
	Loop           Loop            `json:"loop" yaml:"loop"`
	// Metrics names the outputs the Temporal UI shows and sorts runs by.
	Metrics *Metrics `json:"metrics,omitempty" yaml:"metrics,omitempty"`
	// MaxParallel bounds how many steps of one iteration run at once (0 = unbounded).
	MaxParallel int          `json:"max_parallel,omitempty" yaml:"max_parallel,omitempty"`
	Defaults    StepDefaults `json:"defaults" yaml:"defaults"`
	Steps       []Step       `json:"steps" yaml:"steps"`
}

// ParamType names the type of a launch parameter.
type ParamType string

const (
	ParamString   ParamType = "string"
	ParamInt      ParamType = "int"
	ParamFloat    ParamType = "float"
	ParamBool     ParamType = "bool"
	ParamDuration ParamType = "duration"
)

// Param declares one launch parameter. Default holds a value already coerced
// to Type (string, int64, float64, bool, or a duration string).
type Param struct {
	Name        string    `json:"name"`
	Type        ParamType `json:"type"`
	Default     any       `json:"default,omitempty"`
	Required    bool      `json:"required,omitempty"`
	Description string    `json:"description,omitempty"`
}

// ParamList is a pipeline's params in file order. Its JSON is the file's
// form, a mapping from name to {type, default, required, description} in
// that order, so that a Pipeline's JSON is a pipeline file written as JSON,
// which LoadJSON reads back. It also decodes the list of {name, type, ...}
// objects that rlflow wrote into workflow input before, so that histories
// of runs started then still replay.
type ParamList []Param

// paramJSON is one param's value in the mapping.
type paramJSON struct {
	Type        ParamType `json:"type"`
	Default     any       `json:"default,omitempty"`
	Required    bool      `json:"required,omitempty"`
	Description string    `json:"description,omitempty"`
}

// MarshalJSON writes the params as the file's mapping, in file order.
func (l ParamList) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, p := range l {
		if i > 0 {
			b.WriteByte(',')
		}
		k, err := json.Marshal(p.Name)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(paramJSON{Type: p.Type, Default: p.Default, Required: p.Required, Description: p.Description})
		if err != nil {
			return nil, fmt.Errorf("params.%s: %w", p.Name, err)
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON reads the mapping, keeping its order, or the older list.
// It trusts its input (a spec rlflow wrote); LoadJSON is the strict reader.
func (l *ParamList) UnmarshalJSON(data []byte) error {
	data = bytes.TrimSpace(data)
	switch {
	case string(data) == "null":
		*l = nil
		return nil
	case len(data) > 0 && data[0] == '[':
		var list []Param
		if err := json.Unmarshal(data, &list); err != nil {
			return err
		}
		*l = list
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return fmt.Errorf("params must be a mapping from param name to {type, default, required, description}")
	}
	out := ParamList{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return err
		}
		name, _ := t.(string)
		var v paramJSON
		if err := dec.Decode(&v); err != nil {
			return fmt.Errorf("params.%s: %w", clip(name), err)
		}
		out = append(out, Param{Name: name, Type: v.Type, Default: v.Default, Required: v.Required, Description: v.Description})
	}
	if _, err := dec.Token(); err != nil {
		return err
	}
	*l = out
	return nil
}

// Server is one vLLM instance. Control calls fan out to every server.
type Server struct {
	URL string `json:"url" yaml:"url"`
	// APIKeyEnv names the environment variable on the worker holding the
	// bearer token; the token itself never enters workflow input or history.
	APIKeyEnv string `json:"api_key_env,omitempty" yaml:"api_key_env,omitempty"`
	// API pins the weight-transfer API generation ("A".."E"); empty = probe.
	API string `json:"api,omitempty" yaml:"api,omitempty"`
}

// WeightTransfer configures how new weights reach the servers.
type WeightTransfer struct {
	Backend     string `json:"backend" yaml:"backend"` // BackendNCCL, BackendDisk or BackendIPC
	Packed      bool   `json:"packed,omitempty" yaml:"packed,omitempty"`
	BufferBytes int64  `json:"buffer_bytes,omitempty" yaml:"-"`
	NumBuffers  int    `json:"num_buffers,omitempty" yaml:"num_buffers,omitempty"`
	// Rendezvous is how each server gets the NCCL unique id (nccl only):
	// RendezvousAuto ("" before defaults), RendezvousTCPStore or
	// RendezvousUniqueID.
	Rendezvous string `json:"rendezvous,omitempty" yaml:"rendezvous,omitempty"`
	// GPUTaskQueue is the shared task queue the GPU workers of this pipeline
	// poll for gpu_acquire (nccl only; "" = DefaultGPUTaskQueue). Separate
	// queues keep two trainers' GPU pools apart.
	GPUTaskQueue string `json:"gpu_task_queue,omitempty" yaml:"gpu_task_queue,omitempty"`
	// GPUStartTimeout is how long a GPU step may wait on its worker's
	// host-specific queue before that worker is taken for dead and another
	// is acquired (nccl only; 0 = DefaultGPUStartTimeout).
	GPUStartTimeout Duration `json:"gpu_start_timeout,omitempty" yaml:"gpu_start_timeout,omitempty"`
}

// Trainer declares the run's resident trainer: a process the GPU worker
// starts, keeps up across iterations (model and optimizer stay on the GPU)
// and restarts from its last durable checkpoint when it dies. The train,
// publish and save_checkpoint steps call it (trainer/PROTOCOL.md).
type Trainer struct {
	Command []string          `json:"command" yaml:"command"`
	Dir     string            `json:"dir,omitempty" yaml:"dir,omitempty"`
	Env     map[string]string `json:"env,omitempty" yaml:"env,omitempty"`
	Secrets []string          `json:"secrets,omitempty" yaml:"secrets,omitempty"`
	// CheckpointDir holds the run's checkpoints and journal, under
	// <checkpoint_dir>/<run id>/; relative to base_dir.
	CheckpointDir string `json:"checkpoint_dir" yaml:"checkpoint_dir"`
	// CheckpointEvery: train saves a checkpoint after every iteration
	// that is a multiple of it (0 before defaults: DefaultCheckpointEvery).
	CheckpointEvery int `json:"checkpoint_every,omitempty" yaml:"checkpoint_every,omitempty"`
	// KeepCheckpoints bounds the ckpt-<n> directories kept: the newest
	// this many (LATEST's among them); 0 keeps every one.
	KeepCheckpoints int      `json:"keep_checkpoints,omitempty" yaml:"keep_checkpoints,omitempty"`
	StartTimeout    Duration `json:"start_timeout,omitempty" yaml:"start_timeout,omitempty"`
	KillGrace       Duration `json:"kill_grace,omitempty" yaml:"kill_grace,omitempty"`
}

// Metrics names a run's key outputs.
type Metrics struct {
	// Headline is "<step>.<output>": a numeric output whose latest value the
	// run publishes as its RlflowHeadline search attribute.
	Headline string `json:"headline,omitempty" yaml:"headline,omitempty"`
}

// HeadlineRef splits Metrics.Headline into its step id and output key; ok
// is false when no headline is set.
func (p *Pipeline) HeadlineRef() (step, output string, ok bool) {
	if p.Metrics == nil || p.Metrics.Headline == "" {
		return "", "", false
	}
	return strings.Cut(p.Metrics.Headline, ".")
}

// Loop says how many iterations run. Exactly one of Iterations or Until is set
// by a valid file; Iterations defaults to 1 when neither is.
type Loop struct {
	Iterations int `json:"iterations,omitempty" yaml:"iterations,omitempty"`
	// Until is an expression evaluated after each iteration; true stops the loop.
	Until         string `json:"until,omitempty" yaml:"until,omitempty"`
	MaxIterations int    `json:"max_iterations,omitempty" yaml:"max_iterations,omitempty"`
	// ContinueAsNewEvery is how many iterations one parent run executes before
	// it continues as new, keeping history bounded (0 = DefaultContinueAsNewEvery).
	ContinueAsNewEvery int `json:"continue_as_new_every,omitempty" yaml:"continue_as_new_every,omitempty"`
}

// DefaultContinueAsNewEvery keeps a parent run's history far below Temporal's
// limits: each iteration costs the parent about a dozen events.
const DefaultContinueAsNewEvery = 100

// StepDefaults apply to every step that does not set its own value.
type StepDefaults struct {
	Timeout   Duration     `json:"timeout,omitempty" yaml:"timeout,omitempty"`
	Heartbeat Duration     `json:"heartbeat,omitempty" yaml:"heartbeat,omitempty"`
	Retry     *RetryPolicy `json:"retry,omitempty" yaml:"retry,omitempty"`
	TaskQueue string       `json:"task_queue,omitempty" yaml:"task_queue,omitempty"`
}

// RetryPolicy mirrors Temporal's retry policy. MaxAttempts 0 means unlimited
// (Temporal's meaning); 1 means no retry. Load fills in a max_attempts the
// file leaves out (defaults.retry's, else DefaultMaxAttempts), so a 0 in a
// loaded spec was written. The intervals are at most MaxRetryInterval.
type RetryPolicy struct {
	MaxAttempts     int      `json:"max_attempts,omitempty" yaml:"max_attempts,omitempty"`
	InitialInterval Duration `json:"initial_interval,omitempty" yaml:"initial_interval,omitempty"`
	Backoff         float64  `json:"backoff,omitempty" yaml:"backoff,omitempty"`
	MaxInterval     Duration `json:"max_interval,omitempty" yaml:"max_interval,omitempty"`
	// NonRetryable lists error types that fail the step at once: step
	// error types of ErrorTypes (Load refuses others).
	NonRetryable []string `json:"non_retryable,omitempty" yaml:"non_retryable,omitempty"`
}

// Step is one node of the DAG.
type Step struct {
	ID    string   `json:"id" yaml:"id"`
	Uses  string   `json:"uses" yaml:"uses"`
	Needs []string `json:"needs,omitempty" yaml:"needs,omitempty"`
	// With holds the type-specific arguments; strings may contain ${{ }}
	// expressions, rendered by the interpreter just before the step runs.
	With map[string]any `json:"with,omitempty" yaml:"with,omitempty"`
	// When is a condition expression; false skips the step.
	When string `json:"when,omitempty" yaml:"when,omitempty"`
	// Always runs the step once its needs have finished, even if one failed,
	// was skipped, or the run is being cancelled.
	Always bool `json:"always,omitempty" yaml:"always,omitempty"`
	// Outputs declares the output keys a step with dynamic outputs (exec)
	// produces; expressions may only reference declared keys.
	Outputs   []string     `json:"outputs,omitempty" yaml:"outputs,omitempty"`
	Retry     *RetryPolicy `json:"retry,omitempty" yaml:"retry,omitempty"`
	Timeout   Duration     `json:"timeout,omitempty" yaml:"timeout,omitempty"`
	Heartbeat Duration     `json:"heartbeat,omitempty" yaml:"heartbeat,omitempty"`
	TaskQueue string       `json:"task_queue,omitempty" yaml:"task_queue,omitempty"`
}

// Duration is a time.Duration written as a Go duration string ("30s", "1h30m")
// in YAML and JSON, so specs typed into the Temporal UI stay readable.
type Duration time.Duration

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

func (d Duration) String() string { return time.Duration(d).String() }

// MarshalJSON writes the duration as a string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON accepts a duration string or a number of nanoseconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		v, err := ParseDuration(s)
		if err != nil {
			return err
		}
		*d = v
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("duration must be a string like \"30s\" or integer nanoseconds, got %s", b)
	}
	*d = Duration(n)
	return nil
}

// ParseDuration parses a Go duration string and rejects negative values.
func ParseDuration(s string) (Duration, error) {
	v, err := time.ParseDuration(s)
	if err != nil {
		if durationSyntaxRe.MatchString(strings.TrimLeft(s, "+-")) {
			// Well formed, so it failed on int64 nanoseconds.
			return 0, fmt.Errorf("duration %q is too long: the longest is %s", clip(s), time.Duration(math.MaxInt64))
		}
		return 0, fmt.Errorf("invalid duration %q (want e.g. 30s, 5m, 1h30m)", clip(s))
	}
	if v < 0 {
		return 0, fmt.Errorf("duration %q must not be negative", clip(s))
	}
	return Duration(v), nil
}

// StepByID returns the step with the given id.
func (p *Pipeline) StepByID(id string) (*Step, bool) {
	for i := range p.Steps {
		if p.Steps[i].ID == id {
			return &p.Steps[i], true
		}
	}
	return nil, false
}

// ContextArg is the reserved key under which the interpreter passes a
// step's StepContext to its activity, next to the rendered `with` values.
const ContextArg = "context"

// StepContext tells an activity which run, iteration and step it serves.
type StepContext struct {
	Pipeline  string `json:"pipeline"`
	RunID     string `json:"run_id"`
	Iteration int    `json:"iteration"`
	StepID    string `json:"step_id"`
	BaseDir   string `json:"base_dir,omitempty"`
	// Outputs are the step's declared output keys (exec): missing ones fail it.
	Outputs []string `json:"outputs,omitempty"`
	Servers []Server `json:"servers,omitempty"`
	// WeightTransfer is copied from the pipeline for transfer steps.
	WeightTransfer *WeightTransfer `json:"weight_transfer,omitempty"`
	// Trainer is copied from the pipeline for the steps that call it.
	Trainer *Trainer `json:"trainer,omitempty"`
	// Weights is what the run expects every server to serve: the version
	// and checkpoint of its last successful broadcast (carried across
	// iterations); nil before the run's first sync. Generate and evaluate
	// check it at their start and end.
	Weights *ExpectedWeights `json:"weights,omitempty"`
	// FleetPaused is true when the run paused the servers (a pause step
	// succeeded and no resume has since): a broadcast refuses a server it
	// finds unpaused, which was restarted or resumed behind the run's back.
	FleetPaused bool `json:"fleet_paused,omitempty"`
	// Rerun numbers the interpreter's runs of this step after a re-sync
	// (0: the first run). A re-run resumes the step's partial work as a
	// retried attempt does.
	Rerun int `json:"rerun,omitempty"`
}

// ExpectedWeights are the weights a run's last sync loaded into its servers.
type ExpectedWeights struct {
	Version    string `json:"version"`
	Checkpoint string `json:"checkpoint,omitempty"` // absolute, as the broadcast resolved it
	// TrainerIteration is set instead of Checkpoint when the resident
	// trainer published the weights: the iteration it had trained.
	TrainerIteration int `json:"trainer_iteration,omitempty"`
}

// StaleServers is the second detail of a StaleWeights error: the servers
// found on other weights, by index into the pipeline's servers.
type StaleServers struct {
	Indexes []int    `json:"indexes"`
	URLs    []string `json:"urls"`
}

// AttemptDetail is the first detail of every ApplicationError an activity
// returns, so the interpreter can report which attempt failed.
type AttemptDetail struct {
	Attempt int `json:"attempt"`
}

// MetaAttempt is the output key under which activities report the attempt
// that succeeded; "_"-prefixed keys are metadata, never outputs.
const MetaAttempt = "_attempt"

// MetaVLLM is the output key under which the steps that talk to vLLM
// servers report what they learned of each ([]VLLMServer): the run records
// it per server in its results and UI details.
const MetaVLLM = "_vllm"

// VLLMServer is what a run learned about one vLLM server it talked to.
type VLLMServer struct {
	URL string `json:"url"`
	// Version is the server's GET /version; "" when unreadable.
	Version string `json:"version,omitempty"`
	// API is its weight-transfer API generation ("A".."E"), as pinned or
	// probed; "" when unknown.
	API string `json:"api,omitempty"`
	// Error says why a fact is missing.
	Error string `json:"error,omitempty"`
}
