package activities

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
)

// MaxConcurrency bounds the concurrency of generate, evaluate and the http
// and judge scorers: the shared HTTP client keeps this many idle
// connections per server, so every request in flight reuses a connection.
const MaxConcurrency = 1024

func (a *Activities) getenv(name string) string {
	if a.Getenv != nil {
		return a.Getenv(name)
	}
	return os.Getenv(name)
}

// httpClient is the one client every server request of this worker goes
// through: a transport per step would leave its idle connections behind.
func (a *Activities) httpClient() *http.Client {
	if a.HTTPClient != nil {
		return a.HTTPClient
	}
	a.httpOnce.Do(func() { a.http = vllm.NewHTTPClient(MaxConcurrency) })
	return a.http
}

// apiKey reads the bearer token named by env from the worker's environment;
// a named variable that is unset or empty is an error (sending no key would
// only fail later with a 401 that does not say why).
func (a *Activities) apiKey(env string) (string, error) {
	if env == "" {
		return "", nil
	}
	key := a.getenv(env)
	if key == "" {
		return "", fmt.Errorf("api_key_env names %s, which is not set in the worker's environment", env)
	}
	return key, nil
}

// fleet builds a client per pipeline server, with the step's timeouts.
func (a *Activities) fleet(ctx context.Context, step string, sc pipelines.StepContext, t vllm.Timeouts) (vllm.Fleet, error) {
	if len(sc.Servers) == 0 {
		return nil, badInput(ctx, "%s: the pipeline has no servers (add a servers: list of vLLM URLs)", step)
	}
	f := make(vllm.Fleet, len(sc.Servers))
	for i, s := range sc.Servers {
		c, err := a.client(s, t)
		if err != nil {
			return nil, badInput(ctx, "%s: servers[%d] (%s): %v", step, i, s.URL, err)
		}
		f[i] = c
	}
	return f, nil
}

func (a *Activities) client(s pipelines.Server, t vllm.Timeouts) (*vllm.Client, error) {
	key, err := a.apiKey(s.APIKeyEnv)
	if err != nil {
		return nil, err
	}
	var gen vllm.Generation
	if s.API != "" {
		if gen, err = vllm.ParseGeneration(s.API); err != nil {
			return nil, err
		}
	}
	return vllm.New(s.URL, vllm.Options{APIKey: key, HTTPClient: a.httpClient(), Timeouts: t, Generation: gen})
}

// fleetError collects per-server errors into a *vllm.FleetError, or nil.
func fleetError(op string, f vllm.Fleet, errs []error) error {
	fe := &vllm.FleetError{Op: op, Total: len(f)}
	for i, err := range errs {
		if err != nil {
			fe.Failed = append(fe.Failed, vllm.ServerError{Server: f[i].URL(), Err: err})
		}
	}
	if len(fe.Failed) == 0 {
		return nil
	}
	return fe
}

// serverError types a vllm error: retryable unless the server (or the
// client, before sending) refused the request for good. When the step's own
// context ended, that is the error, so Temporal sees a cancel or timeout.
func serverError(ctx context.Context, err error, format string, args ...any) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	// The cause's text follows the message in the error's text (and in the
	// Temporal UI): the message only says which step and which call failed.
	return stepError(ctx, classify(err), err, format, args...)
}

// classify returns ErrTypeServerRejected when err is final: every failed
// server of a FleetError refused for good, or the one vllm.Error did.
func classify(err error) string {
	var fe *vllm.FleetError
	if errors.As(err, &fe) {
		for _, f := range fe.Failed {
			if classify(f.Err) != ErrTypeServerRejected {
				return ErrTypeServerError
			}
		}
		if len(fe.Failed) > 0 {
			return ErrTypeServerRejected
		}
		return ErrTypeServerError
	}
	var e *vllm.Error
	if !errors.As(err, &e) {
		return ErrTypeServerError
	}
	if final(e.Status, e.Err) {
		return ErrTypeServerRejected
	}
	return ErrTypeServerError
}

// final reports whether an HTTP outcome can never change on a retry: a 4xx
// other than timeouts, conflicts and rate limits, or a request the client
// refused to send (no status, no transport error).
func final(status int, transportErr error) bool {
	switch {
	case status == 0:
		return transportErr == nil
	case status == http.StatusRequestTimeout, status == http.StatusConflict,
		status == http.StatusTooEarly, status == http.StatusTooManyRequests:
		return false
	}
	return status >= 400 && status < 500
}

// notAvailable reports whether err says the server has no such route (404:
// an older vLLM, or dev mode off) or its API generation lacks the call.
func notAvailable(err error) bool {
	var e *vllm.Error
	return errors.As(err, &e) && (e.Status == http.StatusNotFound || (e.Status == 0 && e.Err == nil))
}
