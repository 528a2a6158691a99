package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/worker"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	sdkworker "go.temporal.io/sdk/worker"
	"google.golang.org/protobuf/encoding/protojson"
)

// simGPUWorker simulates one GPU worker process in the test process: an
// SDK worker on the shared GPU queue answering gpu_acquire with its own
// host queue, and one on that host queue running broadcast. It has its own
// client, so that "killing" it (stopping its pollers and silencing a
// running broadcast) leaves the server to find out, as with a dead process.
type simGPUWorker struct {
	name    string
	queue   string
	c       client.Client
	workers []sdkworker.Worker

	hang     chan struct{} // closed by kill: a running broadcast stops heartbeating
	started  chan struct{} // gets a value when a broadcast starts
	acquires atomic.Int32
	groups   atomic.Int32 // broadcasts that initialised a group
}

func startSimGPUWorker(t *testing.T, address, name string, hold time.Duration) *simGPUWorker {
	t.Helper()
	c, err := runs.Connect(context.Background(), address, "default")
	require.NoError(t, err)
	g := &simGPUWorker{
		name: name, queue: fmt.Sprintf("%s/%s/%d", pipelines.DefaultGPUTaskQueue, name, time.Now().UnixNano()),
		c: c, hang: make(chan struct{}), started: make(chan struct{}, 8),
	}
	opts := sdkworker.Options{WorkerStopTimeout: 200 * time.Millisecond}
	shared := sdkworker.New(c, pipelines.DefaultGPUTaskQueue, opts)
	shared.RegisterActivityWithOptions(func(ctx context.Context, in workflows.GPUAcquireInput) (workflows.GPUHost, error) {
		g.acquires.Add(1)
		return workflows.GPUHost{TaskQueue: g.queue, Host: g.name}, nil
	}, activity.RegisterOptions{Name: workflows.AcquireGPUActivity})
	host := sdkworker.New(c, g.queue, opts)
	host.RegisterActivityWithOptions(func(ctx context.Context, in map[string]any) (map[string]any, error) {
		// The group lives as long as the worker: the first broadcast here
		// initialises it, later ones reuse it.
		initialized := g.groups.Add(1) == 1
		g.started <- struct{}{}
		deadline := time.After(hold)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-deadline:
				return map[string]any{"initialized": initialized, "worker": g.name}, nil
			case <-tick.C:
				activity.RecordHeartbeat(ctx)
			case <-g.hang:
				// Dead: no heartbeats, no answer, ever (until the test ends).
				<-ctx.Done()
				select {}
			}
		}
	}, activity.RegisterOptions{Name: pipelines.StepBroadcast})
	for _, w := range []sdkworker.Worker{shared, host} {
		require.NoError(t, w.Start())
	}
	g.workers = []sdkworker.Worker{shared, host}
	t.Cleanup(g.kill)
	return g
}

// kill makes the worker vanish: pollers stop, a running broadcast goes silent.
func (g *simGPUWorker) kill() {
	select {
	case <-g.hang:
		return
	default:
	}
	close(g.hang)
	var wg sync.WaitGroup
	for _, w := range g.workers {
		wg.Add(1)
		go func() { defer wg.Done(); w.Stop() }()
	}
	wg.Wait()
}

// TestGPURoutingOnDevServer runs the GPU routing against a real Temporal
// server with simulated GPU workers, so that the server, not a mock,
// produces the two kinds of loss: iteration 1's broadcast worker dies
// mid-step (heartbeat timeout), and iteration 2's carried-over worker is
// gone before its broadcast is picked up (ScheduleToStart timeout). Set
// RLFLOW_RECORD_HISTORY=DIR to write the iteration histories for the replay
// test.
func TestGPURoutingOnDevServer(t *testing.T) {
	srv := testutil.DevServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	defer c.Close()

	const queue = "gpu-routing"
	gateCalls := make(chan int, 4)
	release := make(chan struct{})
	w, err := worker.NewControl(c, worker.Options{TaskQueue: queue, Deps: activities.Deps{LogDir: t.TempDir()}})
	require.NoError(t, err)
	// The gate step holds iteration 2 until the test has replaced the GPU
	// worker. It is a noop step to the pipeline (a run's spec is validated,
	// so it names only real step types); this worker's noop is the test's.
	w.RegisterActivityWithOptions(func(ctx context.Context, in map[string]any) (map[string]any, error) {
		sc := in[pipelines.ContextArg].(map[string]any)
		if sc["step_id"] != "gate" {
			return map[string]any{}, nil
		}
		iter := int(sc["iteration"].(float64))
		gateCalls <- iter
		if iter == 2 {
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return map[string]any{}, nil
	}, activity.RegisterOptions{Name: pipelines.StepNoop, DisableAlreadyRegisteredCheck: true})
	require.NoError(t, w.Start())
	defer w.Stop()

	retry := &pipelines.RetryPolicy{MaxAttempts: 3, InitialInterval: pipelines.Duration(100 * time.Millisecond)}
	spec := &pipelines.Pipeline{
		Version: 1, Name: "gpu-routing", Loop: pipelines.Loop{Iterations: 2}, BaseDir: t.TempDir(),
		// The simulated GPU workers never call the server.
		Servers:        []pipelines.Server{{URL: "http://127.0.0.1:9"}},
		WeightTransfer: &pipelines.WeightTransfer{Backend: pipelines.BackendNCCL, GPUStartTimeout: pipelines.Duration(time.Second)},
		Defaults:       pipelines.StepDefaults{Timeout: pipelines.Duration(time.Minute), Heartbeat: pipelines.Duration(time.Second), Retry: retry},
		Steps: []pipelines.Step{
			{ID: "gate", Uses: pipelines.StepNoop},
			{ID: "sync", Uses: pipelines.StepBroadcast, Needs: []string{"gate"}, With: map[string]any{"checkpoint": "/ckpt"}},
			{ID: "after", Uses: pipelines.StepNoop, Needs: []string{"sync"}},
		},
	}

	g1 := startSimGPUWorker(t, srv.Address, "g1", 300*time.Millisecond)
	run, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, TaskQueue: queue})
	require.NoError(t, err)

	waitOn(ctx, t, g1.started, "g1's broadcast to start")
	g1.kill()
	g2 := startSimGPUWorker(t, srv.Address, "g2", 300*time.Millisecond)

	require.Equal(t, 1, waitOn(ctx, t, gateCalls, "iteration 1's gate"))
	require.Equal(t, 2, waitOn(ctx, t, gateCalls, "iteration 2's gate"))
	g2.kill() // iteration 2 will be sent to g2's queue, which nobody polls now
	g3 := startSimGPUWorker(t, srv.Address, "g3", 300*time.Millisecond)
	close(release)

	var res workflows.PipelineResult
	require.NoError(t, run.Get(ctx, &res))
	assert.Equal(t, 2, res.Iterations)

	for _, tc := range []struct {
		iter    int
		from    *simGPUWorker
		to      *simGPUWorker
		timeout enumspb.TimeoutType
	}{
		{1, g1, g2, enumspb.TIMEOUT_TYPE_HEARTBEAT},
		{2, g2, g3, enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START},
	} {
		id := fmt.Sprintf("%s/iter-%d", run.GetID(), tc.iter)
		events := history(ctx, t, c, id)
		queues := broadcastQueues(ctx, t, c, id)
		var timeouts []enumspb.TimeoutType
		for _, ev := range events {
			if a := ev.GetActivityTaskTimedOutEventAttributes(); a != nil {
				timeouts = append(timeouts, a.GetFailure().GetTimeoutFailureInfo().GetTimeoutType())
			}
		}
		assert.Equal(t, []string{tc.from.queue, tc.to.queue}, queues, "iteration %d", tc.iter)
		assert.Equal(t, []enumspb.TimeoutType{tc.timeout}, timeouts, "iteration %d", tc.iter)
		p := progressOf(ctx, t, c, id)
		sync := stepOf(t, p, "sync")
		assert.Equal(t, 2, sync.Attempts, "iteration %d", tc.iter)
		assert.Equal(t, tc.to.name, sync.Outputs["worker"], "iteration %d", tc.iter)
		assert.Equal(t, true, sync.Outputs["initialized"], "iteration %d: a new worker, a new group", tc.iter)
		require.NotNil(t, sync.GPUHost)
		assert.Equal(t, tc.to.queue, sync.GPUHost.TaskQueue)
		if dir := os.Getenv("RLFLOW_RECORD_HISTORY"); dir != "" {
			b, err := protojson.Marshal(&historypb.History{Events: events})
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(fmt.Sprintf("%s/history_iteration_gpu_%d.json", dir, tc.iter), b, 0o644))
			t.Logf("recorded %s (workflow id %s)", dir, id)
		}
	}
	assert.Equal(t, []int32{1, 1, 1}, []int32{g1.acquires.Load(), g2.acquires.Load(), g3.acquires.Load()}, "one acquire per worker: the host is reused until lost")
	pp := progressOf(ctx, t, c, run.GetID())
	assert.Equal(t, g3.queue, pp.GPUHost.TaskQueue, "the run carries the last worker")
	if dir := os.Getenv("RLFLOW_RECORD_HISTORY"); dir != "" {
		b, err := protojson.Marshal(&historypb.History{Events: history(ctx, t, c, run.GetID())})
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(dir+"/history_pipeline_gpu.json", b, 0o644))
		t.Logf("recorded %s (workflow id %s)", dir, run.GetID())
	}
}

func waitOn[T any](ctx context.Context, t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-ctx.Done():
		t.Fatalf("timed out waiting for %s", what)
	}
	var zero T
	return zero
}

func history(ctx context.Context, t *testing.T, c client.Client, id string) []*historypb.HistoryEvent {
	t.Helper()
	var events []*historypb.HistoryEvent
	it := c.GetWorkflowHistory(ctx, id, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	for it.HasNext() {
		ev, err := it.Next()
		require.NoError(t, err)
		events = append(events, ev)
	}
	if len(events) == 0 {
		require.NoError(t, errors.New("empty history of "+id))
	}
	return events
}
