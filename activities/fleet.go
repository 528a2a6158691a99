package activities

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
)

func (a *Activities) getenv(name string) string {
	if a.Getenv != nil {
		return a.Getenv(name)
	}
	return os.Getenv(name)
}

// httpClient is the one client every server request of this worker goes
// through: a transport per step would leave its idle connections behind.
// It keeps pipelines.MaxConcurrency idle connections per server, so every
// request of the widest step reuses one.
func (a *Activities) httpClient() *http.Client {
	if a.HTTPClient != nil {
		return a.HTTPClient
	}
	a.httpOnce.Do(func() { a.http = vllm.NewHTTPClient(pipelines.MaxConcurrency) })
	return a.http
}

// apiKey reads the bearer token named by env from the worker's environment;
// a named variable that is unset or empty is an error (sending no key would
// only fail later with a 401 that does not say why). The key becomes one of
// the worker's secrets, masked in everything it reports (a key shorter than
// redact.MinLen cannot be masked; rlflow never writes a key anyway).
func (a *Activities) apiKey(env string) (string, error) {
	if env == "" {
		return "", nil
	}
	key := a.getenv(env)
	if key == "" {
		return "", fmt.Errorf("api_key_env names %s, which is not set in the worker's environment", env)
	}
	a.secrets.Add(key)
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

// describeTimeout bounds describeServers: the facts are a record, never a
// reason to hold a step.
const describeTimeout = 5 * time.Second

// describeServers is what the run records about each server a step talked
// to (pipelines.MetaVLLM): its vLLM version and API generation. Best
// effort: a fact that cannot be read is recorded with the error's text.
func describeServers(ctx context.Context, f vllm.Fleet) []pipelines.VLLMServer {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), describeTimeout)
	defer cancel()
	out := make([]pipelines.VLLMServer, len(f))
	_ = f.Each("describe", func(i int, c *vllm.Client) error {
		out[i].URL = c.URL()
		// The generation first: its probe reads /version on the servers
		// that have sessions, and the client keeps that answer, so Version
		// then asks only servers whose probe did not.
		var errs []string
		g, gerr := c.DetectGeneration(ctx)
		if gerr != nil {
			errs = append(errs, "api generation: "+gerr.Error())
		}
		v, err := c.Version(ctx)
		if err != nil {
			errs = append(errs, "version: "+err.Error())
		}
		out[i].Version, out[i].API, out[i].Error = v, string(g), strings.Join(errs, "; ")
		return nil
	})
	return out
}
