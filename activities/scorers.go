package activities

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
)

// maxScorerResponse bounds an http scorer's answer.
const maxScorerResponse = 1 << 20

// scoreFunc scores one sample, setting r.Score (and r.Unparsed).
type scoreFunc func(ctx context.Context, p *prompt, r *Rollout) error

// numberRe finds numbers as a completion writes them: 42, -3.5, 1,234.5,
// .5, 6.02e23.
var numberRe = regexp.MustCompile(`[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?`)

// lastNumber returns the last number in s.
func lastNumber(s string) (float64, bool) {
	ms := numberRe.FindAllString(s, -1)
	for i := len(ms) - 1; i >= 0; i-- {
		if x, ok := parseNumber(ms[i]); ok {
			return x, true
		}
	}
	return 0, false
}

// firstNumber returns the first number in s.
func firstNumber(s string) (float64, bool) {
	for _, m := range numberRe.FindAllString(s, -1) {
		if x, ok := parseNumber(m); ok {
			return x, true
		}
	}
	return 0, false
}

func parseNumber(m string) (float64, bool) {
	if !strings.ContainsAny(m, "0123456789") {
		return 0, false // the pattern also matches "", "-", "e5"...
	}
	x, err := strconv.ParseFloat(strings.ReplaceAll(m, ",", ""), 64)
	return x, err == nil && !math.IsInf(x, 0)
}

func boolScore(ok bool) *float64 {
	s := 0.0
	if ok {
		s = 1
	}
	return &s
}

// answerText is a sample's answer as text (a JSON number's digits).
func answerText(p *prompt) string {
	s, _ := vllm.ScalarText(p.answer)
	return s
}

// newScorer builds the scorer: every check of its arguments and of the
// eval set's answers happens here, before the first request.
func (a *Activities) newScorer(ctx context.Context, g *genRun, s pipelines.Scorer) (scoreFunc, error) {
	norm := strings.TrimSpace
	equal := func(x, y string) bool { return norm(x) == norm(y) }
	if s.IgnoreCase {
		equal = func(x, y string) bool { return strings.EqualFold(norm(x), norm(y)) }
	}
	switch s.Type {
	case pipelines.ScorerExactMatch:
		return func(_ context.Context, p *prompt, r *Rollout) error {
			r.Score = boolScore(equal(r.Text, answerText(p)))
			return nil
		}, nil
	case pipelines.ScorerContains:
		return func(_ context.Context, p *prompt, r *Rollout) error {
			text, ans := norm(r.Text), norm(answerText(p))
			if s.IgnoreCase {
				text, ans = strings.ToLower(text), strings.ToLower(ans)
			}
			r.Score = boolScore(strings.Contains(text, ans))
			return nil
		}, nil
	case pipelines.ScorerRegex:
		pattern := s.Pattern
		if s.IgnoreCase {
			pattern = "(?i)" + pattern
		}
		re, err := regexp.Compile(pattern)
		if err != nil {
			return nil, badInput(ctx, "evaluate: scorer pattern: %v", err)
		}
		return func(_ context.Context, p *prompt, r *Rollout) error {
			if re.NumSubexp() == 0 {
				r.Score = boolScore(re.MatchString(r.Text))
				return nil
			}
			m := re.FindStringSubmatch(r.Text)
			r.Score = boolScore(m != nil && equal(m[1], answerText(p)))
			return nil
		}, nil
	case pipelines.ScorerNumeric:
		answers := make(map[*prompt]float64, len(g.set.prompts))
		for i := range g.set.prompts {
			p := &g.set.prompts[i]
			x, ok := parseNumber(strings.TrimSpace(answerText(p)))
			if !ok {
				return nil, badInput(ctx, "evaluate: %s:%d: answer %s is not a number (the numeric scorer needs one)", g.set.path, p.line, clipJSON(p.answer))
			}
			answers[p] = x
		}
		return func(_ context.Context, p *prompt, r *Rollout) error {
			x, ok := lastNumber(r.Text)
			r.Score = boolScore(ok && math.Abs(x-answers[p]) <= s.Tolerance)
			return nil
		}, nil
	case pipelines.ScorerHTTP:
		return a.httpScorer(ctx, s)
	case pipelines.ScorerJudge:
		return a.judgeScorer(ctx, g, s)
	}
	return nil, badInput(ctx, "evaluate: unknown scorer type %q", s.Type)
}

// semaphore bounds a scorer's requests in flight.
type semaphore chan struct{}

func (s semaphore) acquire(ctx context.Context) error {
	select {
	case s <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s semaphore) release() { <-s }

// scorerLimits are an http or judge scorer's bounds (ParseScorer filled
// in their defaults).
func scorerLimits(s pipelines.Scorer) (semaphore, time.Duration) {
	return make(semaphore, s.Concurrency), s.Timeout.D()
}

// httpScorer POSTs {prompt, completion, answer, id} to the URL and reads
// {"score": number}. Transient failures (no answer, 5xx, 408, 409, 429)
// are retried transientRetries times; errors name the URL and the sample.
func (a *Activities) httpScorer(ctx context.Context, s pipelines.Scorer) (scoreFunc, error) {
	key, err := a.apiKey(s.APIKeyEnv)
	if err != nil {
		return nil, badInput(ctx, "evaluate: http scorer %s: %v", s.URL, err)
	}
	sem, timeout := scorerLimits(s)
	hc := a.httpClient()
	return func(ctx context.Context, p *prompt, r *Rollout) error {
		body, err := json.Marshal(map[string]any{"prompt": p.promptText(), "completion": r.Text, "answer": p.answer, "id": p.id})
		if err != nil {
			return stepError(ctx, pipelines.ErrTypeBadInput, err, "evaluate: http scorer: encoding sample %s#%d", p.id, r.Sample)
		}
		if err := sem.acquire(ctx); err != nil {
			return err
		}
		defer sem.release()
		backoff := retryBackoff
		for try := 0; ; try++ {
			score, status, err := postScore(ctx, hc, s.URL, key, body, timeout)
			if err == nil {
				r.Score = &score
				return nil
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if final(status, err) || try == transientRetries {
				typ := pipelines.ErrTypeServerError
				if final(status, err) {
					typ = pipelines.ErrTypeServerRejected
				}
				return stepError(ctx, typ, err, "evaluate: http scorer %s: prompt %s sample %d", s.URL, p.id, r.Sample)
			}
			t := time.NewTimer(backoff)
			select {
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			case <-t.C:
			}
			backoff = min(2*backoff, maxRetryBackoff)
		}
	}, nil
}

// errBadScore is a 200 answer without a usable score: final.
type errBadScore struct{ msg string }

func (e *errBadScore) Error() string { return e.msg }

// postScore returns the score, or the HTTP status (0: none) and an error;
// a 200 without a finite "score" is status 422 (final).
func postScore(ctx context.Context, hc *http.Client, url, key string, body []byte, timeout time.Duration) (float64, int, error) {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, http.StatusBadRequest, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := hc.Do(req)
	if err != nil {
		if rctx.Err() != nil && ctx.Err() == nil {
			return 0, 0, fmt.Errorf("no answer within %v (scorer timeout)", timeout)
		}
		return 0, 0, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxScorerResponse+1))
	if err != nil {
		return 0, 0, fmt.Errorf("reading the answer: %w", err)
	}
	if len(data) > maxScorerResponse {
		return 0, http.StatusUnprocessableEntity, &errBadScore{fmt.Sprintf("answer over %d bytes", maxScorerResponse)}
	}
	if resp.StatusCode != http.StatusOK {
		return 0, resp.StatusCode, fmt.Errorf("HTTP %d: %s", resp.StatusCode, truncate(strings.TrimSpace(string(data)), 200))
	}
	var v struct {
		Score *float64 `json:"score"`
	}
	if json.Unmarshal(data, &v) != nil || v.Score == nil || math.IsNaN(*v.Score) || math.IsInf(*v.Score, 0) {
		return 0, http.StatusUnprocessableEntity, &errBadScore{fmt.Sprintf(`answer %q has no numeric "score"`, truncate(string(data), 200))}
	}
	return *v.Score, http.StatusOK, nil
}

// judgeScorer asks a chat model to rate each sample with the rubric. The
// first number of the reply in [0, scale] is divided by scale; a reply
// without one scores 0 and is marked unparsed (the step counts them), so a
// chatty judge lowers the score visibly instead of failing the step.
func (a *Activities) judgeScorer(ctx context.Context, g *genRun, s pipelines.Scorer) (scoreFunc, error) {
	sem, timeout := scorerLimits(s)
	judges := g.fleet
	if s.URL != "" {
		c, err := a.client(pipelines.Server{URL: s.URL, APIKeyEnv: s.APIKeyEnv}, vllm.Timeouts{Generate: timeout, Control: timeout})
		if err != nil {
			return nil, badInput(ctx, "evaluate: judge %s: %v", s.URL, err)
		}
		judges = vllm.Fleet{c}
	}
	models := make([]string, len(judges))
	for i, c := range judges {
		models[i] = s.Model
		if models[i] == "" {
			ms, err := c.Models(ctx)
			if err != nil {
				return nil, serverError(ctx, err, "evaluate: judge model")
			}
			models[i] = ms[0]
		}
	}
	rubric, scale, maxTokens := s.Rubric, s.Scale, s.MaxTokens
	var next atomic.Uint64
	var zero float32
	return func(ctx context.Context, p *prompt, r *Rollout) error {
		msg := strings.NewReplacer("{prompt}", p.promptText(), "{completion}", r.Text, "{answer}", answerText(p)).Replace(rubric)
		if err := sem.acquire(ctx); err != nil {
			return err
		}
		defer sem.release()
		i := int(next.Add(1)-1) % len(judges)
		var res *vllm.Result
		var err error
		for try := 0; ; try++ {
			res, err = judges[i].Chat(ctx, vllm.ChatRequest{Model: models[i], Messages: []vllm.Message{{Role: "user", Content: msg}},
				MaxTokens: maxTokens, Temperature: &zero, N: 1})
			if err == nil || ctx.Err() != nil || classify(err) == pipelines.ErrTypeServerRejected || try == transientRetries {
				break
			}
			t := time.NewTimer(retryBackoff << try)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
		if err != nil {
			return serverError(ctx, err, "evaluate: judge: prompt %s sample %d", p.id, r.Sample)
		}
		x, ok := firstNumber(res.Choices[0].Text)
		if ok && x >= 0 && x <= scale {
			score := x / scale
			r.Score = &score
		} else {
			r.Score, r.Unparsed = boolScore(false), true
		}
		return nil
	}, nil
}
