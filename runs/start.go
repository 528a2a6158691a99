// Package runs starts, watches and controls pipeline runs through a
// Temporal client: what the CLI's run/status/cancel/schedule commands do.
//
// Invariant: a run's spec is loaded and validated here, before anything is
// sent to Temporal, and then travels frozen in the workflow input as JSON
// (a pipeline file's keys); the worker never re-reads the file for that
// run, and validates the JSON again, as it does for every run however
// started, before anything runs.
package runs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/workflows"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/client"
)

// EnsureSearchAttributes registers rlflow's search attributes on the
// namespace if they are missing. It reports whether they are usable; an
// error means they are not (the run still works, without UI filtering).
func EnsureSearchAttributes(ctx context.Context, c client.Client, namespace string) (bool, error) {
	resp, err := c.OperatorService().ListSearchAttributes(ctx, &operatorservice.ListSearchAttributesRequest{Namespace: namespace})
	if err != nil {
		return false, fmt.Errorf("listing search attributes: %w", err)
	}
	missing := map[string]enumspb.IndexedValueType{}
	for name, typ := range workflows.SearchAttributeTypes {
		if _, ok := resp.CustomAttributes[name]; ok {
			continue
		}
		v, ok := enumspb.IndexedValueType_shorthandValue[typ]
		if !ok {
			return false, fmt.Errorf("search attribute %s: unknown type %s", name, typ)
		}
		missing[name] = enumspb.IndexedValueType(v)
	}
	if len(missing) == 0 {
		return true, nil
	}
	_, err = c.OperatorService().AddSearchAttributes(ctx, &operatorservice.AddSearchAttributesRequest{Namespace: namespace, SearchAttributes: missing})
	var exists *serviceerror.AlreadyExists
	if err != nil && !errors.As(err, &exists) {
		return false, fmt.Errorf("registering search attributes %v: %w", keys(missing), err)
	}
	return true, nil
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// StartOptions describe one run to start.
type StartOptions struct {
	Spec *pipelines.Pipeline
	// Params are the resolved launch values (Pipeline.ResolveParams).
	Params    map[string]any
	TaskQueue string
	// ID is the workflow id; empty = "<pipeline name>-<UTC time>-<random>".
	ID               string
	SearchAttributes bool
}

// NewRunID returns a workflow id for a new run of the named pipeline.
func NewRunID(name string) string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%s-%s", name, time.Now().UTC().Format("20060102T150405"), hex.EncodeToString(b[:]))
}

// Start starts a pipeline run.
func Start(ctx context.Context, c client.Client, o StartOptions) (client.WorkflowRun, error) {
	if o.ID == "" {
		o.ID = NewRunID(o.Spec.Name)
	}
	if o.TaskQueue == "" {
		o.TaskQueue = workflows.DefaultTaskQueue
	}
	// The worker validates the spec from its JSON before the run does
	// anything; the same check here reports a spec that would not pass
	// (one built in code without base_dir, say) before a run exists.
	if err := checkSpecJSON(o.Spec); err != nil {
		return nil, err
	}
	in := workflows.PipelineInput{Spec: o.Spec, Params: o.Params, SearchAttributes: o.SearchAttributes}
	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{
		ID:                       o.ID,
		TaskQueue:                o.TaskQueue,
		WorkflowIDConflictPolicy: enumspb.WORKFLOW_ID_CONFLICT_POLICY_FAIL,
		StaticSummary:            fmt.Sprintf("rlflow pipeline %s", o.Spec.Name),
	}, workflows.PipelineWorkflow, in)
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", o.ID, err)
	}
	return run, nil
}

// checkSpecJSON checks spec as the worker will: its JSON, with the loader
// of `rlflow validate` (pipelines.LoadJSON).
func checkSpecJSON(spec *pipelines.Pipeline) error {
	b, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("pipeline %s: encoding it as the run's input: %w", spec.Name, err)
	}
	if _, err := pipelines.LoadJSON(pipelines.InlineSpec, b); err != nil {
		return fmt.Errorf("pipeline %s: as the run's input it would not validate on the worker:\n%w", spec.Name, err)
	}
	return nil
}

// UIURL returns the Temporal UI page of a run.
func UIURL(uiBase, namespace, workflowID, runID string) string {
	return fmt.Sprintf("%s/namespaces/%s/workflows/%s/%s/history", strings.TrimRight(uiBase, "/"), namespace, escapeID(workflowID), runID)
}

func escapeID(id string) string { return strings.ReplaceAll(id, "/", "%2F") }
