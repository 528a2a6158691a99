package activities

import (
	"context"

	"github.com/rlflow/rlflow/pipelines"
)

// ValidateSpec checks a pipeline given inline in a run's input (JSON text,
// as the Temporal UI's start form, a schedule or `rlflow run` sent it) with
// the loader `rlflow validate` uses, on the worker, before anything of the
// run starts. It returns the loaded pipeline, which the run then uses and
// which its history keeps; an invalid spec fails with a non-retryable
// BadInput holding the loader's errors (pipelines.Brief: the first 20,
// `spec:LINE:COL: field: problem`), which quote the spec's values only
// briefly and nothing of the worker's files or environment.
//
// The text comes as bytes (a binary/plain payload), as it was written: not
// a json.RawMessage, which encoding/json would compact (the errors'
// positions would not be those of the text the user wrote), nor a string,
// whose JSON escapes could make it larger than the run's input, which
// Temporal accepted.
func (a *Activities) ValidateSpec(ctx context.Context, spec []byte) (*pipelines.Pipeline, error) {
	p, err := pipelines.LoadJSON(pipelines.InlineSpec, spec)
	if err != nil {
		return nil, badInput(ctx, "invalid pipeline spec:\n%s", pipelines.Brief(err))
	}
	return p, nil
}
