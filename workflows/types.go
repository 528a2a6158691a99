// Package workflows is rlflow's deterministic pipeline interpreter.
//
// RunPipeline (registered as rlflow.Pipeline) is the long-running parent:
// it owns the loop, starts one RunIteration (rlflow.Iteration) child
// workflow per iteration, evaluates `until`, and continues as new every
// Loop.ContinueAsNewEvery iterations so that its history stays bounded.
// RunIteration runs one pass over the step DAG, calling activities by their
// registered name (the step's `uses`).
//
// Every run validates its input on the worker before anything runs, however
// it was started (rlflow run, the Temporal UI, a schedule) and again after
// continue-as-new: RunPipeline decodes it strictly and has the spec checked
// by the loader of `rlflow validate` (ValidateSpecActivity, or
// LoadPipelineActivity for spec_path); RunIteration runs only as its child.
//
// Invariants: workflow code here never performs I/O, never reads the clock
// or randomness except through the workflow API, and iterates maps only in
// sorted order (make lint runs Temporal's workflowcheck on it). It imports
// only pipelines: activities are called by name with the rendered `with`,
// error types and defaults come from the pipelines registry. Payloads carry
// paths, ids and small metrics only.
package workflows

import (
	"encoding/json"
	"slices"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/temporal"
)

// Registered names. They are part of rlflow's public interface: the Temporal
// UI's "start workflow" form, schedules and replay histories refer to them.
const (
	PipelineWorkflow  = "rlflow.Pipeline"
	IterationWorkflow = "rlflow.Iteration"

	// QueryProgress answers a Progress on both workflows.
	QueryProgress = "progress"
	// SignalPause stops new steps (and iterations) from starting; running
	// steps finish. SignalResume undoes it. Cancellation is Temporal's own
	// (rlflow cancel, or the UI's cancel button): running steps are cancelled
	// and `always` steps still run.
	SignalPause  = "pause"
	SignalResume = "resume"

	// LoadPipelineActivity loads and validates a pipeline file on the worker,
	// for runs started with a spec_path (from the Temporal UI, say).
	LoadPipelineActivity = "load_pipeline"
	// ValidateSpecActivity validates a pipeline given inline (spec) on the
	// worker with the loader `rlflow validate` uses (pipelines.LoadJSON),
	// for every run, whoever started it, and again after continue-as-new.
	// It takes the spec's JSON text as []byte and returns the loaded
	// *pipelines.Pipeline, or fails with a non-retryable BadInput.
	ValidateSpecActivity = "validate_spec"

	// DefaultTaskQueue is the control worker's task queue.
	DefaultTaskQueue = "rlflow"
)

// Search attributes every pipeline run sets on itself (those its namespace
// has registered), so runs can be filtered and sorted in the UI.
var (
	SearchPipeline  = temporal.NewSearchAttributeKeyKeyword("RlflowPipeline")
	SearchIteration = temporal.NewSearchAttributeKeyInt64("RlflowIteration")
	// SearchStatus holds Run* (RunRunning, RunPaused, ...).
	SearchStatus = temporal.NewSearchAttributeKeyKeyword("RlflowStatus")
	// SearchHeadline is the latest value of the pipeline's metrics.headline.
	SearchHeadline = temporal.NewSearchAttributeKeyFloat64("RlflowHeadline")
)

// SearchAttributeTypes lists the search attributes a namespace must have
// registered (name -> Temporal type name) before runs set them.
var SearchAttributeTypes = map[string]string{
	"RlflowPipeline":  "Keyword",
	"RlflowIteration": "Int",
	"RlflowStatus":    "Keyword",
	"RlflowHeadline":  "Double",
}

// PipelineInput starts a pipeline run: its JSON is the run's input, as the
// Temporal UI's start form, a schedule or `rlflow run` gives it. Exactly
// one of Spec or SpecPath is set by a caller; the continue-as-new fields
// are rlflow's own, and a run that was not continued from another refuses
// them. RunPipeline takes the input as JSON and decodes it strictly itself
// (decodeInput): an unknown field or a value of the wrong type is a
// non-retryable BadInput naming the field, and the spec, however it came,
// is validated on the worker before anything runs.
type PipelineInput struct {
	// Spec is the pipeline as JSON: a pipeline file's keys and values
	// (pipelines.LoadJSON), with base_dir required. A *pipelines.Pipeline
	// encodes as exactly that.
	Spec *pipelines.Pipeline `json:"spec,omitempty"`
	// SpecPath is a pipeline file the worker can read; it is loaded once, by
	// an activity, and frozen in history from then on.
	SpecPath string `json:"spec_path,omitempty"`
	// Params are launch values (JSON types); missing ones take defaults.
	Params map[string]any `json:"params,omitempty"`
	// SearchAttributes is read only by runs started before the visibility
	// change (it told them to upsert); a run now asks its namespace which
	// Rlflow* search attributes it has (SearchAttributesActivity) and sets
	// those, whoever started it. Still accepted from existing starters.
	SearchAttributes bool `json:"search_attributes,omitempty"`

	// Carried across continue-as-new.
	NextIteration int                `json:"next_iteration,omitempty"`
	Paused        bool               `json:"paused,omitempty"`
	Recent        []IterationSummary `json:"recent,omitempty"`
	// GPUHost is the GPU worker the last iteration's transfer steps ran on
	// (nccl only): the next iteration starts there, reusing its group.
	GPUHost *GPUHost `json:"gpu_host,omitempty"`
	// Weights are what the run's last broadcast loaded into the servers:
	// generate and evaluate check that every server still serves them.
	Weights *pipelines.ExpectedWeights `json:"weights,omitempty"`
	// VLLM is what the run learned of every vLLM server it talked to
	// (version, API generation), latest first seen order.
	VLLM []pipelines.VLLMServer `json:"vllm,omitempty"`
}

// PipelineResult is the outcome of a finished run.
type PipelineResult struct {
	Pipeline   string             `json:"pipeline"`
	Iterations int                `json:"iterations"`
	StoppedBy  string             `json:"stopped_by"` // "iterations", "until", "max_iterations"
	Recent     []IterationSummary `json:"recent,omitempty"`
	// VLLM is every vLLM server the run talked to: URL, vLLM version and
	// weight-transfer API generation.
	VLLM []pipelines.VLLMServer `json:"vllm,omitempty"`
}

// IterationInput runs one iteration of the DAG.
type IterationInput struct {
	Spec      *pipelines.Pipeline `json:"spec"`
	Params    map[string]any      `json:"params,omitempty"`
	Iteration int                 `json:"iteration"`
	// RunID is the parent pipeline's workflow id: it names log directories and
	// lets steps group state (a transfer group) per pipeline run.
	RunID  string `json:"run_id"`
	Paused bool   `json:"paused,omitempty"`
	// GPUHost is the GPU worker acquired by an earlier iteration (nccl
	// only); nil means acquire one before the first GPU step.
	GPUHost *GPUHost `json:"gpu_host,omitempty"`
	// Weights are what an earlier iteration's last broadcast loaded into
	// the servers; nil before the run's first sync.
	Weights *pipelines.ExpectedWeights `json:"weights,omitempty"`
}

// IterationResult lists every step's final state, in file order.
type IterationResult struct {
	Iteration int          `json:"iteration"`
	Steps     []StepResult `json:"steps"`
	// GPUHost is the GPU worker the next iteration should use: the one the
	// last GPU step succeeded on (or the input's, when none ran); nil when
	// the routing is off or the host was lost and not replaced.
	GPUHost *GPUHost `json:"gpu_host,omitempty"`
	// Weights are what the servers serve after this iteration: its last
	// successful broadcast's, or the input's when none ran.
	Weights *pipelines.ExpectedWeights `json:"weights,omitempty"`
	// VLLM is what this iteration's steps learned of the servers they
	// talked to (their pipelines.MetaVLLM metadata).
	VLLM []pipelines.VLLMServer `json:"vllm,omitempty"`
}

// IterationSummary is what the parent keeps of a finished iteration: small.
type IterationSummary struct {
	Iteration  int                       `json:"iteration"`
	WorkflowID string                    `json:"workflow_id"`
	Status     string                    `json:"status"`
	Outputs    map[string]map[string]any `json:"outputs,omitempty"`
}

// Step states.
const (
	StatusPending   = "pending"
	StatusRunning   = "running"
	StatusSucceeded = "succeeded"
	StatusFailed    = "failed"
	StatusSkipped   = "skipped"
	StatusCancelled = "cancelled"
)

// StepResult is one step's state, as the progress query and results show it.
type StepResult struct {
	ID      string         `json:"id"`
	Uses    string         `json:"uses"`
	Status  string         `json:"status"`
	Outputs map[string]any `json:"outputs,omitempty"`
	// Attempts is the attempt that produced the final result (0 = unknown,
	// e.g. a timeout, whose attempt Temporal does not report back).
	Attempts int `json:"attempts,omitempty"`
	// Seconds is how long the step took, from its start to its result
	// (workflow time, every attempt included); 0 until it finished.
	Seconds float64 `json:"seconds,omitempty"`
	Error   string  `json:"error,omitempty"`
	Reason  string  `json:"reason,omitempty"` // why a step was skipped
	// GPUHost is the GPU worker a routed step runs (or last ran) on; a step
	// that moved to another worker after a loss shows the last one.
	GPUHost *GPUHost `json:"gpu_host,omitempty"`
	// Resyncs counts the times the interpreter re-synced servers found on
	// stale weights by this step, and ran it again.
	Resyncs int `json:"resyncs,omitempty"`
}

// Progress answers QueryProgress.
type Progress struct {
	Pipeline string `json:"pipeline"`
	// Iteration is the iteration running now (or last run, when done).
	Iteration      int          `json:"iteration"`
	IterationsDone int          `json:"iterations_done"`
	Paused         bool         `json:"paused"`
	Status         string       `json:"status"`
	Child          string       `json:"child,omitempty"` // running iteration's workflow id
	Steps          []StepResult `json:"steps,omitempty"` // iteration workflows only
	LastError      string       `json:"last_error,omitempty"`
	// GPUHost is the GPU worker the run's transfer steps use (nccl only).
	GPUHost *GPUHost `json:"gpu_host,omitempty"`
}

// GPU routing. With weight_transfer.backend nccl, init_transfer and
// broadcast must reach the one process that owns the NCCL communicator.
// GPU workers poll the shared GPU task queue (weight_transfer.gpu_task_queue,
// default pipelines.DefaultGPUTaskQueue) for AcquireGPUActivity, which
// answers with the worker's own host-specific task queue; the interpreter
// then sends the transfer steps there, and acquires again (on a live GPU
// worker) when that queue stops answering or the step fails with
// pipelines.ErrTypeGPUWorkerLost (its worker's GPU cannot serve the run).
// A step fails with pipelines.ErrTypeGPUUnavailable when no GPU worker
// could be acquired within the bounds below.
const AcquireGPUActivity = "gpu_acquire"

// GPU routing bounds.
//
// A GPU step waits weight_transfer.gpu_start_timeout (default
// pipelines.DefaultGPUStartTimeout)
// on its worker's host queue: nobody polls a dead worker's queue, so the
// ScheduleToStart timeout is how the interpreter notices the loss. A GPU
// step that sets no heartbeat gets DefaultGPUHeartbeat, so a worker dying
// mid-step is noticed in seconds, not after the step's 2h timeout; GPU
// activities must therefore heartbeat more often than that.
//
// Acquiring waits GPUAcquireWait per attempt on the shared GPU queue (a
// ScheduleToStart timeout, which Temporal never retries, so the
// interpreter does) for up to GPUAcquireAttempts attempts: 15 minutes for
// an operator to start or restart a GPU worker before the step fails
// with pipelines.ErrTypeGPUUnavailable. Waiting on a queue costs no
// resources, only two history events per minute.
const (
	DefaultGPUHeartbeat = 30 * time.Second
	GPUAcquireWait      = time.Minute
	GPUAcquireAttempts  = 15
	// GPUAcquireRunTimeout bounds gpu_acquire once a worker picked it up: it
	// only answers with its queue name.
	GPUAcquireRunTimeout = 30 * time.Second
)

// GPUAcquireInput asks a GPU worker for its host-specific task queue.
type GPUAcquireInput struct {
	RunID string `json:"run_id"`
	// Lost is the host queue of the worker this acquire replaces: one that
	// stopped answering, or one alive whose device or communicator failed
	// the run (that worker refuses the acquire).
	Lost string `json:"lost,omitempty"`
}

// GPUHost is a GPU worker's answer to AcquireGPUActivity.
type GPUHost struct {
	// TaskQueue is polled only by that worker process; it is unique per
	// process start, so a restarted worker never inherits a dead one's queue.
	TaskQueue string `json:"task_queue"`
	Host      string `json:"host"`
	Device    int    `json:"device"`
}

// mergeVLLM records what was learned of servers: an entry replaces the one
// for its URL (in place), new URLs are appended; entries without a URL are
// dropped.
func mergeVLLM(known, learned []pipelines.VLLMServer) []pipelines.VLLMServer {
	for _, l := range learned {
		if l.URL == "" {
			continue
		}
		i := slices.IndexFunc(known, func(k pipelines.VLLMServer) bool { return k.URL == l.URL })
		if i < 0 {
			if len(known) < maxVLLMRecords {
				known = append(known, l)
			}
			continue
		}
		if l.Version == "" && l.API == "" && known[i].Version != "" {
			continue // a failed reading does not erase a good one
		}
		known[i] = l
	}
	return known
}

// vllmMeta decodes a step's pipelines.MetaVLLM metadata; nil when absent
// or malformed (it is a record, never a reason to fail).
func vllmMeta(out map[string]any) []pipelines.VLLMServer {
	raw, ok := out[pipelines.MetaVLLM]
	if !ok {
		return nil
	}
	b, err := json.Marshal(raw)
	if err != nil {
		return nil
	}
	var v []pipelines.VLLMServer
	if json.Unmarshal(b, &v) != nil {
		return nil
	}
	return v
}
