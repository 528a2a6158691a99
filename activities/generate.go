package activities

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

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
	// weights changed mid-step, or servers differ) are listed sorted,
	// comma-separated.
	WeightVersion string `json:"weight_version"`
	// Resumed counts the prompts a retried attempt took from the earlier
	// attempts' partial file instead of generating them again.
	Resumed int `json:"resumed"`
	Attempt int `json:"_attempt"`
}

// GenerateProgress is the heartbeat detail of generate and evaluate: a
// retried attempt reads it to resume from the partial file.
type GenerateProgress struct {
	Partial string `json:"partial"`
	Done    int    `json:"done"` // prompts durably in the partial file
	Total   int    `json:"total"`
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
	WeightVersion    string    `json:"weight_version,omitempty"`
	Server           string    `json:"server"`

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

// Sampling defaults (documented on the step types).
const (
	defaultN           = 1
	defaultMaxTokens   = 256
	defaultTemperature = 1.0
	defaultConcurrency = 64
	maxSamples         = 1024
)

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
	run, err := a.newGenRun(ctx, "generate", &in, "rollouts.jsonl", false, nil)
	if err != nil {
		return nil, err
	}
	res, err := run.run(ctx)
	if err != nil {
		return nil, err
	}
	return &GenerateOutput{Path: res.path, Prompts: res.prompts, Samples: res.samples, CompletionTokens: res.completionTokens,
		TokensPerS: res.tokensPerS, WeightVersion: res.weightVersion, Resumed: res.resumed, Attempt: attemptOf(ctx)}, nil
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

	n, maxTokens, concurrency int
	temperature               float32

	models   []string                 // per server
	versions []atomic.Pointer[string] // per server: its weight version
	next     atomic.Uint64            // round-robin over servers
	tokens   atomic.Int64             // completion tokens generated this attempt
}

type genResult struct {
	path                 string
	prompts, samples     int
	resumed              int
	completionTokens     int64
	tokensPerS           float64
	weightVersion        string
	scoreSum, minS, maxS float64
	scored, unparsed     int
}

// newGenRun checks the arguments, reads the prompts and builds the fleet:
// everything that can be wrong before the first request.
// extra joins the fingerprint (evaluate's scorer).
func (a *Activities) newGenRun(ctx context.Context, step string, in *GenerateInput, defaultName string, wantAnswer bool, extra []byte) (*genRun, error) {
	g := &genRun{a: a, step: step, in: in, n: defaultN, maxTokens: defaultMaxTokens, temperature: defaultTemperature, concurrency: defaultConcurrency}
	sc := in.Context
	switch {
	case in.Prompts == "":
		return nil, badInput(ctx, "%s: prompts is required", step)
	case in.N < 0 || in.N > maxSamples:
		return nil, badInput(ctx, "%s: n %d, want 1..%d", step, in.N, maxSamples)
	case in.MaxTokens < 0:
		return nil, badInput(ctx, "%s: max_tokens %d must be positive", step, in.MaxTokens)
	case in.Temperature != nil && !(*in.Temperature >= 0):
		return nil, badInput(ctx, "%s: temperature %v must not be negative", step, *in.Temperature)
	case !(in.TopP >= 0 && in.TopP <= 1):
		return nil, badInput(ctx, "%s: top_p %v, want (0, 1] (0 or unset: the server's default)", step, in.TopP)
	case in.Logprobs < 0:
		return nil, badInput(ctx, "%s: logprobs %d must not be negative", step, in.Logprobs)
	case in.Concurrency < 0 || in.Concurrency > MaxConcurrency:
		return nil, badInput(ctx, "%s: concurrency %d, want 1..%d", step, in.Concurrency, MaxConcurrency)
	}
	if in.N > 0 {
		g.n = in.N
	}
	if in.MaxTokens > 0 {
		g.maxTokens = in.MaxTokens
	}
	if in.Temperature != nil {
		g.temperature = float32(*in.Temperature)
	}
	if in.Concurrency > 0 {
		g.concurrency = in.Concurrency
	}
	set, err := readPrompts(resolvePath(sc.BaseDir, in.Prompts), wantAnswer)
	if err != nil {
		return nil, badInput(ctx, "%s: %v", step, err)
	}
	g.set = set
	switch {
	case in.Output != "":
		g.output = resolvePath(sc.BaseDir, in.Output)
	case a.DataDir != "":
		g.output = filepath.Join(a.DataDir, safeName(sc.RunID), fmt.Sprintf("iter-%d", sc.Iteration), safeName(sc.StepID), defaultName)
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
// the step, the prompts' bytes, the sampling parameters and extra (the
// scorer), but not concurrency or timeouts.
func (g *genRun) fingerprintOf(extra []byte) string {
	in := *g.in
	in.Concurrency, in.RequestTimeout = 0, 0
	in.Context.Servers, in.Context.WeightTransfer = nil, nil
	b, _ := json.Marshal(in)
	h := sha256.New()
	h.Write(b)
	h.Write([]byte(g.set.digest))
	h.Write(extra)
	return hex.EncodeToString(h.Sum(nil))[:32]
}

// prepare resolves each server's model and weight version.
func (g *genRun) prepare(ctx context.Context) error {
	g.models = make([]string, len(g.fleet))
	g.versions = make([]atomic.Pointer[string], len(g.fleet))
	errs := make([]error, len(g.fleet))
	var wg sync.WaitGroup
	for i, c := range g.fleet {
		wg.Go(func() {
			g.models[i] = g.in.Model
			if g.models[i] == "" {
				models, err := c.Models(ctx)
				if err != nil {
					errs[i] = err
					return
				}
				g.models[i] = models[0]
			}
			errs[i] = g.refreshVersion(ctx, i)
		})
	}
	wg.Wait()
	if err := fleetError("prepare", g.fleet, errs); err != nil {
		return serverError(ctx, err, "%s: asking the servers for their model and weight version", g.step)
	}
	return nil
}

// refreshVersion reads server i's weight version; a server without the
// route (404, or an API generation without versions) has none.
func (g *genRun) refreshVersion(ctx context.Context, i int) error {
	v, err := g.fleet[i].WeightInfo(ctx)
	if err != nil && !notAvailable(err) {
		return err
	}
	g.versions[i].Store(&v)
	return nil
}

func (g *genRun) version(i int) string {
	if v := g.versions[i].Load(); v != nil {
		return *v
	}
	return ""
}

// pending collects one prompt's samples until all n are in.
type pending struct {
	rows []Rollout
	left atomic.Int32
}

type request struct {
	idx, sample int
	p           *pending
}

// run generates every prompt not already in the partial file, then writes
// the output in prompt order, atomically.
func (g *genRun) run(ctx context.Context) (*genResult, error) {
	if err := g.prepare(ctx); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(g.output), 0o755); err != nil {
		return nil, stepError(ctx, ErrTypeIO, err, "%s: creating the output dir", g.step)
	}
	pw, resumed, err := g.openPartial(ctx)
	if err != nil {
		return nil, err
	}
	defer pw.f.Close()
	total := len(g.set.prompts)
	// Read before the writer starts: from then on it owns pw.blocks.
	skip := make([]bool, total)
	for idx := range skip {
		skip[idx] = pw.has(idx)
	}

	start := time.Now()
	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	writerErr := make(chan error, 1)
	blocks := make(chan block, g.concurrency)
	// The writer appends finished prompts and fsyncs them in groups (one
	// fsync per burst, not per prompt), then records them as durable.
	var durable atomic.Int64
	durable.Store(int64(resumed))
	go func() {
		writerErr <- pw.writeAll(blocks, &durable, func(err error) {
			// Stop generating what cannot be written.
			cancel(stepError(ctx, ErrTypeIO, err, "%s: writing %s", g.step, pw.path))
		})
	}()
	stopHB := g.heartbeat(ctx, pw.path, &durable, total)

	reqs := make(chan request)
	var wg sync.WaitGroup
	for range g.concurrency {
		wg.Go(func() {
			for r := range reqs {
				row, err := g.sample(runCtx, r.idx, r.sample)
				if err != nil {
					cancel(err)
					continue
				}
				r.p.rows[r.sample] = row
				if r.p.left.Add(-1) == 0 {
					b, err := encodeBlock(r.p.rows)
					if err != nil {
						cancel(stepError(ctx, ErrTypeIO, err, "%s: encoding prompt %s", g.step, r.p.rows[0].PromptID))
						continue
					}
					select {
					case blocks <- block{idx: r.idx, data: b}:
					case <-runCtx.Done():
					}
				}
			}
		})
	}
feed:
	for idx := range g.set.prompts {
		if skip[idx] {
			continue
		}
		p := &pending{rows: make([]Rollout, g.n)}
		p.left.Store(int32(g.n))
		for k := range g.n {
			select {
			case reqs <- request{idx: idx, sample: k, p: p}:
			case <-runCtx.Done():
				break feed
			}
		}
	}
	close(reqs)
	wg.Wait()
	close(blocks)
	werr := <-writerErr
	stopHB()
	g.recordProgress(ctx, pw.path, int(durable.Load()), total)
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if cause := context.Cause(runCtx); cause != nil && !errors.Is(cause, context.Canceled) {
		return nil, cause
	}
	if werr != nil {
		return nil, stepError(ctx, ErrTypeIO, werr, "%s: writing %s", g.step, pw.path)
	}
	elapsed := time.Since(start)
	res, err := pw.assemble(g.output, g.set, g.n)
	if err != nil {
		return nil, stepError(ctx, ErrTypeIO, err, "%s: writing %s", g.step, g.output)
	}
	pw.f.Close()
	_ = os.Remove(pw.path)
	res.resumed = resumed
	if s := elapsed.Seconds(); s > 0 {
		res.tokensPerS = float64(g.tokens.Load()) / s
	}
	return res, nil
}

// sample generates sample k of prompt idx on the next server in turn.
func (g *genRun) sample(ctx context.Context, idx, k int) (Rollout, error) {
	p := &g.set.prompts[idx]
	backoff := retryBackoff
	transient := transientRetries
	var seed *int
	if g.in.Seed != nil {
		// Sample k of prompt i uses seed+i*n+k: reproducible whichever
		// server or attempt generates it.
		s := *g.in.Seed + idx*g.n + k
		seed = &s
	}
	aborted := false
	for {
		si := int(g.next.Add(1)-1) % len(g.fleet)
		c := g.fleet[si]
		res, err := g.request(ctx, c, g.models[si], p, seed)
		if err == nil && len(res.Choices) == 1 && res.Choices[0].FinishReason != "abort" {
			if aborted {
				// The pause that aborted it was likely a weight update.
				if verr := g.refreshVersion(ctx, si); verr != nil {
					return Rollout{}, serverError(ctx, verr, "%s: weight version after a resume", g.step)
				}
			}
			g.tokens.Add(int64(res.Usage.CompletionTokens))
			r := g.rollout(p, k, si, res)
			if g.score != nil {
				if err := g.score(ctx, p, &r); err != nil {
					return Rollout{}, err
				}
			}
			return r, nil
		}
		switch {
		case ctx.Err() != nil:
			return Rollout{}, ctx.Err()
		case err == nil:
			// Aborted by a pause: not finished. A new request waits on the
			// paused server until it resumes.
			aborted = true
		case classify(err) == ErrTypeServerError && transient > 0:
			transient--
		default:
			return Rollout{}, serverError(ctx, err, "%s: prompt %s sample %d", g.step, g.set.where(p), k)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return Rollout{}, ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, maxRetryBackoff)
	}
}

func (g *genRun) request(ctx context.Context, c *vllm.Client, model string, p *prompt, seed *int) (*vllm.Result, error) {
	temp := g.temperature
	if p.messages != nil {
		return c.Chat(ctx, vllm.ChatRequest{Model: model, Messages: p.messages, MaxTokens: g.maxTokens, Temperature: &temp,
			TopP: float32(g.in.TopP), N: 1, Seed: seed, Stop: g.in.Stop, Logprobs: g.in.Logprobs > 0, TopLogprobs: g.in.Logprobs})
	}
	return c.Completions(ctx, vllm.CompletionRequest{Model: model, Prompts: []string{p.text}, MaxTokens: g.maxTokens, Temperature: &temp,
		TopP: float32(g.in.TopP), N: 1, Seed: seed, Stop: g.in.Stop, Logprobs: g.in.Logprobs})
}

func (g *genRun) rollout(p *prompt, k, si int, res *vllm.Result) Rollout {
	ch := res.Choices[0]
	r := Rollout{PromptID: p.id, Sample: k, Text: ch.Text, FinishReason: ch.FinishReason,
		PromptTokens: res.Usage.PromptTokens, CompletionTokens: res.Usage.CompletionTokens,
		WeightVersion: g.version(si), Server: g.fleet[si].URL(), Answer: p.answer}
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

func encodeBlock(rows []Rollout) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	for i := range rows {
		if err := enc.Encode(&rows[i]); err != nil {
			return nil, err
		}
	}
	return b.Bytes(), nil
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

// partialHeader is the first line of a partial file.
type partialHeader struct {
	Partial     int    `json:"rlflow_partial"`
	Fingerprint string `json:"fingerprint"`
}

// partialFile holds the finished prompts of this step's attempts: blocks of
// n rows, one per prompt, appended in completion order and fsynced, so a
// retried attempt skips them. The file name is the same for every attempt.
type partialFile struct {
	path   string
	f      *os.File
	off    int64
	blocks map[int][2]int64 // prompt index -> offset, length
}

func (pw *partialFile) has(idx int) bool { _, ok := pw.blocks[idx]; return ok }

// openPartial resumes the partial file when this is a retry (heartbeat
// details, or attempt > 1) and it was made from the same inputs; otherwise
// it starts a new one, so a stale file from another run is never reused.
func (g *genRun) openPartial(ctx context.Context) (*partialFile, int, error) {
	path := g.output + ".partial"
	retry := false
	if activity.IsActivity(ctx) {
		retry = activity.GetInfo(ctx).Attempt > 1 || activity.HasHeartbeatDetails(ctx)
		var hb GenerateProgress
		if activity.HasHeartbeatDetails(ctx) && activity.GetHeartbeatDetails(ctx, &hb) == nil && hb.Partial != "" && hb.Partial != path {
			activity.GetLogger(ctx).Warn("the earlier attempt's partial file is elsewhere; resuming from this one", "earlier", hb.Partial, "partial", path)
		}
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, 0, stepError(ctx, ErrTypeIO, err, "%s: opening %s", g.step, path)
	}
	// One attempt at a time: a retry that starts while an earlier attempt
	// still runs (its worker cut off past the heartbeat timeout) must not
	// interleave its writes with it. The lock goes with the file's close.
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, 0, stepError(ctx, ErrTypeIO, err, "%s: %s is locked by another attempt of this step that still runs (it stops at its next heartbeat)", g.step, path)
	}
	if retry {
		pw, n, err := resumePartial(f, path, g.fingerprint, g.set, g.n)
		if err == nil {
			return pw, n, nil
		}
		if activity.IsActivity(ctx) {
			activity.GetLogger(ctx).Warn("not resuming: starting the step's samples again", "partial", path, "reason", err.Error())
		}
	}
	hdr, _ := json.Marshal(partialHeader{Partial: 1, Fingerprint: g.fingerprint})
	hdr = append(hdr, '\n')
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteAt(hdr, 0)
	}
	if err != nil {
		f.Close()
		return nil, 0, stepError(ctx, ErrTypeIO, err, "%s: writing %s", g.step, path)
	}
	if _, err := f.Seek(int64(len(hdr)), io.SeekStart); err != nil {
		f.Close()
		return nil, 0, stepError(ctx, ErrTypeIO, err, "%s: writing %s", g.step, path)
	}
	return &partialFile{path: path, f: f, off: int64(len(hdr)), blocks: map[int][2]int64{}}, 0, nil
}

// resumePartial reads the open partial file f: its complete prompt blocks
// count as done; a torn or foreign tail (a crash mid-write) is cut off.
// On error the caller still owns f.
func resumePartial(f *os.File, path, fingerprint string, set *promptSet, n int) (*partialFile, int, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, 0, err
	}
	br := bufio.NewReaderSize(f, 1<<20)
	first, err := br.ReadBytes('\n')
	var hdr partialHeader
	if err != nil || json.Unmarshal(first, &hdr) != nil || hdr.Partial != 1 {
		return nil, 0, fmt.Errorf("%s has no partial-file header", path)
	}
	if hdr.Fingerprint != fingerprint {
		return nil, 0, fmt.Errorf("%s was made from other inputs (prompts or sampling parameters changed)", path)
	}
	index := make(map[string]int, len(set.prompts))
	for i := range set.prompts {
		index[set.prompts[i].id] = i
	}
	pw := &partialFile{path: path, f: f, blocks: map[int][2]int64{}}
	off := int64(len(first))
	good := off // end of the last complete block
	blockStart, blockIdx, want := off, -1, 0
	for {
		line, err := br.ReadBytes('\n')
		if err != nil {
			break // EOF, or a torn last line without its newline
		}
		var row struct {
			PromptID string `json:"prompt_id"`
			Sample   int    `json:"sample"`
		}
		if json.Unmarshal(line, &row) != nil {
			break
		}
		idx, ok := index[row.PromptID]
		if !ok || row.Sample != want || (want > 0 && idx != blockIdx) || pw.has(idx) {
			break
		}
		if want == 0 {
			blockStart, blockIdx = off, idx
		}
		off += int64(len(line))
		want++
		if want == n {
			pw.blocks[idx] = [2]int64{blockStart, off - blockStart}
			good, want = off, 0
		}
	}
	if err := f.Truncate(good); err != nil {
		return nil, 0, err
	}
	if _, err := f.Seek(good, io.SeekStart); err != nil {
		return nil, 0, err
	}
	pw.off = good
	return pw, len(pw.blocks), nil
}

// maxUnsynced bounds the finished prompts the writer holds before an fsync.
const maxUnsynced = 256

// block is one finished prompt's rows.
type block struct {
	idx  int
	data []byte
}

// writeAll appends blocks, fsyncing whenever no further block is waiting.
// It reports its first error to failed at once and then only drains.
func (pw *partialFile) writeAll(blocks <-chan block, durable *atomic.Int64, failed func(error)) error {
	w := bufio.NewWriterSize(pw.f, 1<<20)
	var werr error
	unsynced := 0
	sync := func() {
		if werr == nil && unsynced > 0 {
			if werr = w.Flush(); werr == nil {
				werr = pw.f.Sync()
			}
			if werr == nil {
				durable.Add(int64(unsynced))
			}
			unsynced = 0
		}
	}
	for b := range blocks {
		if werr != nil {
			continue // drain, so that no worker blocks
		}
		if _, werr = w.Write(b.data); werr == nil {
			pw.blocks[b.idx] = [2]int64{pw.off, int64(len(b.data))}
			pw.off += int64(len(b.data))
			unsynced++
		}
		// Under a steady stream the channel is rarely empty: bound what
		// a crash could lose anyway.
		if len(blocks) == 0 || unsynced >= maxUnsynced {
			sync()
		}
		if werr != nil {
			failed(werr)
		}
	}
	if sync(); werr != nil {
		failed(werr)
	}
	return werr
}

// assemble writes the output in prompt order from the partial file's
// blocks: to a temporary file, fsynced, then renamed over the output.
func (pw *partialFile) assemble(output string, set *promptSet, n int) (*genResult, error) {
	tmp := output + ".tmp"
	out, err := os.Create(tmp)
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp) // after a successful rename there is nothing to remove
	defer out.Close()
	w := bufio.NewWriterSize(out, 1<<20)
	res := &genResult{path: output, prompts: len(set.prompts), samples: len(set.prompts) * n}
	versions := map[string]bool{}
	var buf []byte
	for idx := range set.prompts {
		blk, ok := pw.blocks[idx]
		if !ok {
			return nil, fmt.Errorf("prompt %s has no samples in %s", set.where(&set.prompts[idx]), pw.path)
		}
		if int64(cap(buf)) < blk[1] {
			buf = make([]byte, blk[1])
		}
		buf = buf[:blk[1]]
		if _, err := pw.f.ReadAt(buf, blk[0]); err != nil {
			return nil, fmt.Errorf("reading %s: %w", pw.path, err)
		}
		for line := range bytes.Lines(buf) {
			var row struct {
				CompletionTokens int64    `json:"completion_tokens"`
				WeightVersion    string   `json:"weight_version"`
				Score            *float64 `json:"score"`
				Unparsed         bool     `json:"unparsed"`
			}
			if err := json.Unmarshal(line, &row); err != nil {
				return nil, fmt.Errorf("%s: corrupt row: %w", pw.path, err)
			}
			res.completionTokens += row.CompletionTokens
			if row.WeightVersion != "" {
				versions[row.WeightVersion] = true
			}
			if row.Score != nil {
				s := *row.Score
				if res.scored == 0 || s < res.minS {
					res.minS = s
				}
				if res.scored == 0 || s > res.maxS {
					res.maxS = s
				}
				res.scoreSum += s
				res.scored++
			}
			if row.Unparsed {
				res.unparsed++
			}
		}
		if _, err := w.Write(buf); err != nil {
			return nil, err
		}
	}
	if err := w.Flush(); err != nil {
		return nil, err
	}
	if err := out.Sync(); err != nil {
		return nil, err
	}
	if err := out.Close(); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, output); err != nil {
		return nil, err
	}
	if d, err := os.Open(filepath.Dir(output)); err == nil {
		_ = d.Sync() // make the rename durable
		d.Close()
	}
	list := make([]string, 0, len(versions))
	for v := range versions {
		list = append(list, v)
	}
	sort.Strings(list)
	res.weightVersion = strings.Join(list, ",")
	return res, nil
}
