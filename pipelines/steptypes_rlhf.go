package pipelines

import (
	"fmt"
	"strings"

	"github.com/rlflow/rlflow/vllm"
)

// The RLHF step types: they talk to the pipeline's vLLM servers (servers:)
// and move weights to them (weight_transfer:). Their activities live in
// package activities; init_transfer and broadcast with the nccl backend run
// on a GPU worker (see workflows for the routing).
const (
	StepGenerate     = "generate"
	StepEvaluate     = "evaluate"
	StepPause        = "pause"
	StepResume       = "resume"
	StepIsPaused     = "is_paused"
	StepWorldSize    = "world_size"
	StepInitTransfer = "init_transfer"
	StepBroadcast    = "broadcast"
)

// GPUStepTypes are the step types that run where the NCCL communicator
// lives when the pipeline's weight_transfer.backend is nccl.
var GPUStepTypes = []string{StepInitTransfer, StepBroadcast, StepTrain, StepPublish, StepSaveCheckpoint}

// samplingArgs are shared by generate and evaluate.
var samplingArgs = []ArgSpec{
	{Name: "prompts", Kind: KindString, Required: true, Doc: "JSONL file, one object per line: {\"id\", \"prompt\"} or {\"id\", \"messages\": [{role, content}]} (relative to base_dir)"},
	{Name: "model", Kind: KindString, DefaultDoc: "the first model the server lists", Doc: "served model name"},
	{Name: "n", Kind: KindInt, Min: bound(1), Max: bound(MaxSamples), Default: int64(1), Doc: "samples per prompt"},
	{Name: "max_tokens", Kind: KindInt, Min: bound(1), Default: int64(256), Doc: "tokens per sample"},
	{Name: "temperature", Kind: KindFloat, Min: bound(0), Default: 1.0, Doc: "sampling temperature; 0 is greedy"},
	{Name: "top_p", Kind: KindFloat, Min: bound(0), MinExclusive: true, Max: bound(1), DefaultDoc: "the server's", Doc: "nucleus sampling"},
	{Name: "seed", Kind: KindInt, DefaultDoc: "none: unseeded sampling", Doc: "sampling seed; sample k of prompt i uses seed+i*n+k"},
	{Name: "stop", Kind: KindStringList, DefaultDoc: "none", Doc: "stop strings"},
	{Name: "logprobs", Kind: KindInt, Min: bound(0), Default: int64(0), Doc: "top log-probabilities per token to record; 0 records none"},
	{Name: "concurrency", Kind: KindInt, Min: bound(1), Max: bound(MaxConcurrency), Default: int64(64), Doc: "requests in flight at once, across all servers"},
	{Name: "request_timeout", Kind: KindDuration, Min: seconds(minTimeout), Default: Duration(vllm.DefaultGenerateTimeout), Doc: "deadline of one request"},
	{Name: "output", Kind: KindString, DefaultDoc: "under the worker's data dir: `<data dir>/<run>/iter-<n>/<step>/rollouts.jsonl` (`scores.jsonl` for evaluate)", Doc: "output JSONL path, relative to base_dir"},
}

// pauseTimeoutDoc: pause waits as long as a request may take with mode
// wait, so its default depends on the mode.
var pauseTimeoutDoc = shortDuration(Duration(vllm.DefaultControlTimeout)) + ", or " + shortDuration(Duration(vllm.DefaultGenerateTimeout)) + " with mode wait"

// updateTimeoutDoc states vllm.UpdateTimeoutFor's rule.
var updateTimeoutDoc = fmt.Sprintf("scales with the checkpoint: %s plus 1s per started %s",
	shortDuration(Duration(vllm.UpdateTimeoutBase)), sizeText(vllm.UpdateTimeoutBytesPerSecond))

// timeoutArg bounds each server's call of a control step.
var timeoutArg = ArgSpec{Name: "timeout", Kind: KindDuration, Min: seconds(minTimeout), Default: Duration(vllm.DefaultControlTimeout), Doc: "deadline of each server's call"}

// validateScorer is evaluate's Validate hook: the scorer object's type,
// keys and values (a bad regex, a missing url or pattern).
func validateScorer(with map[string]any) map[string]string {
	m, ok := with["scorer"].(map[string]any)
	if !ok {
		return nil // a ${{ }} expression: checked when the step runs
	}
	if probs := ScorerProblems(m, false); len(probs) > 0 {
		return map[string]string{"scorer": strings.Join(probs, "; ")}
	}
	return nil
}

func init() {
	RegisterStepType(&StepType{
		Name:         StepGenerate,
		Doc:          "Generates rollouts from every prompt through the servers' OpenAI API, spreading requests over all servers. A retried attempt resumes from the partial file and requests only the samples not yet answered; the output JSONL is written atomically, one line per sample in prompt order: {prompt_id, prompt (plain) or messages (chat) as in the prompts file, sample, text, finish_reason, prompt_tokens, completion_tokens, logprobs (with logprobs > 0: [{token, logprob, top}]), weight_version, server}.",
		Args:         samplingArgs,
		Outputs:      []string{"path", "prompts", "samples", "completion_tokens", "tokens_per_s", "weight_version", "weight_check", "resumed"},
		NeedsServers: true,
	})
	RegisterStepType(&StepType{
		Name: StepEvaluate,
		Doc:  "Generates from an eval set (prompts JSONL whose lines carry an \"answer\") and scores every sample with the scorer; writes a per-sample JSONL: generate's lines plus answer, score (and unparsed for a judge reply without a score).",
		Args: append(append([]ArgSpec(nil), samplingArgs...),
			ArgSpec{Name: "scorer", Kind: KindObject, Required: true, Doc: "how each sample is scored: {type: exact_match|contains|regex|numeric|http|judge, ...} with the keys of its type (see Scorers below)"},
		),
		Outputs:      []string{"score", "samples", "path", "min", "max", "weight_version", "weight_check", "unparsed", "resumed"},
		Validate:     validateScorer,
		NeedsServers: true,
	})
	RegisterStepType(&StepType{
		Name: StepPause,
		Doc:  "Pauses generation on every server, in parallel. If some servers fail, the ones paused are resumed and the error names each failure.",
		Args: []ArgSpec{
			{Name: "mode", Kind: KindString, Enum: []string{"abort", "wait", "keep"}, Default: "abort", Doc: "abort in-flight requests (as vLLM does when not told), wait for them, or keep them queued"},
			{Name: "timeout", Kind: KindDuration, Min: seconds(minTimeout), DefaultDoc: pauseTimeoutDoc, Doc: "deadline of each server's pause"},
		},
		Outputs:      []string{"servers"},
		NeedsServers: true,
	})
	RegisterStepType(&StepType{
		Name:         StepResume,
		Doc:          "Resumes generation on every server, in parallel (each is tried even if another fails). Mark it always: true after a pause so vLLM is never left paused.",
		Args:         []ArgSpec{timeoutArg},
		Outputs:      []string{"servers"},
		NeedsServers: true,
	})
	RegisterStepType(&StepType{
		Name:         StepIsPaused,
		Doc:          "Reports whether the servers are paused: paused is true when any server is, paused_servers counts them.",
		Args:         []ArgSpec{timeoutArg},
		Outputs:      []string{"paused", "paused_servers"},
		NeedsServers: true,
	})
	RegisterStepType(&StepType{
		Name:         StepWorldSize,
		Doc:          "Asks every server for its world size (DP included): the NCCL group is 1 + their sum, with cumulative rank offsets.",
		Args:         []ArgSpec{timeoutArg},
		Outputs:      []string{"world_size"},
		NeedsServers: true,
	})
	RegisterStepType(&StepType{
		Name: StepInitTransfer,
		Doc:  "Initialises the weight-transfer group with every server (nccl: TCPStore rendezvous, NCCL init and warm-up with rank offsets; disk: init_info {}). Runs on a GPU worker for nccl. broadcast initialises on its own when needed, so this step is optional.",
		Args: []ArgSpec{
			{Name: "master_address", Kind: KindString, DefaultDoc: "the GPU worker's --advertise address", Doc: "address the trainer's TCPStore binds and the servers connect to (nccl)"},
			{Name: "master_port", Kind: KindInt, Min: bound(0), Max: bound(65535), Default: int64(0), DefaultDoc: "a free port, fresh on every init", Doc: "TCPStore port (nccl)"},
			{Name: "timeout", Kind: KindDuration, Min: seconds(minTimeout), Default: Duration(vllm.DefaultInitTimeout), Doc: "deadline of the init: vLLM's 300s TCPStore wait plus NCCL setup"},
		},
		Outputs:             []string{"world_size", "backend", "group", "methods"},
		NeedsServers:        true,
		NeedsWeightTransfer: true,
	})
	RegisterStepType(&StepType{
		Name: StepBroadcast,
		Doc:  "Sends a checkpoint (safetensors file or directory) to every server with the pipeline's weight_transfer backend: nccl broadcasts from a GPU worker (initialising the group on first use or after its loss); disk hands vLLM the absolute directory. Sets the weight version where the API has one.",
		Args: []ArgSpec{
			{Name: "checkpoint", Kind: KindString, Required: true, Doc: "safetensors file or directory (single file or sharded with model.safetensors.index.json), relative to base_dir"},
			{Name: "version", Kind: KindString, DefaultDoc: "`<run id>/iter-<n>`", Doc: "weight version label"},
			{Name: "dtype", Kind: KindString, Enum: []string{"keep", "bfloat16", "float16"}, Default: "keep", Doc: "nccl: convert floating tensors to the serving dtype on the way; disk takes only keep"},
			{Name: "update_timeout", Kind: KindDuration, Min: seconds(minTimeout), DefaultDoc: updateTimeoutDoc, Doc: "deadline of update_weights"},
			{Name: "verify", Kind: KindBool, Default: false, Doc: "check the servers' weight version afterwards (APIs C and D)"},
		},
		Outputs:             []string{"backend", "bytes", "tensors", "seconds", "gb_per_s", "version", "checkpoint", "server_seconds", "initialized", "methods"},
		NeedsServers:        true,
		NeedsWeightTransfer: true,
	})
}
