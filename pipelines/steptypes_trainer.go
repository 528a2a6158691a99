package pipelines

// The resident trainer's step types: they call the pipeline's trainer:
// (trainer/PROTOCOL.md) on the GPU worker that runs it, which they are
// routed to with the transfer steps (GPUStepTypes).
const (
	StepTrain          = "train"
	StepPublish        = "publish"
	StepSaveCheckpoint = "save_checkpoint"
)

// TrainerStepTypes are the step types that call the resident trainer.
var TrainerStepTypes = []string{StepTrain, StepPublish, StepSaveCheckpoint}

// restartOutputs are what every trainer step reports about a restart it
// needed: whether it restarted the trainer, from which checkpoint
// iteration (0: a fresh initialisation), the iterations it replayed and
// why the trainer was not there.
var restartOutputs = []string{"restarted", "restored_from", "replayed", "restart_cause", "trainer_generation"}

func init() {
	RegisterStepType(&StepType{
		Name: StepTrain,
		Doc: "Trains the resident trainer on a rollouts file (one optimizer step or more, as the trainer decides), once: the worker journals the iteration durably, so a retried attempt answers from the journal instead of training twice. " +
			"Saves a checkpoint after every iteration that is a multiple of trainer.checkpoint_every. Outputs the trainer's metrics as keys (declare the ones later steps read in outputs:) and, after a restart, what it restored and replayed.",
		Args: []ArgSpec{
			{Name: "rollouts", Kind: KindString, Required: true, Doc: "rollouts JSONL to train on (usually a generate step's path), relative to base_dir; kept: a restart replays from it"},
			{Name: "args", Kind: KindObject, DefaultDoc: "none", Doc: "passed to the trainer's train step as they are (learning rate, batch size...)"},
		},
		Outputs:         append([]string{"iteration", "seconds", "step_done_unix", "from_journal", "checkpoint", "checkpoint_seconds"}, restartOutputs...),
		DeclaredOutputs: true,
		NeedsTrainer:    true,
	})
	RegisterStepType(&StepType{
		Name: StepPublish,
		Doc: "Publishes the resident trainer's weights to every server: the trainer copies them into a device snapshot (one pass of device-to-device copies, the only time it is blocked) and hands it over by CUDA IPC; " +
			"the GPU worker broadcasts straight from that memory over NCCL with the layout weight_transfer asks (packed or not), no file and no host copy, then releases the snapshot. Sets the weight version.",
		Args: []ArgSpec{
			{Name: "version", Kind: KindString, DefaultDoc: "`<run id>/iter-<n>`", Doc: "weight version label"},
			{Name: "dtype", Kind: KindString, Enum: []string{"keep", "bfloat16", "float16"}, Default: "keep", Doc: "the snapshot casts float32 tensors to this serving dtype"},
			{Name: "update_timeout", Kind: KindDuration, Min: seconds(minTimeout), DefaultDoc: updateTimeoutDoc, Doc: "deadline of update_weights"},
			{Name: "verify", Kind: KindBool, Default: false, Doc: "check the servers' weight version afterwards (APIs C and later)"},
		},
		Outputs: append([]string{"backend", "bytes", "tensors", "seconds", "gb_per_s", "version", "snapshot_seconds", "server_seconds", "initialized", "methods"},
			restartOutputs...),
		NeedsServers:        true,
		NeedsWeightTransfer: true,
		NeedsTrainer:        true,
	})
	RegisterStepType(&StepType{
		Name:         StepSaveCheckpoint,
		Doc:          "Saves a durable checkpoint of the resident trainer now (model, optimizer, random state), besides the ones train saves every trainer.checkpoint_every iterations; a restart starts from the newest.",
		Outputs:      append([]string{"path", "bytes", "seconds", "iteration"}, restartOutputs...),
		NeedsTrainer: true,
	})
}
