package worker

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/workflows"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"
)

// recordingTransfer is a test double of the NCCL path: it records the
// fleet each step was given and asks the first server for its world size.
type recordingTransfer struct {
	fleets []vllm.Fleet
}

func (r *recordingTransfer) Init(ctx context.Context, in activities.InitTransferInput, fleet vllm.Fleet) (*activities.InitTransferOutput, error) {
	r.fleets = append(r.fleets, fleet)
	n, err := fleet[0].WorldSize(ctx, true)
	if err != nil {
		return nil, err
	}
	return &activities.InitTransferOutput{WorldSize: 1 + n, Backend: "nccl"}, nil
}

func (r *recordingTransfer) Broadcast(ctx context.Context, in activities.BroadcastInput, fleet vllm.Fleet) (*activities.BroadcastOutput, error) {
	r.fleets = append(r.fleets, fleet)
	return &activities.BroadcastOutput{Backend: "nccl", Version: in.Version}, nil
}

func TestGPUWorkerQueues(t *testing.T) {
	c, err := client.NewLazyClient(client.Options{HostPort: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := NewGPU(c, GPUOptions{Host: "host-a", Device: 3, NCCL: &recordingTransfer{}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewGPU(c, GPUOptions{Host: "host-a", NCCL: &recordingTransfer{}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(a.HostQueue, workflows.DefaultGPUTaskQueue+"/host-a/") || a.HostQueue == b.HostQueue {
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
	if _, err := NewGPU(c, GPUOptions{}); err == nil {
		t.Fatal("a GPU worker without an NCCL transfer was built")
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
	rec := &recordingTransfer{}
	env := map[string]string{"VLLM_KEY": "sekrit"}
	steps := activities.New(activities.Deps{NCCL: rec, Getenv: func(k string) string { return env[k] }})
	var ts testsuite.WorkflowTestSuite
	aenv := ts.NewTestActivityEnvironment()
	RegisterTransferActivities(aenv, steps)

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
	if len(rec.fleets) != 2 || rec.fleets[1][0].URL() != srv.URL || rec.fleets[1][0].Generation() != vllm.GenD {
		t.Fatalf("fleets %v", rec.fleets)
	}

	sc.Servers[0].APIKeyEnv = "UNSET"
	_, err = aenv.ExecuteActivity(pipelines.StepBroadcast, activities.BroadcastInput{Context: sc, Checkpoint: "/c"})
	if err == nil || !strings.Contains(err.Error(), "UNSET") || !strings.Contains(err.Error(), activities.ErrTypeBadInput) {
		t.Fatalf("missing key: %v", err)
	}
}
