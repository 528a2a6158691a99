package activities

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/activity"
)

// InitTransferInput is the `with` of an init_transfer step.
type InitTransferInput struct {
	Context       pipelines.StepContext `json:"context"`
	MasterAddress string                `json:"master_address,omitempty"`
	MasterPort    int                   `json:"master_port,omitempty"`
	Timeout       pipelines.Duration    `json:"timeout,omitempty"`
}

// InitTransferOutput is an init_transfer step's outputs.
type InitTransferOutput struct {
	WorldSize int    `json:"world_size"`
	Backend   string `json:"backend"`
	// Group names the transfer group (run id + server set, and for nccl
	// how many times it was initialised on its worker), so a
	// re-initialisation is visible.
	Group string `json:"group"`
	// Methods say, per server, how it takes weights: the nccl rendezvous
	// (tcpstore, unique_id) or the disk backend's load (collective_rpc,
	// collective_rpc+update_config, draft_disk); empty where the backend
	// has nothing to choose.
	Methods []string               `json:"methods"`
	VLLM    []pipelines.VLLMServer `json:"_vllm,omitempty"`
	Attempt int                    `json:"_attempt"`
}

// BroadcastInput is the `with` of a broadcast step.
type BroadcastInput struct {
	Context       pipelines.StepContext `json:"context"`
	Checkpoint    string                `json:"checkpoint"`
	Version       string                `json:"version,omitempty"`
	DType         string                `json:"dtype,omitempty"`
	UpdateTimeout pipelines.Duration    `json:"update_timeout,omitempty"`
	Verify        bool                  `json:"verify,omitempty"`
}

// BroadcastOutput is a broadcast step's outputs.
type BroadcastOutput struct {
	Backend string `json:"backend"`
	Bytes   int64  `json:"bytes"`
	Tensors int    `json:"tensors"`
	// Seconds is the update itself, without an init it needed first.
	Seconds float64 `json:"seconds"`
	GBps    float64 `json:"gb_per_s"`
	Version string  `json:"version"`
	// Checkpoint is the checkpoint directory as loaded (absolute): the
	// interpreter restores it into a server found on stale weights.
	Checkpoint string `json:"checkpoint"`
	// ServerSeconds is the update's time by operation (init, start,
	// update, finish) as the slowest server reports it in its
	// vllm:rl_weight_update_operation_duration_seconds histogram; empty
	// where the servers export none (vLLM before late 2026).
	ServerSeconds map[string]float64 `json:"server_seconds"`
	// Initialized is true when this broadcast had to (re)initialise the
	// transfer group first (first use, or the old group was lost).
	Initialized bool `json:"initialized"`
	// Methods say, per server, how it took the weights (as
	// InitTransferOutput's).
	Methods []string               `json:"methods"`
	VLLM    []pipelines.VLLMServer `json:"_vllm,omitempty"`
	Attempt int                    `json:"_attempt"`
}

// InitTransfer initialises weight transfer with every server through the
// pipeline's backend.
func (a *Activities) InitTransfer(ctx context.Context, in InitTransferInput) (*InitTransferOutput, error) {
	const step = pipelines.StepInitTransfer
	if err := resolveArgs(ctx, step, &in); err != nil {
		return nil, err
	}
	backend, engine, target, err := a.transferPath(ctx, step, in.Context, vllm.Timeouts{Init: in.Timeout.D()})
	if err != nil {
		return nil, err
	}
	var progress transfer.Progress
	defer a.reportTransfer(ctx, &progress)()
	start := time.Now()
	res, err := engine.Init(ctx, transfer.InitRequest{Target: target, MasterAddress: in.MasterAddress, MasterPort: in.MasterPort,
		Timeout: in.Timeout.D(), Progress: &progress})
	if err != nil {
		return nil, transferError(ctx, step, err)
	}
	metrics.From(ctx).ObserveSync(backend, metrics.PhaseInit, time.Since(start).Seconds(), 0)
	return &InitTransferOutput{WorldSize: res.WorldSize, Backend: backend, Group: res.Group, Methods: nonNilStrings(res.Methods),
		VLLM: describeServers(ctx, target.Fleet), Attempt: attemptOf(ctx)}, nil
}

// Broadcast loads a checkpoint into every server through the pipeline's
// backend (initialising the transfer group first when it has none), then,
// with verify, checks every server's weight version.
func (a *Activities) Broadcast(ctx context.Context, in BroadcastInput) (*BroadcastOutput, error) {
	const step = pipelines.StepBroadcast
	if err := resolveArgs(ctx, step, &in); err != nil {
		return nil, err
	}
	sc := in.Context
	backend, engine, target, err := a.transferPath(ctx, step, sc, vllm.Timeouts{Update: in.UpdateTimeout.D()})
	if err != nil {
		return nil, err
	}
	// Confined here, before either backend opens it (the NCCL engine reads
	// it on this host; the disk backend hands it to the servers).
	ckpt, err := a.Roots.Resolve("with.checkpoint", sc.BaseDir, in.Checkpoint)
	if err != nil {
		return nil, badInput(ctx, "%s: %v", step, err)
	}
	if ckpt, err = filepath.Abs(ckpt); err != nil {
		return nil, badInput(ctx, "%s: checkpoint %q: %v", step, in.Checkpoint, err)
	}
	version := in.Version
	if version == "" {
		version = defaultVersion(sc)
	}
	if sc.FleetPaused {
		if err := checkPaused(ctx, target.Fleet, "before the update"); err != nil {
			return nil, err
		}
	}
	res, serverSeconds, err := a.update(ctx, step, backend, engine, transfer.UpdateRequest{Target: target, Checkpoint: ckpt, DType: in.DType,
		Version: version, Timeout: in.UpdateTimeout.D(), InitTimeout: vllm.DefaultInitTimeout, Paused: sc.FleetPaused}, in.Verify)
	if err != nil {
		return nil, err
	}
	out := &BroadcastOutput{Backend: backend, Bytes: res.Bytes, Tensors: res.Tensors, Seconds: res.Elapsed.Seconds(),
		Version: version, Checkpoint: ckpt, Initialized: res.Initialized, ServerSeconds: serverSeconds, Methods: nonNilStrings(res.Methods),
		VLLM: describeServers(ctx, target.Fleet), Attempt: attemptOf(ctx)}
	if res.Elapsed > 0 {
		out.GBps = float64(res.Bytes) / res.Elapsed.Seconds() / 1e9
	}
	return out, nil
}

// update runs one weight update of a sync step (broadcast, publish): the
// engine's update with its progress heartbeats and metrics, the servers'
// own times, then the checks that it reached what now serves (still
// paused when the run holds them paused; the version, with verify).
func (a *Activities) update(ctx context.Context, step, backend string, engine transfer.Engine, req transfer.UpdateRequest, verify bool) (transfer.UpdateResult, map[string]float64, error) {
	fleet := req.Fleet
	serverBefore := serverOperationSeconds(ctx, fleet)
	var progress transfer.Progress
	req.Progress = &progress
	stop := a.reportTransfer(ctx, &progress)
	start := time.Now()
	res, err := engine.Update(ctx, req)
	stop()
	if err != nil {
		return res, nil, transferError(ctx, step, err)
	}
	if res.Initialized {
		// The engine times the update alone; the rest of the call was the
		// group's (re)initialisation.
		metrics.From(ctx).ObserveSync(backend, metrics.PhaseInit, (time.Since(start) - res.Elapsed).Seconds(), 0)
	}
	metrics.From(ctx).ObserveSync(backend, metrics.PhaseUpdate, res.Elapsed.Seconds(), res.Bytes)
	serverSeconds := serverTimes(ctx, serverBefore, serverOperationSeconds(ctx, fleet))
	if req.Paused {
		// A server restarted during the update came back unpaused, on its
		// base weights: the update did not reach what now serves.
		if err := checkPaused(ctx, fleet, "after the update"); err != nil {
			return res, nil, err
		}
	}
	if verify {
		if err := verifyVersion(ctx, fleet, req.Version); err != nil {
			return res, nil, serverError(ctx, err, "%s: verify", step)
		}
	}
	return res, serverSeconds, nil
}

// defaultVersion is broadcast's version when the step sets none.
func defaultVersion(sc pipelines.StepContext) string {
	return fmt.Sprintf("%s/iter-%d", sc.RunID, sc.Iteration)
}

// transferPath is what both transfer steps start with: the pipeline's
// backend, its engine on this worker, and the target (run, servers with
// the step's timeouts, settings).
func (a *Activities) transferPath(ctx context.Context, step string, sc pipelines.StepContext, t vllm.Timeouts) (string, transfer.Engine, transfer.Target, error) {
	wt := sc.WeightTransfer
	if wt == nil {
		return "", nil, transfer.Target{}, badInput(ctx, "%s: the pipeline has no weight_transfer (add weight_transfer: {backend: nccl}, {backend: disk} or {backend: ipc})", step)
	}
	var engine transfer.Engine
	switch wt.Backend {
	case pipelines.BackendDisk:
		engine = a.disk
	case pipelines.BackendNCCL:
		if a.NCCL == nil {
			return "", nil, transfer.Target{}, stepError(ctx, pipelines.ErrTypeNoGPUWorker, nil,
				"%s: the nccl backend must run on a GPU worker (start one with `rlflow worker --gpu` on the trainer's host); this worker has no NCCL engine", step)
		}
		engine = a.NCCL
	case pipelines.BackendIPC:
		engine = a.ipc
	default:
		return "", nil, transfer.Target{}, badInput(ctx, "%s: weight_transfer.backend %q, want %s, %s or %s", step, wt.Backend, pipelines.BackendNCCL, pipelines.BackendDisk, pipelines.BackendIPC)
	}
	f, err := a.fleet(ctx, step, sc, t)
	if err != nil {
		return "", nil, transfer.Target{}, err
	}
	target := transfer.Target{RunID: sc.RunID, Fleet: f, Settings: *wt, Pins: make([]vllm.Generation, len(f))}
	for i, c := range f {
		target.Pins[i] = c.Generation() // the pin: nothing was probed yet
	}
	return wt.Backend, engine, target, nil
}

// reportTransfer heartbeats the engine's progress until stop.
func (a *Activities) reportTransfer(ctx context.Context, p *transfer.Progress) (stop func()) {
	return a.heartbeatLoop(ctx, func() { activity.RecordHeartbeat(ctx, p.Report()) })
}

// serverOperationSeconds reads each server's cumulative weight-update
// seconds by operation (empty for a server that exports none yet); nil for
// a server that does not answer: the figures are extra, never a reason to
// fail a sync.
func serverOperationSeconds(ctx context.Context, f vllm.Fleet) []map[string]float64 {
	out := make([]map[string]float64, len(f))
	_ = f.Each("weight-update metrics", func(i int, c *vllm.Client) error {
		sums, _, err := c.UpdateOperationSeconds(ctx)
		if err == nil {
			out[i] = sums
			if out[i] == nil {
				out[i] = map[string]float64{}
			}
		}
		return nil
	})
	return out
}

// serverTimes is, per operation, the most any server spent on it between
// the two readings, recording each server's time in the metrics too.
func serverTimes(ctx context.Context, before, after []map[string]float64) map[string]float64 {
	times := map[string]float64{}
	for i := range after {
		if before[i] == nil || after[i] == nil {
			continue
		}
		for op, sum := range after[i] {
			d := sum - before[i][op]
			if d < 0 {
				continue // the server restarted between the readings
			}
			metrics.From(ctx).ObserveServerSync(op, d)
			times[op] = max(times[op], d)
		}
	}
	return times
}

// checkPaused fails with StaleWeights, naming them, when servers the run
// paused are not paused: restarted, or resumed behind the run's back, they
// serve requests, and a broadcast must not load weights under them.
func checkPaused(ctx context.Context, f vllm.Fleet, when string) error {
	paused := make([]bool, len(f))
	err := f.Each("is_paused", func(i int, c *vllm.Client) error {
		p, err := c.IsPaused(ctx)
		paused[i] = p
		return err
	})
	if err != nil {
		return serverError(ctx, err, "%s: checking that the servers are paused %s", pipelines.StepBroadcast, when)
	}
	var stale pipelines.StaleServers
	for i, p := range paused {
		if !p {
			stale.Indexes = append(stale.Indexes, i)
			stale.URLs = append(stale.URLs, f[i].URL())
		}
	}
	if len(stale.Indexes) == 0 {
		return nil
	}
	return staleWeightsError(ctx, stale, "%s: %s not paused %s, though the run paused it (restarted, or resumed by someone else)",
		pipelines.StepBroadcast, strings.Join(stale.URLs, ", "), when)
}

// verifyVersion checks that every server with weight versions (API
// generations C and D) reports version after an update; the others have
// nothing to report.
func verifyVersion(ctx context.Context, f vllm.Fleet, version string) error {
	return f.Each("verify weight version", func(_ int, c *vllm.Client) error {
		gen, err := c.DetectGeneration(ctx)
		if err != nil {
			return err
		}
		if !gen.HasSessions() {
			return nil
		}
		got, err := c.WeightInfo(ctx)
		if err == nil && got != version {
			err = fmt.Errorf("vllm %s: GET /weight_info: weight version %q after the update, want %q", c.URL(), got, version)
		}
		return err
	})
}

// nonNilStrings keeps a list output a JSON list.
func nonNilStrings(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
