package worker

import (
	"testing"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
)

// recorder is an ActivityRegistry that records the names.
type recorder struct{ names map[string]bool }

func (r *recorder) RegisterActivity(any) { panic("register by name") }

func (r *recorder) RegisterActivityWithOptions(_ any, o activity.RegisterOptions) {
	r.names[o.Name] = true
}

func (r *recorder) RegisterDynamicActivity(any, activity.DynamicRegisterOptions) {
	panic("no dynamic activities")
}

// Every step type a pipeline may use has an activity of the same name.
func TestEveryStepTypeIsRegistered(t *testing.T) {
	r := &recorder{names: map[string]bool{}}
	RegisterControlActivities(r, activities.New(activities.Deps{}))
	for _, name := range pipelines.StepTypeNames() {
		if !r.names[name] {
			t.Errorf("step type %q has no activity registered under its name", name)
		}
	}
}
