package gpuworker

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/worker"
	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"
)

// recordingEngine is a test double of the NCCL engine: it records the
// target of each request and asks the first server for its world size.
type recordingEngine struct {
	targets []transfer.Target
	updates []transfer.UpdateRequest
}

func (r *recordingEngine) Init(ctx context.Context, req transfer.InitRequest) (transfer.InitResult, error) {
	r.targets = append(r.targets, req.Target)
	n, err := req.Fleet[0].WorldSize(ctx, true)
	if err != nil {
		return transfer.InitResult{}, err
	}
	return transfer.InitResult{WorldSize: 1 + n, Group: transfer.GroupKey(req.Target)}, nil
}

func (r *recordingEngine) Update(ctx context.Context, req transfer.UpdateRequest) (transfer.UpdateResult, error) {
	r.targets = append(r.targets, req.Target)
	r.updates = append(r.updates, req)
	return transfer.UpdateResult{Bytes: 1, Tensors: 1, Group: transfer.GroupKey(req.Target)}, nil
}

func TestGPUWorkerQueues(t *testing.T) {
	c, err := client.NewLazyClient(client.Options{HostPort: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := New(c, Options{Host: "host-a", Device: 3, Engine: &recordingEngine{}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(c, Options{Host: "host-a", Engine: &recordingEngine{}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(a.HostQueue, pipelines.DefaultGPUTaskQueue+"/host-a/") || a.HostQueue == b.HostQueue {
		t.Fatalf("host queues %q and %q: want rlflow-gpu/host-a/<instance>, distinct per process", a.HostQueue, b.HostQueue)
	}
	var ts testsuite.WorkflowTestSuite
	env := ts.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(a.Acquire, activity.RegisterOptions{Name: workflows.AcquireGPUActivity})
	v, err := env.ExecuteActivity(workflows.AcquireGPUActivity, workflows.GPUAcquireInput{RunID: "r"})
	if err != nil {
		t.Fatal(err)
	}
	var host workflows.GPUHost
	if err := v.Get(&host); err != nil {
		t.Fatal(err)
	}
	if host != (workflows.GPUHost{TaskQueue: a.HostQueue, Host: "host-a", Device: 3}) {
		t.Fatalf("acquire answered %+v", host)
	}
	// The worker the run just lost refuses, so the step moves to another.
	_, err = env.ExecuteActivity(workflows.AcquireGPUActivity, workflows.GPUAcquireInput{RunID: "r", Lost: a.HostQueue})
	if err == nil || !strings.Contains(err.Error(), "was lost to run r") {
		t.Fatalf("acquire by the lost worker: %v", err)
	}
	if _, err := env.ExecuteActivity(workflows.AcquireGPUActivity, workflows.GPUAcquireInput{RunID: "r", Lost: b.HostQueue}); err != nil {
		t.Fatalf("another worker's loss: %v", err)
	}
	// The start-up policy with the fake NCCL: device 0 when none is asked
	// for, an advertise address the servers cannot reach refused.
	f, err := New(c, Options{Host: "host-b", Device: -1, FakeNCCL: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Info.Device != 0 {
		t.Errorf("fake device %d, want 0", f.Info.Device)
	}
	if _, err := New(c, Options{FakeNCCL: true, Advertise: "0.0.0.0"}); err == nil || !strings.Contains(err.Error(), "--advertise") {
		t.Errorf("advertise 0.0.0.0: %v", err)
	}
}

func TestTransferStepsBuildTheFleet(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer sekrit" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.Write([]byte(`{"world_size": 2}`))
	}))
	defer srv.Close()
	rec := &recordingEngine{}
	env := map[string]string{"VLLM_KEY": "sekrit"}
	steps := activities.New(activities.Deps{NCCL: rec, Getenv: func(k string) string { return env[k] }})
	var ts testsuite.WorkflowTestSuite
	aenv := ts.NewTestActivityEnvironment()
	worker.RegisterTransferActivities(aenv, steps)

	sc := pipelines.StepContext{RunID: "r", WeightTransfer: &pipelines.WeightTransfer{Backend: "nccl"}, Servers: []pipelines.Server{{URL: srv.URL, APIKeyEnv: "VLLM_KEY", API: "d"}}}
	v, err := aenv.ExecuteActivity(pipelines.StepInitTransfer, activities.InitTransferInput{Context: sc})
	if err != nil {
		t.Fatal(err)
	}
	var out activities.InitTransferOutput
	if err := v.Get(&out); err != nil || out.WorldSize != 3 {
		t.Fatalf("%+v %v", out, err)
	}
	if _, err := aenv.ExecuteActivity(pipelines.StepBroadcast, activities.BroadcastInput{Context: sc, Checkpoint: "/c", Version: "v"}); err != nil {
		t.Fatal(err)
	}
	if len(rec.targets) != 2 || rec.targets[1].Fleet[0].URL() != srv.URL || rec.targets[1].Pins[0] != vllm.GenD {
		t.Fatalf("targets %+v", rec.targets)
	}
	if u := rec.updates[0]; u.Checkpoint != "/c" || u.Version != "v" || u.DType != "keep" || u.InitTimeout != vllm.DefaultInitTimeout {
		t.Errorf("update request %+v: want the checkpoint, the version, and the registry's defaults", u)
	}

	sc.Servers[0].APIKeyEnv = "UNSET"
	_, err = aenv.ExecuteActivity(pipelines.StepBroadcast, activities.BroadcastInput{Context: sc, Checkpoint: "/c"})
	if err == nil || !strings.Contains(err.Error(), "UNSET") || !strings.Contains(err.Error(), pipelines.ErrTypeBadInput) {
		t.Fatalf("missing key: %v", err)
	}
}
