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
	// BackendIPC hands vLLM's ipc backend CUDA IPC handles of the resident
	// trainer's device snapshot: trainer and vLLM worker share a GPU, and
	// vLLM copies the weights device to device (publish steps only).
	BackendIPC = "ipc"
)

// OnGPUWorker reports whether the backend's transfer steps run on the
// trainer's GPU worker (nccl broadcasts from it; ipc hands out its
// trainer's memory); a nil WeightTransfer has none.
func (wt *WeightTransfer) OnGPUWorker() bool {
	return wt != nil && (wt.Backend == BackendNCCL || wt.Backend == BackendIPC)
}

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

	// weight_transfer.rendezvous values.
	RendezvousAuto     = "auto"
	RendezvousTCPStore = "tcpstore"
	RendezvousUniqueID = "unique_id"
)

// The deadlines of calls to the servers default to the vLLM client's
// (vllm.DefaultControlTimeout for control steps, DefaultGenerateTimeout
// for a request and for pause with mode wait, DefaultInitTimeout for
// init_transfer, vllm.UpdateTimeoutFor for update_weights): the step
// arguments that set them name those constants rather than copy them.

// DefaultCheckpointEvery is trainer.checkpoint_every's default: a
// checkpoint after every iteration, so a restart replays nothing.
const DefaultCheckpointEvery = 1

// DefaultTrainerStartTimeout bounds starting a resident trainer: its
// process, hello and the load of its last checkpoint.
const DefaultTrainerStartTimeout = 10 * time.Minute

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

// Bounds that keep a valid pipeline inside Temporal's default limits
// (limit.blobSize.error 2 MiB per payload, limit.historySize.error 50 MiB
// and limit.historyCount.error 51,200 events per run), so that a file
// `rlflow validate` passes does not fail on them at run time.
const (
	// MaxSpecBytes bounds the loaded pipeline as JSON. It travels whole as
	// the input of the pipeline workflow and of every iteration workflow
	// (its steps' `with` again in each activity's input), and Temporal
	// refuses a payload over 2 MiB; 1.5 MiB leaves the rest of the input
	// (params, the carried iteration summaries, the step context) 0.5 MiB.
	MaxSpecBytes = 3 << 19
	// MaxRunSpecBytes bounds the copies of the spec one pipeline workflow
	// run writes to its history: SpecStartCopies and the input of each of
	// its continue_as_new_every iterations. 40 MiB of Temporal's 50 MiB
	// leave room for the iterations' results and the other events.
	MaxRunSpecBytes = 40 << 20
	// SpecStartCopies are the copies of the spec a pipeline workflow run
	// writes at its start, before its iterations': its input, and the
	// input and result of the activity that validates it on the worker.
	SpecStartCopies = 3
	// MaxContinueAsNewEvery bounds loop.continue_as_new_every: each
	// iteration adds about ten events to the pipeline run's history, and
	// Temporal ends a run at 51,200; 1000 iterations stay near the 10,240
	// events at which it starts to warn.
	MaxContinueAsNewEvery = 1000
	// MaxRetryInterval bounds retry.initial_interval and max_interval:
	// with no max_interval Temporal waits up to 100 × initial_interval,
	// and a product past int64 nanoseconds (initial_interval over about
	// 25,620h) makes it refuse every attempt to schedule the step, failing
	// the workflow task forever. A year is far beyond any useful wait.
	MaxRetryInterval = 365 * 24 * time.Hour
	// MinHeartbeat bounds a heartbeat timeout from below: activities beat
	// at most every 10ms, Temporal's SDK throttles beats to 80% of the
	// timeout, and a beat crosses the network to the server, so a shorter
	// timeout fails a healthy step.
	MinHeartbeat = time.Second
)

// MaxExactInt bounds the integers of `with` values and int params: they
// travel as JSON numbers in workflow input and are decoded as float64 by
// the workflow, which holds integers exactly only up to 2^53.
const MaxExactInt = 1 << 53
