package activities

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlflow/rlflow/metrics"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"go.temporal.io/sdk/activity"
)

// GenerateInput is the `with` of a generate step (evaluate embeds it).
type GenerateInput struct {
	Context        pipelines.StepContext `json:"context"`
	Prompts        string                `json:"prompts"`
	Model          string                `json:"model,omitempty"`
	N              int                   `json:"n,omitempty"`
	MaxTokens      int                   `json:"max_tokens,omitempty"`
	Temperature    *float64              `json:"temperature,omitempty"`
	TopP           float64               `json:"top_p,omitempty"`
	Seed           *int                  `json:"seed,omitempty"`
	Stop           []string              `json:"stop,omitempty"`
	Logprobs       int                   `json:"logprobs,omitempty"`
	Concurrency    int                   `json:"concurrency,omitempty"`
	RequestTimeout pipelines.Duration    `json:"request_timeout,omitempty"`
	Output         string                `json:"output,omitempty"`
}

// GenerateOutput is a generate step's outputs.
type GenerateOutput struct {
	Path             string  `json:"path"`
	Prompts          int     `json:"prompts"`
	Samples          int     `json:"samples"`
	CompletionTokens int64   `json:"completion_tokens"`
	TokensPerS       float64 `json:"tokens_per_s"`
	// WeightVersion is the servers' weight version while generating, from
	// GET /weight_info; "" where the API has none; several versions (the
	// servers differ) are listed sorted, comma-separated.
	WeightVersion string `json:"weight_version"`
	// WeightCheck is the weakest signal the servers gave to check their
	// weights with: WeightCheckVersion, WeightCheckStartTime or
	// WeightCheckNone (see weightcheck.go).
	WeightCheck string `json:"weight_check"`
	// VLLM is what the step learned of each server (metadata).
	VLLM []pipelines.VLLMServer `json:"_vllm,omitempty"`
	// Resumed counts the samples a retried attempt took from the earlier
	// attempts' partial file instead of generating them again.
	Resumed int `json:"resumed"`
	Attempt int `json:"_attempt"`
}

// GenerateProgress is the heartbeat detail of generate and evaluate: a
// retried attempt reads it to resume from the partial file.
type GenerateProgress struct {
	Partial string `json:"partial"`
	Done    int    `json:"done"`  // samples durably confirmed in the partial file
	Total   int    `json:"total"` // prompts × n
}

// Rollout is one line of generate's output (and, with Answer and Score, of
// evaluate's): one sample of one prompt.
type Rollout struct {
	PromptID string `json:"prompt_id"`
	// Prompt is a plain prompt's text and Messages a chat prompt's
	// conversation, as the prompts file gave them: a rollouts file is a
	// training set by itself, without the prompts file beside it.
	Prompt       *string       `json:"prompt,omitempty"`
	Messages     []ChatMessage `json:"messages,omitempty"`
	Sample       int           `json:"sample"`
	Text         string        `json:"text"`
	FinishReason string        `json:"finish_reason"`
	PromptTokens int           `json:"prompt_tokens"`
	// CompletionTokens is exact: every sample is its own request (n=1), so
	// the server's usage counts this sample alone.
	CompletionTokens int       `json:"completion_tokens"`
	Logprobs         []Logprob `json:"logprobs,omitempty"`
	// WeightVersion is the version its server served, checked before and
	// after the answer; "" where the server reports none.
	WeightVersion string `json:"weight_version,omitempty"`
	Server        string `json:"server"`

	Answer   json.RawMessage `json:"answer,omitempty"`
	Score    *float64        `json:"score,omitempty"`
	Unparsed bool            `json:"unparsed,omitempty"` // judge: no score in the reply
}

// ChatMessage is one message of a chat prompt in a rollout row.
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Logprob is one generated token's log-probability and top alternatives.
type Logprob struct {
	Token   string             `json:"token"`
	Logprob float64            `json:"logprob"`
	Top     map[string]float64 `json:"top,omitempty"`
}

// Retries inside one attempt: a generation request that fails transiently
// (5xx, no answer) is sent again this many times before the step fails (and
// its retry resumes); one that comes back aborted (a pause with mode=abort)
// is sent again, with this backoff, until the server resumes or the step's
// deadline.
const (
	transientRetries = 3
	retryBackoff     = 100 * time.Millisecond
	maxRetryBackoff  = 2 * time.Second
)

// Generate generates n samples per prompt through the servers' OpenAI API.
func (a *Activities) Generate(ctx context.Context, in GenerateInput) (*GenerateOutput, error) {
	if err := resolveArgs(ctx, pipelines.StepGenerate, &in); err != nil {
		return nil, err
	}
	run, err := a.newGenRun(ctx, pipelines.StepGenerate, &in, "rollouts.jsonl", false, nil)
	if err != nil {
		return nil, err
	}
	res, err := run.run(ctx)
	if err != nil {
		return nil, err
	}
	metrics.From(ctx).ObserveGenerate(in.Context.Pipeline, res.completionTokens, res.tokensPerS)
	return &GenerateOutput{Path: res.path, Prompts: res.prompts, Samples: res.samples, CompletionTokens: res.completionTokens,
		TokensPerS: res.tokensPerS, WeightVersion: res.weightVersion, WeightCheck: res.weightCheck, Resumed: res.resumed,
		VLLM: describeServers(ctx, run.fleet), Attempt: attemptOf(ctx)}, nil
}

// genRun is one attempt of generate or evaluate: the shared generation path.
type genRun struct {
	a      *Activities
	step   string
	in     *GenerateInput
	set    *promptSet
	fleet  vllm.Fleet
	output string
	// score fills in a sample's score (evaluate); nil for generate.
	score func(ctx context.Context, p *prompt, r *Rollout) error
	// fingerprint ties a partial file to this step's inputs.
	fingerprint string

	models []string       // per server
	checks []*serverCheck // per server: its weight check (weightcheck.go)
	next   atomic.Uint64  // round-robin over servers
	tokens atomic.Int64   // completion tokens generated this attempt
}

type genResult struct {
	path                 string
	prompts, samples     int
	resumed              int
	completionTokens     int64
	tokensPerS           float64
	weightVersion        string
	weightCheck          string
	scoreSum, minS, maxS float64
	scored, unparsed     int
}

// newGenRun reads the prompts and builds the fleet: everything that can be
// wrong before the first request, once the arguments are resolved (in has
// every default). extra joins the fingerprint (evaluate's scorer).
func (a *Activities) newGenRun(ctx context.Context, step string, in *GenerateInput, defaultName string, wantAnswer bool, extra []byte) (*genRun, error) {
	g := &genRun{a: a, step: step, in: in}
	sc := in.Context
	prompts, err := a.Roots.Resolve("with.prompts", sc.BaseDir, in.Prompts)
	if err != nil {
		return nil, badInput(ctx, "%s: %v", step, err)
	}
	set, err := readPrompts(prompts, wantAnswer)
	if err != nil {
		return nil, badInput(ctx, "%s: %v", step, err)
	}
	g.set = set
	switch {
	case in.Output != "":
		if g.output, err = a.Roots.Resolve("with.output", sc.BaseDir, in.Output); err != nil {
			return nil, badInput(ctx, "%s: %v", step, err)
		}
	case a.DataDir != "":
		g.output = filepath.Join(stepDir(a.DataDir, sc), defaultName)
	default:
		return nil, badInput(ctx, "%s: no output path: set with.output, or give the worker a data dir", step)
	}
	if g.output, err = filepath.Abs(g.output); err != nil {
		return nil, badInput(ctx, "%s: output %q: %v", step, in.Output, err)
	}
	g.fleet, err = a.fleet(ctx, step, sc, vllm.Timeouts{Generate: in.RequestTimeout.D()})
	if err != nil {
		return nil, err
	}
	g.fingerprint = g.fingerprintOf(extra)
	return g, nil
}

// fingerprintOf hashes what makes two attempts' samples interchangeable:
// the step (its run, iteration and the weights the run expects), the
// prompts' bytes, the sampling parameters and extra (the scorer), but not
// concurrency, timeouts, the servers, or which run after a re-sync this is.
func (g *genRun) fingerprintOf(extra []byte) string {
	in := *g.in
	in.Concurrency, in.RequestTimeout = 0, 0
	in.Context.Servers, in.Context.WeightTransfer, in.Context.FleetPaused, in.Context.Rerun = nil, nil, false, 0
	b, _ := json.Marshal(in)
	h := sha256.New()
	h.Write(b)
	h.Write([]byte(g.set.digest))
	h.Write(extra)
	return hex.EncodeToString(h.Sum(nil))[:32]
}

// prepare resolves each server's model and sees what it serves: the
// attempt's first weight check.
func (g *genRun) prepare(ctx context.Context) ([]serverState, error) {
	g.models = make([]string, len(g.fleet))
	states := make([]serverState, len(g.fleet))
	err := g.fleet.Each("prepare", func(i int, c *vllm.Client) error {
		g.models[i] = g.in.Model
		if g.models[i] == "" {
			models, err := c.Models(ctx)
			if err != nil {
				return err
			}
			g.models[i] = models[0]
		}
		var err error
		states[i], err = g.observe(ctx, i, nil)
		return err
	})
	if err != nil {
		return nil, serverError(ctx, err, "%s: asking the servers for their model and weights", g.step)
	}
	return states, nil
}

type request struct{ idx, k int }

// run generates every sample not already confirmed in the partial file,
// then writes the output in prompt order, atomically.
func (g *genRun) run(ctx context.Context) (*genResult, error) {
	states, err := g.prepare(ctx)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(g.output), 0o755); err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "%s: creating the output dir", g.step)
	}
	pw, err := g.openPartial(ctx)
	if err != nil {
		return nil, err
	}
	defer pw.f.Close()
	if err := g.startChecks(ctx, pw, states); err != nil {
		return nil, err
	}
	// Read before the writer starts: from then on it owns pw.
	n, total := g.in.N, len(pw.rows)
	resumed := pw.valid
	var todo []request
	for key := range total {
		if !pw.isValid(key) {
			todo = append(todo, request{key / n, key % n})
		}
	}

	start := time.Now()
	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	writerErr := make(chan error, 1)
	recs := make(chan record, g.in.Concurrency)
	emit := func(r record) { recs <- r }
	var durable atomic.Int64
	durable.Store(int64(resumed))
	go func() {
		writerErr <- pw.writeAll(recs, &durable, func(err error) {
			// Stop generating what cannot be written.
			cancel(stepError(ctx, pipelines.ErrTypeIO, err, "%s: writing %s", g.step, pw.path))
		})
	}()
	stopHB := g.heartbeat(ctx, pw.path, &durable, total)
	stopWatch := g.watch(runCtx, emit, cancel)

	reqs := make(chan request)
	var wg sync.WaitGroup
	for range g.in.Concurrency {
		wg.Go(func() {
			for r := range reqs {
				// The writer never stops reading, so this send cannot block
				// for good: an answered sample is written even when the run
				// is stopping.
				rec, err := g.sample(runCtx, r.idx, r.k, emit)
				if rec != nil {
					recs <- *rec
				}
				if err != nil {
					cancel(err)
				}
			}
		})
	}
feed:
	for _, r := range todo {
		select {
		case reqs <- r:
		case <-runCtx.Done():
			break feed
		}
	}
	close(reqs)
	wg.Wait()
	stopWatch()
	cause := context.Cause(runCtx)
	var stale map[int]string
	if ctx.Err() == nil {
		// The end check: it confirms what the servers answered since their
		// last check (even when the run failed: those are kept for the
		// retry) and names every stale server.
		var cerr error
		if stale, cerr = g.checkAll(ctx, emit); cerr != nil && cause == nil {
			cause = cerr
		}
	}
	close(recs)
	werr := <-writerErr
	stopHB()
	g.recordProgress(ctx, pw.path, int(durable.Load()), total)
	switch {
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case len(stale) > 0:
		return nil, g.staleWeightsError(ctx, stale)
	case cause != nil && !errors.Is(cause, context.Canceled):
		return nil, cause
	case werr != nil:
		return nil, stepError(ctx, pipelines.ErrTypeIO, werr, "%s: writing %s", g.step, pw.path)
	}
	elapsed := time.Since(start)
	res, err := pw.assemble(g.output, g.set)
	if err != nil {
		return nil, stepError(ctx, pipelines.ErrTypeIO, err, "%s: writing %s", g.step, g.output)
	}
	pw.f.Close()
	_ = os.Remove(pw.path)
	res.resumed = resumed
	res.weightCheck = weakestSignal(states)
	if s := elapsed.Seconds(); s > 0 {
		res.tokensPerS = float64(g.tokens.Load()) / s
	}
	return res, nil
}

// watch checks every server every heartbeat interval until the returned
// stop, so that a server that changed weights is found within that time
// and loses at most that much work; a stale server or a failed check
// stops the run.
func (g *genRun) watch(ctx context.Context, emit func(record), stop context.CancelCauseFunc) func() {
	return g.a.everyHeartbeat(ctx, func() {
		stale, err := g.checkAll(ctx, emit)
		switch {
		case err != nil:
			stop(err)
		case len(stale) > 0:
			stop(errStale)
		}
	})
}

// sample generates sample k of prompt idx on the next server in turn and
// returns its record for the partial file. A request that came back
// aborted (a pause, likely for a weight update) is sent again; once one is
// answered, each server that aborted it is checked: a stale one returns
// errStale along with the record.
func (g *genRun) sample(ctx context.Context, idx, k int, emit func(record)) (*record, error) {
	p := &g.set.prompts[idx]
	backoff := retryBackoff
	transient := transientRetries
	var seed *int
	if g.in.Seed != nil {
		// Sample k of prompt i uses seed+i*n+k: reproducible whichever
		// server or attempt generates it.
		s := *g.in.Seed + idx*g.in.N + k
		seed = &s
	}
	var aborted []int // servers that aborted this sample
	for {
		si := int(g.next.Add(1)-1) % len(g.fleet)
		c := g.fleet[si]
		res, err := g.request(ctx, c, g.models[si], p, seed)
		if err == nil && len(res.Choices) == 1 && res.Choices[0].FinishReason != "abort" {
			sc := g.checks[si]
			seq := sc.seq.Add(1) - 1 // answered now: a check from here on covers it
			g.tokens.Add(int64(res.Usage.CompletionTokens))
			r := g.rollout(p, k, si, res)
			if g.score != nil {
				if err := g.score(ctx, p, &r); err != nil {
					return nil, err
				}
			}
			row, err := encodeRow(&r)
			if err != nil {
				return nil, stepError(ctx, pipelines.ErrTypeIO, err, "%s: encoding prompt %s sample %d", g.step, g.set.where(p), k)
			}
			rec := rowRec(idx*g.in.N+k, sc.epoch, seq, row)
			for _, i := range aborted {
				problem, err := g.check(ctx, i, emit)
				switch {
				case err != nil:
					return &rec, serverError(ctx, err, "%s: checking %s's weights after a pause", g.step, g.fleet[i].URL())
				case problem != "":
					return &rec, errStale
				}
			}
			return &rec, nil
		}
		switch {
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case err == nil:
			// Aborted by a pause: not finished. A new request waits on the
			// paused server until it resumes.
			if !slices.Contains(aborted, si) {
				aborted = append(aborted, si)
			}
		case classify(err) == pipelines.ErrTypeServerError && transient > 0 && !errors.Is(err, vllm.ErrStepDeadline):
			// A request cut short by the step's deadline is not sent
			// again: the error must reach Temporal before that deadline.
			transient--
		default:
			return nil, serverError(ctx, err, "%s: prompt %s sample %d", g.step, g.set.where(p), k)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, maxRetryBackoff)
	}
}

func (g *genRun) request(ctx context.Context, c *vllm.Client, model string, p *prompt, seed *int) (*vllm.Result, error) {
	temp := float32(*g.in.Temperature)
	if p.messages != nil {
		return c.Chat(ctx, vllm.ChatRequest{Model: model, Messages: p.messages, MaxTokens: g.in.MaxTokens, Temperature: &temp,
			TopP: float32(g.in.TopP), N: 1, Seed: seed, Stop: g.in.Stop, Logprobs: g.in.Logprobs > 0, TopLogprobs: g.in.Logprobs})
	}
	return c.Completions(ctx, vllm.CompletionRequest{Model: model, Prompts: []string{p.text}, MaxTokens: g.in.MaxTokens, Temperature: &temp,
		TopP: float32(g.in.TopP), N: 1, Seed: seed, Stop: g.in.Stop, Logprobs: g.in.Logprobs})
}

func (g *genRun) rollout(p *prompt, k, si int, res *vllm.Result) Rollout {
	ch := res.Choices[0]
	r := Rollout{PromptID: p.id, Sample: k, Text: ch.Text, FinishReason: ch.FinishReason,
		PromptTokens: res.Usage.PromptTokens, CompletionTokens: res.Usage.CompletionTokens,
		WeightVersion: g.checks[si].state.Version, Server: g.fleet[si].URL(), Answer: p.answer}
	if p.messages != nil {
		r.Messages = make([]ChatMessage, len(p.messages))
		for i, m := range p.messages {
			r.Messages[i] = ChatMessage{Role: m.Role, Content: m.Content}
		}
	} else {
		text := p.text
		r.Prompt = &text
	}
	if g.in.Logprobs > 0 {
		r.Logprobs = make([]Logprob, len(ch.Logprobs))
		for i, lp := range ch.Logprobs {
			r.Logprobs[i] = Logprob{Token: lp.Token, Logprob: lp.Logprob, Top: lp.Top}
		}
	}
	return r
}

// encodeRow encodes an output row, without its newline.
func encodeRow(r *Rollout) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(r); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// heartbeat records progress every heartbeatEvery until the returned stop.
func (g *genRun) heartbeat(ctx context.Context, partial string, durable *atomic.Int64, total int) (stop func()) {
	return g.a.heartbeatLoop(ctx, func() { g.recordProgress(ctx, partial, int(durable.Load()), total) })
}

func (g *genRun) recordProgress(ctx context.Context, partial string, done, total int) {
	if activity.IsActivity(ctx) {
		activity.RecordHeartbeat(ctx, GenerateProgress{Partial: partial, Done: done, Total: total})
	}
}
