package activities

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	"github.com/rlflow/rlflow/pipelines"
)

func TestValidateSpec(t *testing.T) {
	var s testsuite.WorkflowTestSuite
	manySteps := make([]string, 25)
	for i := range manySteps {
		manySteps[i] = fmt.Sprintf(`{"id": "s%d", "uses": "nope"}`, i)
	}
	for _, tc := range []struct {
		name, spec string
		want       []string // empty: valid
	}{
		{name: "valid", spec: `{"version": 1, "name": "ok", "base_dir": "/data",
  "params": {"n": {"type": "int", "default": 2}},
  "steps": [{"id": "a", "uses": "noop", "with": {"outputs": {"n": "${{ params.n }}"}}}]}`},
		{name: "empty spec", spec: `{}`, want: []string{"invalid pipeline spec:\nspec:1:1: base_dir: is required in a spec given as JSON", "spec:1:1: version: is required"}},
		{name: "positions of the text as written", spec: "{\n  \"version\": 1,\n  \"name\": \"p\",\n  \"base_dir\": \"/d\",\n  \"steps\": [\n    {\"id\": \"a\", \"uses\": \"noop\", \"needs\": [\"a\"]}\n  ]\n}",
			want: []string{"spec:6:43: steps[0].needs[0]: a step cannot need itself"}},
		{name: "not JSON", spec: `{"version": 1,}`, want: []string{"spec:1:15: invalid JSON: invalid character '}'"}},
		{name: "at most 20 problems", spec: `{"version": 1, "name": "m", "base_dir": "/d", "steps": [` + strings.Join(manySteps, ",") + `]}`,
			want: []string{`steps[19].uses: unknown step type "nope"`, "... and 5 more problems (rlflow validate lists them all)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := s.NewTestActivityEnvironment()
			env.RegisterActivity(New(Deps{}).ValidateSpec)
			v, err := env.ExecuteActivity(New(Deps{}).ValidateSpec, []byte(tc.spec))
			if len(tc.want) == 0 {
				require.NoError(t, err)
				var p pipelines.Pipeline
				require.NoError(t, v.Get(&p))
				assert.Equal(t, "/data", p.BaseDir)
				assert.Equal(t, pipelines.ParamList{{Name: "n", Type: pipelines.ParamInt, Default: float64(2)}}, p.Params)
				assert.Equal(t, 1, p.Loop.Iterations, "the loader's defaults are filled in")
				return
			}
			var app *temporal.ApplicationError
			require.True(t, errors.As(err, &app), "%v", err)
			assert.Equal(t, pipelines.ErrTypeBadInput, app.Type())
			assert.True(t, app.NonRetryable())
			for _, w := range tc.want {
				assert.Contains(t, app.Message(), w)
			}
			assert.LessOrEqual(t, strings.Count(app.Message(), "\n"), 21)
		})
	}
}
