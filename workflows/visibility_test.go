package workflows

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	sdkpb "go.temporal.io/api/sdk/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
)

// upserts records what a run upserts, one map per call.
type upserts struct {
	mu    sync.Mutex
	calls []temporal.SearchAttributes
}

func (u *upserts) record(env *testsuite.TestWorkflowEnvironment) {
	env.OnUpsertTypedSearchAttributes(mock.Anything).Run(func(args mock.Arguments) {
		u.mu.Lock()
		defer u.mu.Unlock()
		u.calls = append(u.calls, args.Get(0).(temporal.SearchAttributes))
	}).Return(nil).Maybe()
}

// statuses lists RlflowStatus as upserted, consecutive repeats dropped.
func (u *upserts) statuses() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []string
	for _, c := range u.calls {
		if s, ok := c.GetKeyword(SearchStatus); ok && (len(out) == 0 || out[len(out)-1] != s) {
			out = append(out, s)
		}
	}
	return out
}

func (u *upserts) last() temporal.SearchAttributes {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls[len(u.calls)-1]
}

// registeredDouble is a test double of SearchAttributesActivity.
func registeredDouble(names []string, err error) func(context.Context) ([]string, error) {
	return func(context.Context) ([]string, error) { return names, err }
}

func allAttributes() []string {
	return []string{"RlflowHeadline", "RlflowIteration", "RlflowPipeline", "RlflowStatus"}
}

func visibleEnv(t *testing.T, f *fakeSteps, registered []string, err error) (*testsuite.TestWorkflowEnvironment, *upserts) {
	env := newEnv(t, f)
	env.RegisterActivityWithOptions(registeredDouble(registered, err), activity.RegisterOptions{Name: SearchAttributesActivity})
	u := &upserts{}
	u.record(env)
	return env, u
}

// currentDetails reads what the UI shows as the workflow's current details.
func currentDetails(t *testing.T, env *testsuite.TestWorkflowEnvironment) string {
	t.Helper()
	v, err := env.QueryWorkflow("__temporal_workflow_metadata")
	require.NoError(t, err)
	var md sdkpb.WorkflowMetadata
	require.NoError(t, v.Get(&md))
	return md.GetCurrentDetails()
}

func scoredSpec() *pipelines.Pipeline {
	p := spec(step("train"), step("eval", "train"))
	p.Name = "rlhf-demo"
	p.Loop.Iterations = 2
	p.Metrics = &pipelines.Metrics{Headline: "eval.score"}
	return p
}

func scoreFake() *fakeSteps {
	f := newFake()
	f.script["train"] = &behaviour{outputs: func(i int) map[string]any { return map[string]any{"loss": 1.0 / float64(i), "checkpoint": "/ckpt"} }}
	f.script["eval"] = &behaviour{outputs: func(i int) map[string]any { return map[string]any{"score": 0.5 + 0.1*float64(i)} }}
	return f
}

func TestActivitySummaryNamesTheStep(t *testing.T) {
	p := spec(pipelines.Step{ID: "before", Uses: pipelines.StepGenerate})
	assert.Equal(t, "before · generate", activityOptions(p, &p.Steps[0]).Summary)
	assert.Equal(t, "rlhf-demo · iteration 2", iterationSummary("rlhf-demo", 2))
}

// A run pauses mid-iteration and resumes: RlflowStatus reads Paused while it
// is paused, Running again, then Completed, with the last headline value.
func TestSearchAttributesThroughPauseAndResume(t *testing.T) {
	f := scoreFake()
	env, u := visibleEnv(t, f, allAttributes(), nil)
	// The pause arrives while iteration 1's train runs: train waits for it.
	hold := &barrier{}
	hold.wg.Add(2)
	train := f.script["train"]
	f.script["train"] = &behaviour{outputs: train.outputs, block: hold, onStart: func() {
		f.mu.Lock()
		f.script["train"] = train
		f.mu.Unlock()
		env.SignalWorkflow(SignalPause, nil)
		hold.wg.Done()
	}}
	var pausedStatus, pausedDetails string
	env.RegisterDelayedCallback(func() {
		pausedStatus, _ = u.last().GetKeyword(SearchStatus)
		pausedDetails = currentDetails(t, env)
		env.SignalWorkflow(SignalResume, nil)
	}, time.Hour)
	env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: scoredSpec()})
	require.NoError(t, env.GetWorkflowError())

	assert.Equal(t, RunPaused, pausedStatus)
	assert.Contains(t, pausedDetails, "**rlhf-demo** · Paused")
	assert.Equal(t, []string{RunRunning, RunPaused, RunRunning, RunCompleted}, u.statuses())
	last := u.last()
	name, _ := last.GetKeyword(SearchPipeline)
	assert.Equal(t, "rlhf-demo", name)
	iter, _ := last.GetInt64(SearchIteration)
	assert.Equal(t, int64(2), iter)
	headline, ok := last.GetFloat64(SearchHeadline)
	require.True(t, ok, "RlflowHeadline upserted")
	assert.InDelta(t, 0.7, headline, 1e-9, "the last iteration's eval.score")

	details := currentDetails(t, env)
	assert.Contains(t, details, "**rlhf-demo** · Completed · iteration 2 of 2 · eval.score 0.7")
	assert.Contains(t, details, "| iteration | status | eval.score | train.loss |")
	assert.Contains(t, details, "| 1 | succeeded | 0.6 | 1 |")
	assert.Contains(t, details, "| 2 | succeeded | 0.7 | 0.5 |")
	assert.Contains(t, details, "Steps of iteration 2:")
	assert.Contains(t, details, "| eval · step | succeeded | 2 |") // the double counts attempts per run
	assert.Contains(t, details, "score=0.7")
}

func TestSearchAttributesOnFailureAndCancel(t *testing.T) {
	t.Run("failed", func(t *testing.T) {
		f := scoreFake()
		f.script["eval"] = &behaviour{failTimes: 9, failType: pipelines.ErrTypeBadInput}
		env, u := visibleEnv(t, f, allAttributes(), nil)
		env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: scoredSpec()})
		require.Error(t, env.GetWorkflowError())
		assert.Equal(t, []string{RunRunning, RunFailed}, u.statuses())
		_, hasHeadline := u.last().GetFloat64(SearchHeadline)
		assert.False(t, hasHeadline, "no iteration produced a score")
		assert.Contains(t, currentDetails(t, env), "| 1 | failed |")
	})
	t.Run("cancelled while paused", func(t *testing.T) {
		env, u := visibleEnv(t, scoreFake(), allAttributes(), nil)
		env.RegisterDelayedCallback(func() { env.SignalWorkflow(SignalPause, nil) }, 0)
		env.RegisterDelayedCallback(func() { env.CancelWorkflow() }, time.Hour)
		env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: scoredSpec()})
		require.True(t, temporal.IsCanceledError(env.GetWorkflowError()), "got %v", env.GetWorkflowError())
		assert.Equal(t, []string{RunRunning, RunPaused, RunCanceled}, u.statuses())
	})
}

// The run sets only the attributes its namespace has, and none when it
// cannot tell: an unregistered one would fail its workflow tasks.
func TestSearchAttributesOnlyThoseRegistered(t *testing.T) {
	for _, tc := range []struct {
		name       string
		registered []string
		err        error
		want       []string // attribute names upserted
	}{
		{name: "all", registered: allAttributes(), want: allAttributes()},
		{name: "an older namespace", registered: []string{"RlflowPipeline", "RlflowStatus", "Other"}, want: []string{"RlflowPipeline", "RlflowStatus"}},
		{name: "none", registered: nil},
		{name: "the check fails", err: errors.New("connection refused")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env, u := visibleEnv(t, scoreFake(), tc.registered, tc.err)
			env.ExecuteWorkflow(PipelineWorkflow, PipelineInput{Spec: scoredSpec()})
			require.NoError(t, env.GetWorkflowError(), "the run goes on either way")
			seen := map[string]bool{}
			for _, c := range u.calls {
				for k := range c.GetUntypedValues() {
					seen[k.GetName()] = true
				}
			}
			var got []string
			for _, n := range allAttributes() {
				if seen[n] {
					got = append(got, n)
				}
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestIterationDetailsShowTheSteps(t *testing.T) {
	f := scoreFake()
	f.script["train"].failTimes = 1
	f.script["train"].failType = "Flaky"
	env := newEnv(t, f)
	_, err := runIteration(t, env, scoredSpec())
	require.NoError(t, err)
	details := currentDetails(t, env)
	assert.Contains(t, details, "**rlhf-demo** · iteration 1 · Completed")
	assert.Contains(t, details, "| step | state | attempt | duration | outputs |")
	assert.Contains(t, details, "| train · step | succeeded | 2 |")
	assert.Contains(t, details, "loss=1 |")
	assert.Contains(t, details, "| eval · step | succeeded | 1 |")
	assert.NotContains(t, details, "/ckpt", "paths stay in the result")
}
