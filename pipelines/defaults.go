package pipelines

import "time"

// The defaults and bounds below are the single source for the loader, the
// JSON Schema, the reference and the packages that run pipelines: the
// interpreter (workflows), the activities and the GPU worker use these
// constants (or the ArgSpec Defaults built from them through ResolveArgs)
// instead of keeping their own copies. Durations are time.Duration so that
// callers compare and pass them without conversions; the specs wrap them in
// Duration.

// Weight-transfer backends (weight_transfer.backend).
const (
	// BackendNCCL broadcasts the weights from the trainer's GPU worker.
	BackendNCCL = "nccl"
	// BackendDisk hands the servers a checkpoint path on shared disk.
	BackendDisk = "disk"
)

// Step and GPU-routing defaults, applied by the interpreter when the file
// sets nothing.
const (
	// DefaultStepTimeout is a step attempt's start-to-close timeout when
	// neither the step nor defaults set one: long enough for a training
	// step, short enough that a forgotten timeout cannot hang a run forever.
	DefaultStepTimeout = 2 * time.Hour
	// DefaultMaxAttempts is a step's attempts when neither the step nor
	// defaults set a retry policy.
	DefaultMaxAttempts = 3
	// DefaultGPUTaskQueue is the task queue GPU workers poll for gpu_acquire
	// (weight_transfer.gpu_task_queue).
	DefaultGPUTaskQueue = "rlflow-gpu"
	// DefaultGPUStartTimeout is how long a GPU step waits on its worker's
	// host queue before the worker counts as lost
	// (weight_transfer.gpu_start_timeout).
	DefaultGPUStartTimeout = 30 * time.Second
)

// Packed NCCL transfer defaults: vLLM's own (weight_transfer.buffer_bytes,
// num_buffers).
const (
	DefaultPackedBufferBytes = 1 << 30
	DefaultPackedNumBuffers  = 2
)

// The deadlines of calls to the servers default to the vLLM client's
// (vllm.DefaultControlTimeout for control steps, DefaultGenerateTimeout
// for a request and for pause with mode wait, DefaultInitTimeout for
// init_transfer, vllm.UpdateTimeoutFor for update_weights): the step
// arguments that set them name those constants rather than copy them.

// DefaultKillGrace is exec's wait between SIGTERM and SIGKILL.
const DefaultKillGrace = 10 * time.Second

// Bounds of step arguments.
const (
	// MaxConcurrency bounds generate's and evaluate's requests in flight.
	MaxConcurrency = 1024
	// MaxSamples bounds generate's and evaluate's samples per prompt (n).
	MaxSamples = 1024
	// MaxScorerConcurrency bounds a scorer's requests in flight.
	MaxScorerConcurrency = 1024
	// minTimeout is the least every timeout-like argument accepts: a zero
	// duration would silently mean "the default", so it is refused.
	minTimeout = time.Millisecond
)
