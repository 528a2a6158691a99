package worker

import (
	"reflect"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/activities"
	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/activity"
)

// recorder is an ActivityRegistry that records each activity's input type
// under its registered name.
type recorder struct{ inputs map[string]reflect.Type }

func (r *recorder) RegisterActivity(any) { panic("register by name") }

func (r *recorder) RegisterActivityWithOptions(fn any, o activity.RegisterOptions) {
	t := reflect.TypeOf(fn)
	r.inputs[o.Name] = t.In(t.NumIn() - 1) // (ctx, in)
}

func (r *recorder) RegisterDynamicActivity(any, activity.DynamicRegisterOptions) {
	panic("no dynamic activities")
}

// Every step type a pipeline may use has an activity of the same name, and
// that activity's input struct matches the step type's ArgSpecs in the
// registry (names, Go types against kinds, defaults, pointers where a zero
// would be ambiguous): the loader, the docs and the activities cannot drift
// apart.
func TestEveryStepTypeIsRegisteredWithItsArguments(t *testing.T) {
	r := &recorder{inputs: map[string]reflect.Type{}}
	RegisterControlActivities(r, activities.New(activities.Deps{}))
	for _, name := range pipelines.StepTypeNames() {
		in, ok := r.inputs[name]
		if !ok {
			t.Errorf("step type %q has no activity registered under its name", name)
			continue
		}
		if probs := pipelines.ArgsStructProblems(name, in); len(probs) > 0 {
			t.Errorf("step type %q and %v disagree:\n  %s", name, in, strings.Join(probs, "\n  "))
		}
	}
}
