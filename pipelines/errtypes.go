package pipelines

import (
	"fmt"
	"slices"
)

// Error types: the Temporal ApplicationError types rlflow raises, and what
// users name in retry.non_retryable. ErrorTypes is the one table; the
// activities, the GPU worker and the interpreter type their errors with
// these constants, the loader checks non_retryable against it, and the
// reference lists it.
const (
	ErrTypeBadInput        = "BadInput"        // non-retryable: the step's arguments are wrong
	ErrTypeCommandNotFound = "CommandNotFound" // non-retryable: exec's program does not exist
	ErrTypeOutputMissing   = "OutputMissing"   // non-retryable: a declared output was not written
	ErrTypeExit            = "ExitError"       // retryable: exec's command exited non-zero
	ErrTypeSignal          = "Signaled"        // retryable: exec's command was killed by a signal
	ErrTypeIO              = "IOError"         // retryable: local file or process trouble
	ErrTypeServerError     = "ServerError"     // retryable: a server failed, timed out or could not be reached
	ErrTypeServerRejected  = "ServerRejected"  // non-retryable: a server refused the request for good
	ErrTypeNoGPUWorker     = "NoGPUWorker"     // non-retryable: an nccl step reached a worker without the NCCL path
	ErrTypeNCCL            = "NCCLError"       // retryable: the NCCL group failed or was lost
	ErrTypeStaleWeights    = "StaleWeights"    // retryable: a server serves other weights than the run expects; the interpreter re-syncs it first
	ErrTypeTrainerDied     = "TrainerDied"     // retryable: the resident trainer died or did not start in time; the next attempt restarts it from its last checkpoint
	ErrTypeTrainerFailed   = "TrainerFailed"   // non-retryable: the resident trainer refused a call, broke its protocol, or cannot be restored
	ErrTypeGPUWorkerLost   = "GPUWorkerLost"   // a GPU step's worker can no longer serve the run: the interpreter moves the step to another GPU worker
	ErrTypeGPUUnavailable  = "GPUUnavailable"  // no GPU worker could be acquired (interpreter)
	ErrTypeStepFailed      = "StepFailed"      // an iteration failed because a step did (interpreter)
	ErrTypeIterationFailed = "IterationFailed" // a run failed because an iteration did (interpreter)

	// Temporal's own failure types for an attempt's timeouts, which a
	// retry policy may also name (Temporal retries no other timeout).
	ErrTypeStartToCloseTimeout = "TemporalTimeout:StartToClose"
	ErrTypeHeartbeatTimeout    = "TemporalTimeout:Heartbeat"
)

// ErrorType describes one error type.
type ErrorType struct {
	Name string
	// NonRetryable: rlflow raises it as a non-retryable error, so it fails
	// the step (or workflow) at once whatever the retry policy says.
	NonRetryable bool
	// Step: a step's attempt can fail with it and Temporal's retry policy
	// sees it, so retry.non_retryable may name it.
	Step bool
	Doc  string
}

// ErrorTypes is every error type, in reference order.
var ErrorTypes = []ErrorType{
	{Name: ErrTypeBadInput, NonRetryable: true, Step: true,
		Doc: "the step's arguments are wrong (a value out of range, a missing file, an unknown model)"},
	{Name: ErrTypeCommandNotFound, NonRetryable: true, Step: true,
		Doc: "exec's program does not exist"},
	{Name: ErrTypeOutputMissing, NonRetryable: true, Step: true,
		Doc: "a declared output was not written"},
	{Name: ErrTypeExit, Step: true,
		Doc: "exec's command exited non-zero"},
	{Name: ErrTypeSignal, Step: true,
		Doc: "exec's command was killed by a signal"},
	{Name: ErrTypeIO, Step: true,
		Doc: "local file or process trouble"},
	{Name: ErrTypeServerError, Step: true,
		Doc: "a vLLM server (or an http scorer) failed, timed out, or could not be reached: a 5xx, 408, 409, 425, 429 or a transport error; a retried generate resumes where it stopped"},
	{Name: ErrTypeServerRejected, NonRetryable: true, Step: true,
		Doc: "a server refused the request for good (400, 401, 403, 404, 405, 422, ...: a prompt over the context length, a wrong API key, dev-mode routes missing), or the client refused to send it (a payload the server's API generation cannot take)"},
	{Name: ErrTypeNoGPUWorker, NonRetryable: true, Step: true,
		Doc: "an nccl transfer step reached a worker without the NCCL weight path (start the worker with `rlflow worker --gpu`); a retry would land on the same task queue"},
	{Name: ErrTypeTrainerDied, Step: true,
		Doc: "the resident trainer died (killed, crashed, its GPU worker gone) or did not start in time; the next attempt restarts it from its last checkpoint and replays the iterations since"},
	{Name: ErrTypeTrainerFailed, NonRetryable: true, Step: true,
		Doc: "the resident trainer refused the call (its own error, e.g. an exception in the train step), broke the protocol, or cannot be restored (a journalled iteration's rollouts are gone); its log on the GPU worker has the details"},
	{Name: ErrTypeNCCL, Step: true,
		Doc: "the NCCL group failed or was lost; the next attempt re-initialises the group"},
	{Name: ErrTypeStaleWeights, Step: true,
		Doc: "a server serves other weights than the run expects (it was restarted, replaced or reset), or a broadcast found a server unpaused that the run had paused: the error names the server, and the interpreter re-syncs the run's last checkpoint (pausing first) before the retry"},
	{Name: ErrTypeStartToCloseTimeout, Step: true,
		Doc: "Temporal: an attempt ran past the step's timeout"},
	{Name: ErrTypeHeartbeatTimeout, Step: true,
		Doc: "Temporal: an attempt stopped heartbeating for longer than the step's heartbeat"},
	{Name: ErrTypeGPUWorkerLost,
		Doc: "a GPU step's worker can no longer serve the run (its device or communicator is gone): the interpreter moves the step to another GPU worker, as it does when the worker's queue stops answering, whatever the retry policy"},
	{Name: ErrTypeGPUUnavailable, NonRetryable: true,
		Doc: "the interpreter could not acquire a GPU worker for a GPU step"},
	{Name: ErrTypeStepFailed, NonRetryable: true,
		Doc: "the interpreter failed an iteration because a step failed"},
	{Name: ErrTypeIterationFailed, NonRetryable: true,
		Doc: "the interpreter failed a run because an iteration failed"},
}

// LookupErrorType returns the entry of ErrorTypes with that name.
func LookupErrorType(name string) (ErrorType, bool) {
	for _, e := range ErrorTypes {
		if e.Name == name {
			return e, true
		}
	}
	return ErrorType{}, false
}

// StepErrorTypes returns the names retry.non_retryable accepts: the Step
// ones, in table order.
func StepErrorTypes() []string {
	var out []string
	for _, e := range ErrorTypes {
		if e.Step {
			out = append(out, e.Name)
		}
	}
	return out
}

// NonRetryableErrorTypes returns the step error types rlflow always raises
// as non-retryable, in table order.
func NonRetryableErrorTypes() []string {
	var out []string
	for _, e := range ErrorTypes {
		if e.Step && e.NonRetryable {
			out = append(out, e.Name)
		}
	}
	return out
}

// IsNonRetryable reports whether errors of that type are raised as
// non-retryable.
func IsNonRetryable(errType string) bool {
	e, ok := LookupErrorType(errType)
	return ok && e.NonRetryable
}

// nonRetryableProblem explains why name cannot be listed in
// retry.non_retryable, or returns "".
func nonRetryableProblem(name string) string {
	steps := StepErrorTypes()
	if slices.Contains(steps, name) {
		return ""
	}
	if _, ok := LookupErrorType(name); ok {
		return fmt.Sprintf("%s is not a step error (see Error types in the reference): no retry policy sees it; non_retryable takes %s", name, joinNames(steps))
	}
	return fmt.Sprintf("unknown error type %q%s; non_retryable takes %s", clip(name), didYouMean(name, steps), joinNames(steps))
}
