package workflows

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"
)

// useStartDoubles readies an environment for tests of the interpreter that
// start rlflow.Pipeline with hand-built specs (step type "step", which no
// loader knows) and rlflow.Iteration directly: validate_spec is
// acceptSpecDouble, and rlflow.Iteration sees a parent (asChildDouble).
// The tests of validation (below) use the real activity and no parent.
func useStartDoubles(env *testsuite.TestWorkflowEnvironment) {
	env.RegisterActivityWithOptions(acceptSpecDouble, activity.RegisterOptions{Name: ValidateSpecActivity})
	env.SetWorkerOptions(worker.Options{Interceptors: []interceptor.WorkerInterceptor{&asChildDouble{}}})
}

// acceptSpecDouble is a test double of validate_spec that accepts any spec
// that decodes.
func acceptSpecDouble(_ context.Context, spec []byte) (*pipelines.Pipeline, error) {
	var p pipelines.Pipeline
	if err := json.Unmarshal(spec, &p); err != nil {
		return nil, temporal.NewNonRetryableApplicationError(err.Error(), pipelines.ErrTypeBadInput, nil)
	}
	return &p, nil
}

// asChildDouble is a test double of Temporal's parent link: rlflow.Iteration
// started directly by a test sees a parent, as when rlflow.Pipeline starts it.
type asChildDouble struct {
	interceptor.WorkerInterceptorBase
}

func (*asChildDouble) InterceptWorkflow(_ workflow.Context, next interceptor.WorkflowInboundInterceptor) interceptor.WorkflowInboundInterceptor {
	return &asChildInbound{WorkflowInboundInterceptorBase: interceptor.WorkflowInboundInterceptorBase{Next: next}}
}

type asChildInbound struct {
	interceptor.WorkflowInboundInterceptorBase
}

func (i *asChildInbound) Init(outbound interceptor.WorkflowOutboundInterceptor) error {
	return i.Next.Init(&asChildOutbound{WorkflowOutboundInterceptorBase: interceptor.WorkflowOutboundInterceptorBase{Next: outbound}})
}

type asChildOutbound struct {
	interceptor.WorkflowOutboundInterceptorBase
}

func (o *asChildOutbound) GetInfo(ctx workflow.Context) *workflow.Info {
	info := o.Next.GetInfo(ctx)
	if info.ParentWorkflowExecution != nil || info.WorkflowType.Name != IterationWorkflow {
		return info
	}
	c := *info
	c.ParentWorkflowExecution = &workflow.Execution{ID: "test-parent", RunID: "test-parent-run"}
	return &c
}

// activityLog records the activity types an environment started, in order.
type activityLog struct {
	mu    sync.Mutex
	types []string
}

func (l *activityLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.types...)
}

// newValidatingEnv runs rlflow.Pipeline as a worker does: the real
// validate_spec, load_pipeline as loadFileDouble, and the fake steps under
// noop (the step type the specs below use).
func newValidatingEnv(t *testing.T, f *fakeSteps) (*testsuite.TestWorkflowEnvironment, *activityLog) {
	t.Helper()
	var s suite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterWorkflowWithOptions(RunPipeline, workflow.RegisterOptions{Name: PipelineWorkflow})
	env.RegisterWorkflowWithOptions(RunIteration, workflow.RegisterOptions{Name: IterationWorkflow})
	env.RegisterActivityWithOptions(activities.New(activities.Deps{}).ValidateSpec, activity.RegisterOptions{Name: ValidateSpecActivity})
	env.RegisterActivityWithOptions(loadFileDouble, activity.RegisterOptions{Name: LoadPipelineActivity})
	env.RegisterActivityWithOptions(f.run, activity.RegisterOptions{Name: pipelines.StepNoop})
	log := &activityLog{}
	env.SetOnActivityStartedListener(func(info *activity.Info, _ context.Context, _ converter.EncodedValues) {
		log.mu.Lock()
		log.types = append(log.types, info.ActivityType.Name)
		log.mu.Unlock()
	})
	env.SetTestTimeout(30 * time.Second)
	return env, log
}

// loadFileDouble is a test double of load_pipeline: the loader without the
// worker's path rules.
func loadFileDouble(_ context.Context, path string) (*pipelines.Pipeline, error) {
	p, err := pipelines.LoadFile(path)
	if err != nil {
		return nil, temporal.NewNonRetryableApplicationError(pipelines.Brief(err), pipelines.ErrTypeBadInput, nil)
	}
	return p, nil
}

// validSpec is a spec as the UI's start form would hold it.
const validSpec = `{
  "version": 1,
  "name": "ui-run",
  "base_dir": "/data",
  "params": {"n": {"type": "int", "default": 2}},
  "loop": {"iterations": 1},
  "steps": [
    {"id": "a", "uses": "noop"},
    {"id": "b", "uses": "noop", "needs": ["a"], "with": {"outputs": {"n": "${{ params.n }}"}}}
  ]
}`

func badInputOf(t *testing.T, err error) *temporal.ApplicationError {
	t.Helper()
	var app *temporal.ApplicationError
	require.True(t, errors.As(err, &app), "not an ApplicationError: %v", err)
	assert.Equal(t, pipelines.ErrTypeBadInput, app.Type())
	assert.True(t, app.NonRetryable(), "retryable: %v", err)
	return app
}

// TestStrictInputRefusedBeforeAnythingRuns: every bad input fails the run
// with a non-retryable BadInput naming the field, before any step (and,
// for problems of the input itself, before any activity) runs.
func TestStrictInputRefusedBeforeAnythingRuns(t *testing.T) {
	spec := validSpec
	for _, tc := range []struct {
		name  string
		input string
		want  []string
		// validated: the spec reached validate_spec (problems inside it).
		validated bool
	}{
		{name: "unknown field", input: `{"spec": ` + spec + `, "spce_path": "/x"}`,
			want: []string{`"spce_path": unknown field; the input takes spec, spec_path, params, search_attributes`}},
		{name: "spec as a string", input: `{"spec": "version: 1\nname: x"}`,
			want: []string{"spec: must be the pipeline as a JSON object (a pipeline file's keys: version, name, base_dir, steps, ...), got a string; for a file the worker can read, give spec_path"}},
		{name: "spec as a list", input: `{"spec": []}`, want: []string{"spec: must be the pipeline as a JSON object", "got a list"}},
		{name: "spec_path as a number", input: `{"spec_path": 7}`, want: []string{"spec_path: must be a string, got number"}},
		{name: "params as a list", input: `{"spec": ` + spec + `, "params": [1]}`, want: []string{"params: must be a JSON object from param name to value, got a list"}},
		{name: "search_attributes as a string", input: `{"spec": ` + spec + `, "search_attributes": "yes"}`, want: []string{"search_attributes: must be true or false, got string"}},
		{name: "field twice", input: `{"spec_path": "/a", "spec_path": "/b"}`, want: []string{`"spec_path": given twice`}},
		{name: "both spec and spec_path", input: `{"spec": ` + spec + `, "spec_path": "/data/p.yaml"}`, want: []string{"give spec or spec_path, not both"}},
		{name: "neither", input: `{"params": {"n": 3}}`, want: []string{"give spec (the pipeline as JSON) or spec_path (a pipeline file the worker can read)"}},
		{name: "empty object", input: `{}`, want: []string{"give spec (the pipeline as JSON) or spec_path"}},
		{name: "null", input: `null`, want: []string{"the input is empty"}},
		{name: "not an object", input: `"/etc/shadow"`, want: []string{"the input must be a JSON object with spec or spec_path, and params; got a string"}},
		{name: "carried fields on a new run", input: `{"spec": ` + spec + `, "next_iteration": 5, "weights": {"version": "v", "checkpoint": "/etc"}, "vllm": []}`,
			want: []string{"next_iteration: is carried by rlflow from a run to the one it continues as; a new run cannot set it",
				"weights: is carried by rlflow", "vllm: is carried by rlflow"}},
		{name: "every problem at once", input: `{"spec": 1, "spec_path": false, "x": 1}`,
			want: []string{"spec: must be the pipeline as a JSON object", "spec_path: must be a string, got bool", `"x": unknown field`}},
		{name: "empty spec", input: `{"spec": {}}`, validated: true,
			want: []string{"invalid pipeline spec:\nspec:1:1: base_dir: is required in a spec given as JSON", "spec:1:1: name: is required", "spec:1:1: steps: is required", "spec:1:1: version: is required"}},
		{name: "self-cycle", input: `{"spec": {"version": 1, "name": "c", "base_dir": "/d", "steps": [{"id": "a", "uses": "noop", "needs": ["a"]}]}}`, validated: true,
			want: []string{"spec:1:83: steps[0].needs[0]: a step cannot need itself"}},
		{name: "missing need", input: `{"spec": {"version": 1, "name": "c", "base_dir": "/d", "steps": [{"id": "a", "uses": "noop", "needs": ["z"]}]}}`, validated: true,
			want: []string{`steps[0].needs[0]: unknown step "z"`}},
		{name: "unknown field in the spec", input: `{"spec": {"version": 1, "name": "c", "base_dir": "/d", "steps": [{"id": "a", "uses": "noop", "run": "id"}]}}`, validated: true,
			want: []string{`steps[0].run: unknown key "run"`}},
		{name: "steps as an object", input: `{"spec": {"version": 1, "name": "c", "base_dir": "/d", "steps": {"a": {"uses": "noop"}}}}`, validated: true,
			want: []string{"steps: must be a list, got a mapping"}},
		{name: "exec step validation refuses", input: `{"spec": {"version": 1, "name": "c", "base_dir": "/d", "steps": [{"id": "a", "uses": "exec", "with": {"command": "id"}}]}}`, validated: true,
			want: []string{`steps[0].with.command: must be a list of strings, got string "id"`}},
		{name: "unknown param", input: `{"spec": ` + spec + `, "params": {"m": 1}}`, validated: true,
			want: []string{`params: unknown param "m" (declared: n)`}},
		{name: "param of the wrong type", input: `{"spec": ` + spec + `, "params": {"n": "many"}}`, validated: true,
			want: []string{`params: param "n": must be an integer, got string "many"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake()
			env, log := newValidatingEnv(t, f)
			env.ExecuteWorkflow(PipelineWorkflow, json.RawMessage(tc.input))
			require.True(t, env.IsWorkflowCompleted())
			app := badInputOf(t, env.GetWorkflowError())
			for _, w := range tc.want {
				assert.Contains(t, app.Message(), w)
			}
			assert.NotContains(t, app.Message(), "activity error", "the activity wrapper's ids stay out of the message")
			assert.Empty(t, f.calls, "no step ran")
			want := []string(nil)
			if tc.validated {
				want = []string{ValidateSpecActivity}
			}
			assert.Equal(t, want, log.all())
		})
	}
}

// TestInlineSpecRunsAsValidated: a valid spec given as the UI gives it runs
// the pipeline the loader returned (defaults filled in, params typed).
func TestInlineSpecRunsAsValidated(t *testing.T) {
	f := newFake()
	env, log := newValidatingEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, map[string]any{"spec": json.RawMessage(validSpec), "params": map[string]any{"n": 3}})
	require.NoError(t, env.GetWorkflowError())
	assert.Equal(t, []string{ValidateSpecActivity, pipelines.StepNoop, pipelines.StepNoop}, log.all())
	assert.Equal(t, []string{"a", "b"}, f.calls)
	assert.Equal(t, map[string]any{"n": float64(3)}, f.seen["b"]["outputs"], "the param resolved against the validated spec")
	sc := f.seen["a"][pipelines.ContextArg].(map[string]any)
	assert.Equal(t, "/data", sc["base_dir"])
}

// TestSpecPathLoadedOnWorker: spec_path goes through load_pipeline, not
// validate_spec, and the loaded spec is what runs.
func TestSpecPathLoadedOnWorker(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "p.yaml")
	require.NoError(t, os.WriteFile(file, []byte("version: 1\nname: from-file\nsteps:\n  - {id: only, uses: noop}\n"), 0o644))
	f := newFake()
	env, log := newValidatingEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, map[string]any{"spec_path": file})
	require.NoError(t, env.GetWorkflowError())
	assert.Equal(t, []string{LoadPipelineActivity, pipelines.StepNoop}, log.all())
	assert.Equal(t, dir, f.seen["only"][pipelines.ContextArg].(map[string]any)["base_dir"])

	env, log = newValidatingEnv(t, newFake())
	require.NoError(t, os.WriteFile(file, []byte("version: 1\nname: from-file\nsteps:\n  - {id: only, uses: noop, needs: [only]}\n"), 0o644))
	env.ExecuteWorkflow(PipelineWorkflow, map[string]any{"spec_path": file})
	app := badInputOf(t, env.GetWorkflowError())
	assert.Contains(t, app.Message(), "steps[0].needs[0]: a step cannot need itself")
	assert.Equal(t, []string{LoadPipelineActivity}, log.all())
}

// TestContinueAsNewValidatesAgain: a continued run validates its spec like
// a new one (next_iteration skips nothing), and a run continued by an older
// worker, whose spec has its params as a list, validates too.
func TestContinueAsNewValidatesAgain(t *testing.T) {
	f := newFake()
	env, _ := newValidatingEnv(t, f)
	env.ExecuteWorkflow(PipelineWorkflow, map[string]any{"spec": json.RawMessage(strings.Replace(validSpec,
		`"loop": {"iterations": 1}`, `"loop": {"iterations": 3, "continue_as_new_every": 1}`, 1))})
	var can *workflow.ContinueAsNewError
	require.True(t, errors.As(env.GetWorkflowError(), &can), "got %v", env.GetWorkflowError())
	var next map[string]json.RawMessage
	require.NoError(t, defaultConverter().FromPayloads(can.Input, &next))
	assert.JSONEq(t, `2`, string(next["next_iteration"]))
	var carried map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(next["spec"], &carried))
	assert.JSONEq(t, `{"n": {"type": "int", "default": 2}}`, string(carried["params"]), "the spec travels in the file's form")

	run := func(input any) (*activityLog, error) {
		env, log := newValidatingEnv(t, newFake())
		env.SetContinuedExecutionRunID("previous-run")
		env.ExecuteWorkflow(PipelineWorkflow, input)
		return log, env.GetWorkflowError()
	}
	log, err := run(next)
	require.True(t, errors.As(err, &can), "iteration 2 then continue again: %v", err)
	assert.Equal(t, []string{ValidateSpecActivity, pipelines.StepNoop, pipelines.StepNoop}, log.all())

	tampered := map[string]json.RawMessage{}
	for k, v := range next {
		tampered[k] = v
	}
	tampered["spec"] = json.RawMessage(`{"version": 1, "name": "x", "base_dir": "/d", "steps": [{"id": "a", "uses": "noop", "needs": ["a"]}]}`)
	log, err = run(tampered)
	assert.Contains(t, badInputOf(t, err).Message(), "a step cannot need itself")
	assert.Equal(t, []string{ValidateSpecActivity}, log.all())

	legacy := map[string]json.RawMessage{}
	for k, v := range next {
		legacy[k] = v
	}
	legacy["spec"] = json.RawMessage(`{"version": 1, "name": "old", "base_dir": "/d", "params": [{"name": "n", "type": "int", "default": 2}],
	  "loop": {"iterations": 2}, "steps": [{"id": "a", "uses": "noop", "with": {"outputs": {"n": "${{ params.n }}"}}}]}`)
	log, err = run(legacy)
	require.NoError(t, err)
	assert.Equal(t, []string{ValidateSpecActivity, pipelines.StepNoop}, log.all())

	_, err = run(map[string]any{"spec": json.RawMessage(validSpec), "gpu_host": map[string]any{"task_queue": "q", "evil": 1}})
	assert.Contains(t, badInputOf(t, err).Message(), `gpu_host: unknown field "evil"`)
	_, err = run(map[string]any{"spec": json.RawMessage(validSpec), "next_iteration": 2.5})
	assert.Contains(t, badInputOf(t, err).Message(), "next_iteration: must be an integer, got number 2.5")

	// The run's record of its servers is carried too, strictly.
	withVLLM := map[string]json.RawMessage{}
	for k, v := range next {
		withVLLM[k] = v
	}
	withVLLM["vllm"] = json.RawMessage(`[{"url": "http://a:8000", "version": "0.30.0", "api": "E"}]`)
	_, err = run(withVLLM)
	require.True(t, errors.As(err, &can), "a carried vllm record is taken: %v", err)
	withVLLM["vllm"] = json.RawMessage(`[{"url": "http://a:8000", "evil": 1}]`)
	_, err = run(withVLLM)
	assert.Contains(t, badInputOf(t, err).Message(), `vllm: unknown field "evil"`)
	many := make([]map[string]string, maxVLLMRecords+1)
	for i := range many {
		many[i] = map[string]string{"url": fmt.Sprintf("http://h%d:8000", i)}
	}
	b, _ := json.Marshal(many)
	withVLLM["vllm"] = b
	_, err = run(withVLLM)
	assert.Contains(t, badInputOf(t, err).Message(), fmt.Sprintf("vllm: at most %d servers, got %d", maxVLLMRecords, maxVLLMRecords+1))
}

// TestIterationRefusesWithoutParent: rlflow.Iteration started directly
// (the UI, a client) runs nothing.
func TestIterationRefusesWithoutParent(t *testing.T) {
	f := newFake()
	env, log := newValidatingEnv(t, f)
	env.ExecuteWorkflow(IterationWorkflow, IterationInput{Spec: spec(step("a")), Iteration: 1, RunID: "run"})
	require.True(t, env.IsWorkflowCompleted())
	app := badInputOf(t, env.GetWorkflowError())
	assert.Equal(t, "rlflow.Iteration runs only as a child of rlflow.Pipeline; start rlflow.Pipeline", app.Message())
	assert.Empty(t, log.all())
	assert.Empty(t, f.calls)
}
