package activities

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/vllm/double/bigram"
	"go.temporal.io/sdk/temporal"
)

func diskContext(t *testing.T, ds ...*testDouble) pipelines.StepContext {
	sc := stepContext(t, "sync", ds...)
	sc.WeightTransfer = &pipelines.WeightTransfer{Backend: pipelines.BackendDisk}
	return sc
}

// trainedCheckpoint saves a bigram model trained on corpus as
// <base>/<rel>/model.safetensors.
func trainedCheckpoint(t *testing.T, base, rel, corpus string) *bigram.Model {
	t.Helper()
	m, err := bigram.Train(corpus, bigram.TrainOptions{})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(base, rel), 0o755))
	require.NoError(t, m.Save(filepath.Join(base, rel, "model.safetensors")))
	return m
}

func TestBroadcastDisk(t *testing.T) {
	ctx := context.Background()
	d1 := newDouble(t, double.Config{DevMode: true, Generation: double.GenC})
	d2 := newDouble(t, double.Config{DevMode: true, Generation: double.GenD})
	a := newActivities(t)
	sc := diskContext(t, d1, d2)
	m := trainedCheckpoint(t, sc.BaseDir, "ckpt/iter-2", "the cat sat on the mat. ")

	out, err := a.Broadcast(ctx, BroadcastInput{Context: sc, Checkpoint: "ckpt/iter-2", Verify: true})
	require.NoError(t, err)
	assert.Equal(t, pipelines.BackendDisk, out.Backend)
	assert.Equal(t, "run-1/iter-2", out.Version)
	assert.Equal(t, 1, out.Tensors)
	assert.Equal(t, int64(len(m.Bytes())), out.Bytes)
	assert.True(t, out.Initialized, "first use initialises")
	// The servers' own times (the double exports vLLM's histogram).
	for _, op := range []string{"init", "start", "update", "finish"} {
		assert.Contains(t, out.ServerSeconds, op)
	}
	assert.Greater(t, out.ServerSeconds["update"], 0.0)
	for _, d := range []*testDouble{d1, d2} {
		assert.Equal(t, "run-1/iter-2", d.WeightVersion())
		assert.Equal(t, m.Checksum(), d.Model().Checksum(), "the server loaded the checkpoint")
		assert.Equal(t, 1, d.Stats().Requests["POST /init_weight_transfer_engine"])
	}

	// A single .safetensors file stands for its directory; the group is
	// already initialised; the version may be given.
	m2 := trainedCheckpoint(t, sc.BaseDir, "ckpt/iter-3", "a dog ran in the fog. ")
	out, err = a.Broadcast(ctx, BroadcastInput{Context: sc, Checkpoint: filepath.Join(sc.BaseDir, "ckpt/iter-3/model.safetensors"), Version: "v3"})
	require.NoError(t, err)
	assert.False(t, out.Initialized)
	assert.Equal(t, "v3", d2.WeightVersion())
	assert.Equal(t, m2.Checksum(), d2.Model().Checksum())
	assert.Equal(t, 1, d2.Stats().Requests["POST /init_weight_transfer_engine"])
}

func TestBroadcastDiskBadCheckpoints(t *testing.T) {
	d := newDouble(t, double.Config{DevMode: true})
	sc := diskContext(t, d)
	trainedCheckpoint(t, sc.BaseDir, "two", "abc ")
	trainedCheckpoint(t, sc.BaseDir, "ok", "abc ")
	require.NoError(t, os.WriteFile(filepath.Join(sc.BaseDir, "two", "other.safetensors"), []byte("junk"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(sc.BaseDir, "empty"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(sc.BaseDir, "weights.bin"), []byte("x"), 0o644))
	cases := []struct {
		name string
		in   BroadcastInput
		want string
	}{
		{"missing", BroadcastInput{Checkpoint: "nope"}, "checkpoint " + filepath.Join(sc.BaseDir, "nope") + ": no such file or directory"},
		{"empty dir", BroadcastInput{Checkpoint: "empty"}, "no *.safetensors files"},
		{"not safetensors", BroadcastInput{Checkpoint: "weights.bin"}, "is neither a directory nor a .safetensors file"},
		{"file among others", BroadcastInput{Checkpoint: "two/model.safetensors"}, "holds 2 *.safetensors files; give a directory holding one checkpoint"},
		{"corrupt shard", BroadcastInput{Checkpoint: "two"}, "other.safetensors"},
		{"no checkpoint", BroadcastInput{}, "broadcast: checkpoint"},
		{"dtype on disk", BroadcastInput{Checkpoint: "ok", DType: "bfloat16"}, `dtype "bfloat16" converts tensors on the nccl path only`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.in.Context = sc
			_, err := newActivities(t).Broadcast(context.Background(), c.in)
			assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
			assert.ErrorContains(t, err, c.want)
		})
	}
	assert.Zero(t, d.Stats().Requests["POST /update_weights"])
}

func TestBroadcastDiskFailures(t *testing.T) {
	ctx := context.Background()
	good := newDouble(t, double.Config{DevMode: true})
	failing := newDouble(t, double.Config{DevMode: true, Faults: double.Faults{ErrorRate: map[string]float64{"/update_weights": 1}}})
	a := newActivities(t)
	sc := diskContext(t, good, failing)
	trainedCheckpoint(t, sc.BaseDir, "ckpt", "hello world ")

	_, err := a.Broadcast(ctx, BroadcastInput{Context: sc, Checkpoint: "ckpt"})
	assert.Equal(t, pipelines.ErrTypeServerError, errType(t, err))
	assert.ErrorContains(t, err, "(update sessions closed, weights labelled run-1/iter-2-failed)")
	assert.ErrorContains(t, err, "update weights failed on 1 of 2 servers; vllm "+failing.URL+": POST /update_weights: HTTP 500: double: injected fault (Faults.ErrorRate)")
	assert.NotContains(t, err.Error(), "vllm "+good.URL+":")
	assert.Equal(t, "run-1/iter-2", good.WeightVersion())
	assert.Equal(t, "run-1/iter-2-failed", failing.WeightVersion(), "the session was closed, marked failed")
	c, err := vllm.New(failing.URL, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c.StartWeightUpdate(ctx), "no session is left open")

	// That session, left open as by a crashed attempt, is closed and the
	// update goes through.
	ok := newDouble(t, double.Config{DevMode: true})
	c, err = vllm.New(ok.URL, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c.StartWeightUpdate(ctx))
	out, err := a.Broadcast(ctx, BroadcastInput{Context: diskContext(t, ok), Checkpoint: filepath.Join(sc.BaseDir, "ckpt"), Version: "v1"})
	require.NoError(t, err)
	assert.Equal(t, "v1", out.Version)
	assert.Equal(t, "v1", ok.WeightVersion())

	// verify compares the version every server reports.
	liar := statusServer(t, "/weight_info", 200, `{"weight_version": "old"}`, ok.Handler())
	lsc := diskContext(t)
	lsc.Servers = []pipelines.Server{{URL: liar}}
	_, err = a.Broadcast(ctx, BroadcastInput{Context: lsc, Checkpoint: filepath.Join(sc.BaseDir, "ckpt"), Version: "v2", Verify: true})
	assert.Equal(t, pipelines.ErrTypeServerError, errType(t, err))
	assert.ErrorContains(t, err, `GET /weight_info: weight version "old" after the update, want "v2"`)

	// Generation B has no draft disk backend and no weight versions: stock
	// vLLM of any generation reloads through /collective_rpc.
	b := newDouble(t, double.Config{DevMode: true, Generation: double.GenB})
	out, err = a.Broadcast(ctx, BroadcastInput{Context: diskContext(t, b), Checkpoint: filepath.Join(sc.BaseDir, "ckpt")})
	require.NoError(t, err)
	assert.Equal(t, []string{transfer.MethodReload}, out.Methods)

	// A server with neither way to load a checkpoint directory.
	nodev := newDouble(t, double.Config{Generation: double.GenD})
	_, err = a.Broadcast(ctx, BroadcastInput{Context: diskContext(t, nodev), Checkpoint: filepath.Join(sc.BaseDir, "ckpt")})
	assert.Equal(t, pipelines.ErrTypeServerRejected, errType(t, err))
	assert.ErrorContains(t, err, "neither POST /collective_rpc")
}

// fakeEngine is a test double of the NCCL engine: it records what the
// activities handed it and fails with err.
type fakeEngine struct {
	target transfer.Target
	update transfer.UpdateRequest
	err    error
}

func (f *fakeEngine) Init(_ context.Context, req transfer.InitRequest) (transfer.InitResult, error) {
	f.target = req.Target
	return transfer.InitResult{WorldSize: 3, Group: "g"}, f.err
}

func (f *fakeEngine) Update(_ context.Context, req transfer.UpdateRequest) (transfer.UpdateResult, error) {
	f.target, f.update = req.Target, req
	return transfer.UpdateResult{Bytes: 10, Tensors: 1, Elapsed: time.Second}, f.err
}

func TestTransferDispatch(t *testing.T) {
	ctx := context.Background()
	d1 := newDouble(t, double.Config{DevMode: true, Backend: double.BackendNCCL})
	d2 := newDouble(t, double.Config{DevMode: true, Backend: double.BackendNCCL})
	nccl := diskContext(t, d1, d2)
	nccl.WeightTransfer = &pipelines.WeightTransfer{Backend: pipelines.BackendNCCL}

	a := newActivities(t)
	_, err := a.Broadcast(ctx, BroadcastInput{Context: nccl, Checkpoint: "x"})
	assert.Equal(t, pipelines.ErrTypeNoGPUWorker, errType(t, err))
	assert.ErrorContains(t, err, "rlflow worker --gpu")
	_, err = a.InitTransfer(ctx, InitTransferInput{Context: nccl})
	assert.Equal(t, pipelines.ErrTypeNoGPUWorker, errType(t, err))

	fake := &fakeEngine{}
	a.NCCL = fake
	out, err := a.Broadcast(ctx, BroadcastInput{Context: nccl, Checkpoint: "x", Version: "v"})
	require.NoError(t, err)
	// The run's record of each server: version and API generation.
	assert.Equal(t, []pipelines.VLLMServer{{URL: d1.URL, Version: "0.28.0", API: "D"}, {URL: d2.URL, Version: "0.28.0", API: "D"}}, out.VLLM)
	out.VLLM = nil
	assert.Equal(t, BroadcastOutput{Backend: pipelines.BackendNCCL, Bytes: 10, Tensors: 1, Seconds: 1, GBps: 1e-8, Version: "v",
		Checkpoint: filepath.Join(nccl.BaseDir, "x"), ServerSeconds: map[string]float64{}, Methods: []string{}, Attempt: 1}, *out)
	require.Len(t, fake.target.Fleet, 2)
	assert.Equal(t, d2.URL, fake.target.Fleet[1].URL())
	// One path for both backends: the checkpoint is resolved against the
	// base dir, and the registry's defaults are filled in, before the
	// engine sees the request.
	assert.Equal(t, filepath.Join(nccl.BaseDir, "x"), fake.update.Checkpoint)
	assert.Equal(t, "keep", fake.update.DType)
	assert.Equal(t, vllm.DefaultInitTimeout, fake.update.InitTimeout)
	_, err = a.Broadcast(ctx, BroadcastInput{Context: nccl, Checkpoint: "x"})
	require.NoError(t, err)
	assert.Equal(t, "run-1/iter-2", fake.update.Version, "the default version")
	init, err := a.InitTransfer(ctx, InitTransferInput{Context: nccl})
	require.NoError(t, err)
	assert.Equal(t, 3, init.WorldSize)
	// The engine's typed errors become the step's error types, the cause
	// printed once.
	for _, c := range []struct {
		err  error
		typ  string
		want string
	}{
		{transfer.Errorf(transfer.NCCLFailed, errors.New("ncclRemoteError"), "broadcast 3 of 9"), pipelines.ErrTypeNCCL,
			"broadcast: broadcast 3 of 9 (type: NCCLError, retryable: true): ncclRemoteError"},
		{transfer.BadInputf("dtype %q, want keep", "fp4"), pipelines.ErrTypeBadInput, `broadcast: dtype "fp4", want keep (type: BadInput, retryable: false)`},
		{transfer.Errorf(transfer.DeviceLost, errors.New("cudaErrorDevicesUnavailable"), "open device 0"), pipelines.ErrTypeGPUWorkerLost,
			"broadcast: open device 0 (type: GPUWorkerLost, retryable: true): cudaErrorDevicesUnavailable"},
		{errors.New("nccl: broadcast 3 of 9 timed out"), pipelines.ErrTypeServerError, "broadcast (type: ServerError, retryable: true): nccl: broadcast 3 of 9 timed out"},
	} {
		fake.err = c.err
		_, err = a.Broadcast(ctx, BroadcastInput{Context: nccl, Checkpoint: "x"})
		assert.Equal(t, c.typ, errType(t, err))
		assert.ErrorContains(t, err, c.want)
	}

	noWT := nccl
	noWT.WeightTransfer = nil
	_, err = a.Broadcast(ctx, BroadcastInput{Context: noWT, Checkpoint: "x"})
	assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
	assert.ErrorContains(t, err, "broadcast: the pipeline has no weight_transfer")
	noWT.WeightTransfer = &pipelines.WeightTransfer{Backend: "rdma"}
	_, err = a.InitTransfer(ctx, InitTransferInput{Context: noWT})
	assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))
	assert.ErrorContains(t, err, `weight_transfer.backend "rdma", want nccl, disk or ipc`)
}

func TestInitTransferDisk(t *testing.T) {
	ctx := context.Background()
	d1 := newDouble(t, double.Config{DevMode: true, WorldSize: 2})
	d2 := newDouble(t, double.Config{DevMode: true, Generation: double.GenC})
	a := newActivities(t)
	sc := diskContext(t, d1, d2)
	out, err := a.InitTransfer(ctx, InitTransferInput{Context: sc})
	require.NoError(t, err)
	assert.Equal(t, 1+2+1, out.WorldSize)
	assert.Equal(t, pipelines.BackendDisk, out.Backend)
	assert.Equal(t, "run-1@"+d1.URL+","+d2.URL, out.Group)
	for _, d := range []*testDouble{d1, d2} {
		assert.Equal(t, 1, d.Stats().Requests["POST /init_weight_transfer_engine"])
	}
	// broadcast then needs no init of its own.
	trainedCheckpoint(t, sc.BaseDir, "ckpt", "abc ")
	b, err := a.Broadcast(ctx, BroadcastInput{Context: sc, Checkpoint: "ckpt"})
	require.NoError(t, err)
	assert.False(t, b.Initialized)

	_, err = a.InitTransfer(ctx, InitTransferInput{Context: sc, MasterPort: 29500})
	assert.Equal(t, pipelines.ErrTypeBadInput, errType(t, err))

	failing := newDouble(t, double.Config{DevMode: true, Faults: double.Faults{ErrorRate: map[string]float64{"/init_weight_transfer_engine": 1}}})
	_, err = a.InitTransfer(ctx, InitTransferInput{Context: diskContext(t, d1, failing)})
	assert.Equal(t, pipelines.ErrTypeServerError, errType(t, err))
	assert.ErrorContains(t, err, "init weight transfer failed on 1 of 2 servers; vllm "+failing.URL+": POST /init_weight_transfer_engine: HTTP 500")
}

// A broadcast in a run that paused its servers refuses a server it finds
// unpaused (restarted, or resumed by someone else) with StaleWeights naming
// it, before loading anything; once it is paused again the broadcast runs.
func TestBroadcastRefusesAServerTheRunPausedButIsNot(t *testing.T) {
	ctx := context.Background()
	d1 := newDouble(t, double.Config{DevMode: true, Backend: double.BackendNCCL})
	d2 := newDouble(t, double.Config{DevMode: true, Backend: double.BackendNCCL})
	sc := diskContext(t, d1, d2)
	sc.WeightTransfer = &pipelines.WeightTransfer{Backend: pipelines.BackendNCCL}
	sc.FleetPaused = true
	fake := &fakeEngine{}
	a := newActivities(t)
	a.NCCL = fake
	c1, err := vllm.New(d1.URL, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c1.Pause(ctx, vllm.PauseKeep))

	_, err = a.Broadcast(ctx, BroadcastInput{Context: sc, Checkpoint: "x", Version: "v"})
	require.Equal(t, pipelines.ErrTypeStaleWeights, errType(t, err))
	assert.ErrorContains(t, err, d2.URL+" not paused before the update")
	var app *temporal.ApplicationError
	require.ErrorAs(t, err, &app)
	var attempt pipelines.AttemptDetail
	var stale pipelines.StaleServers
	require.NoError(t, app.Details(&attempt, &stale))
	assert.Equal(t, pipelines.StaleServers{Indexes: []int{1}, URLs: []string{d2.URL}}, stale)
	assert.Nil(t, fake.target.Fleet, "nothing was loaded")

	c2, err := vllm.New(d2.URL, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c2.Pause(ctx, vllm.PauseKeep))
	_, err = a.Broadcast(ctx, BroadcastInput{Context: sc, Checkpoint: "x", Version: "v"})
	require.NoError(t, err)
}
