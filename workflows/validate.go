package workflows

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/rlflow/rlflow/pipelines"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
)

// inputValidationChange is the workflow.GetVersion change that made the
// pipeline workflow decode its input strictly and validate an inline spec
// on the worker (ValidateSpecActivity). Runs started before it replay on
// their old path (trustedInput).
const inputValidationChange = "validate-input"

// validationActivity bounds the validate_spec and load_pipeline calls: the
// loader takes well under a second on the largest spec; retries are for a
// worker lost mid-call (a BadInput is never retried).
var validationActivity = workflow.ActivityOptions{
	StartToCloseTimeout: time.Minute,
	RetryPolicy:         &temporal.RetryPolicy{MaximumAttempts: 3},
}

// The fields of a run's input (PipelineInput's JSON names): what a caller
// gives, and what rlflow carries from a run to the one it continues as.
var (
	callerFields  = []string{"spec", "spec_path", "params", "search_attributes"}
	carriedFields = []string{"next_iteration", "paused", "recent", "gpu_host", "weights", "vllm"}
)

// maxVLLMRecords bounds the carried record of servers (PipelineInput.VLLM):
// one per server URL the run talked to, far fewer in any real pipeline.
const maxVLLMRecords = 1024

// startInput is a run's input decoded, the spec still JSON text.
type startInput struct {
	in   PipelineInput // all but Spec
	spec json.RawMessage
	// carried lists the continue-as-new fields the input sets.
	carried []string
}

// validatedInput decodes a run's input strictly and returns it with its
// spec validated on the worker: an inline spec by ValidateSpecActivity,
// spec_path by LoadPipelineActivity. Every problem of the input is one
// non-retryable BadInput, and nothing runs before these checks pass.
func validatedInput(ctx workflow.Context, raw json.RawMessage) (PipelineInput, error) {
	continued := workflow.GetInfo(ctx).ContinuedExecutionRunID != ""
	s, err := decodeInput(raw)
	if err == nil {
		err = s.check(continued)
	}
	if err != nil {
		return PipelineInput{}, badInput("invalid %s input:\n%v", PipelineWorkflow, err)
	}
	in := s.in
	if continued && s.spec != nil {
		s.spec = upgradeParams(s.spec)
	}
	actx := workflow.WithActivityOptions(ctx, withSummary(validationActivity, "load the pipeline file"))
	if in.SpecPath != "" {
		if err := workflow.ExecuteActivity(actx, LoadPipelineActivity, in.SpecPath).Get(ctx, &in.Spec); err != nil {
			return in, validationFailure("loading spec_path", err)
		}
		// The run's history holds the spec from here on; a continued
		// run gets it inline, never the file again.
		in.SpecPath = ""
		return in, nil
	}
	// As []byte, not json.RawMessage, which the SDK would encode as JSON.
	actx = workflow.WithActivityOptions(ctx, withSummary(validationActivity, "validate the pipeline"))
	if err := workflow.ExecuteActivity(actx, ValidateSpecActivity, []byte(s.spec)).Get(ctx, &in.Spec); err != nil {
		return in, validationFailure("validating spec", err)
	}
	return in, nil
}

// trustedInput is the input as runs started before inputValidationChange
// read it, kept for their replay: decoded as the SDK decoded a typed
// input, an inline spec trusted, spec_path loaded on the worker.
func trustedInput(ctx workflow.Context, raw json.RawMessage) (PipelineInput, error) {
	var in PipelineInput
	if err := json.Unmarshal(raw, &in); err != nil {
		return in, fmt.Errorf("decoding the input: %w", err)
	}
	if in.Spec != nil {
		return in, nil
	}
	if in.SpecPath == "" {
		return in, temporal.NewNonRetryableApplicationError("pipeline input needs spec or spec_path", pipelines.ErrTypeBadInput, nil)
	}
	lctx := workflow.WithActivityOptions(ctx, withSummary(validationActivity, "load the pipeline file"))
	if err := workflow.ExecuteActivity(lctx, LoadPipelineActivity, in.SpecPath).Get(ctx, &in.Spec); err != nil {
		return in, fmt.Errorf("loading %s: %w", in.SpecPath, err)
	}
	in.SpecPath = ""
	return in, nil
}

// validationFailure is the run's error when its spec did not validate: the
// activity's BadInput as the run's own, non-retryable, without the
// activity wrapper's ids; any other failure (the worker lost three times)
// wrapped as it is.
func validationFailure(what string, err error) error {
	var app *temporal.ApplicationError
	if errors.As(err, &app) && app.Type() == pipelines.ErrTypeBadInput {
		return badInput("%s", app.Message())
	}
	return fmt.Errorf("%s: %w", what, err)
}

func badInput(format string, args ...any) error {
	return temporal.NewNonRetryableApplicationError(fmt.Sprintf(format, args...), pipelines.ErrTypeBadInput, nil)
}

// decodeInput decodes a run's input as PipelineInput strictly: a JSON
// object, each field once, every field known and of its type. Unlike
// encoding/json it drops nothing and reports every problem, one per line,
// naming the field; it quotes no value but a field name, clipped.
func decodeInput(raw json.RawMessage) (startInput, error) {
	var s startInput
	data := bytes.TrimSpace(raw)
	switch {
	case len(data) == 0 || string(data) == "null":
		return s, errors.New("the input is empty: want a JSON object with spec (the pipeline as JSON) or spec_path (a pipeline file the worker can read), and params")
	case data[0] != '{':
		return s, fmt.Errorf("the input must be a JSON object with spec or spec_path, and params; got %s", jsonKind(data))
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if _, err := dec.Token(); err != nil {
		return s, fmt.Errorf("the input is not valid JSON: %v", err)
	}
	seen := map[string]bool{}
	var probs []string
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return s, fmt.Errorf("the input is not valid JSON: %v", err)
		}
		key, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return s, fmt.Errorf("the input is not valid JSON: %v", err)
		}
		if seen[key] {
			probs = append(probs, fmt.Sprintf("%s: given twice", clipName(key)))
			continue
		}
		seen[key] = true
		if err := s.set(key, v); err != nil {
			probs = append(probs, err.Error())
		}
	}
	if len(probs) > 0 {
		return s, errors.New(strings.Join(probs, "\n"))
	}
	return s, nil
}

// set decodes one field; null is the field left out.
func (s *startInput) set(key string, v json.RawMessage) error {
	if string(v) == "null" {
		return nil
	}
	switch key {
	case "spec":
		if v[0] != '{' {
			return fmt.Errorf("spec: must be the pipeline as a JSON object (a pipeline file's keys: version, name, base_dir, steps, ...), got %s; for a file the worker can read, give spec_path", jsonKind(v))
		}
		s.spec = v
		return nil
	case "spec_path":
		return decodeField(key, v, &s.in.SpecPath)
	case "params":
		if v[0] != '{' {
			return fmt.Errorf("params: must be a JSON object from param name to value, got %s", jsonKind(v))
		}
		return decodeField(key, v, &s.in.Params)
	case "search_attributes":
		return decodeField(key, v, &s.in.SearchAttributes)
	}
	if slices.Contains(carriedFields, key) {
		s.carried = append(s.carried, key)
	}
	switch key {
	case "next_iteration":
		if err := decodeField(key, v, &s.in.NextIteration); err != nil {
			return err
		}
		if s.in.NextIteration < 0 {
			return fmt.Errorf("next_iteration: must not be negative, got %d", s.in.NextIteration)
		}
		return nil
	case "paused":
		return decodeField(key, v, &s.in.Paused)
	case "recent":
		if err := decodeField(key, v, &s.in.Recent); err != nil {
			return err
		}
		if len(s.in.Recent) > RecentIterations {
			return fmt.Errorf("recent: at most %d iterations, got %d", RecentIterations, len(s.in.Recent))
		}
		return nil
	case "gpu_host":
		return decodeField(key, v, &s.in.GPUHost)
	case "weights":
		return decodeField(key, v, &s.in.Weights)
	case "vllm":
		if err := decodeField(key, v, &s.in.VLLM); err != nil {
			return err
		}
		if len(s.in.VLLM) > maxVLLMRecords {
			return fmt.Errorf("vllm: at most %d servers, got %d", maxVLLMRecords, len(s.in.VLLM))
		}
		return nil
	}
	return fmt.Errorf("%s: unknown field; the input takes %s", clipName(key), strings.Join(callerFields, ", "))
}

// check applies the rules between fields: exactly one of spec and
// spec_path, and continue-as-new fields only in a continued run (a run
// started anew, from the UI say, cannot pick its iteration, GPU worker or
// expected weights).
func (s *startInput) check(continued bool) error {
	var probs []string
	if !continued {
		for _, f := range s.carried {
			probs = append(probs, fmt.Sprintf("%s: is carried by rlflow from a run to the one it continues as; a new run cannot set it", f))
		}
	}
	switch {
	case s.spec != nil && s.in.SpecPath != "":
		probs = append(probs, "give spec or spec_path, not both")
	case s.spec == nil && s.in.SpecPath == "":
		probs = append(probs, "give spec (the pipeline as JSON) or spec_path (a pipeline file the worker can read)")
	}
	if len(probs) > 0 {
		return errors.New(strings.Join(probs, "\n"))
	}
	return nil
}

// upgradeParams rewrites a spec's params from the list that rlflow wrote
// into continue-as-new input before inputValidationChange to the file's
// mapping, which the loader reads: a run continued by an older worker then
// validates like any other. Anything else is left to the loader.
func upgradeParams(spec json.RawMessage) json.RawMessage {
	var top map[string]json.RawMessage
	if json.Unmarshal(spec, &top) != nil || len(bytes.TrimSpace(top["params"])) == 0 || bytes.TrimSpace(top["params"])[0] != '[' {
		return spec
	}
	var params pipelines.ParamList
	if json.Unmarshal(top["params"], &params) != nil {
		return spec
	}
	b, err := json.Marshal(params)
	if err != nil {
		return spec
	}
	top["params"] = b
	out, err := json.Marshal(top)
	if err != nil {
		return spec
	}
	return out
}

// decodeField decodes a field's value into out, refusing unknown fields of
// objects, and words a type error with the field's path.
func decodeField(name string, v json.RawMessage, out any) error {
	dec := json.NewDecoder(bytes.NewReader(v))
	dec.DisallowUnknownFields()
	err := dec.Decode(out)
	if err == nil {
		return nil
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		path := name
		if te.Field != "" {
			path += "." + te.Field
		}
		return fmt.Errorf("%s: must be %s, got %s", path, jsonWant(te.Type), te.Value)
	}
	if f, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		if u, err := strconv.Unquote(f); err == nil {
			f = u
		}
		return fmt.Errorf("%s: unknown field %s", name, clipName(f))
	}
	return fmt.Errorf("%s: %v", name, err)
}

// jsonWant names what a Go type wants as JSON.
func jsonWant(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Float64:
		return "a number"
	case reflect.Slice:
		return "a list"
	case reflect.Map, reflect.Struct, reflect.Pointer:
		return "an object"
	}
	return t.String()
}

// jsonKind names the kind of a JSON value from its first byte, never its
// content.
func jsonKind(v []byte) string {
	switch v[0] {
	case '{':
		return "an object"
	case '[':
		return "a list"
	case '"':
		return "a string"
	case 't', 'f':
		return "a bool"
	case 'n':
		return "null"
	}
	return "a number"
}

// clipName quotes a field name for an error, at most 60 characters of it.
func clipName(s string) string {
	if utf8.RuneCountInString(s) > 60 {
		s = string([]rune(s)[:57]) + "..."
	}
	return strconv.Quote(s)
}

func withSummary(o workflow.ActivityOptions, summary string) workflow.ActivityOptions {
	o.Summary = summary
	return o
}
