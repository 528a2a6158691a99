package double

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/rlflow/rlflow/vllm/double/bigram"
)

// Bounds of one generation request.
const (
	maxPrompts   = 4096 // prompts per completions request
	maxN         = 128  // samples per prompt
	maxSequences = 8192 // prompts × n
	maxLogprobs  = 20   // vLLM's default max_logprobs
	maxStops     = 16
)

// sampling holds the parameters both OpenAI routes share.
type sampling struct {
	maxTokens   int
	temperature float64
	topP        float64
	n           int
	seed        *int64
	stop        []string
	logprobs    bool
	topLogprobs int
}

// completionBody is /v1/completions' request: the fields go-openai may
// send. An unknown field is ignored, as vLLM's protocol models ignore
// extra fields (they log a warning); a known field of the wrong type or
// out of range is a 400 naming it, as vLLM's validation is. Features the
// double does not implement are refused rather than ignored.
type completionBody struct {
	Model            string             `json:"model"`
	Prompt           json.RawMessage    `json:"prompt"`
	BestOf           *int               `json:"best_of"`
	Echo             bool               `json:"echo"`
	FrequencyPenalty float64            `json:"frequency_penalty"`
	LogitBias        map[string]float64 `json:"logit_bias"`
	Store            bool               `json:"store"`
	Metadata         map[string]string  `json:"metadata"`
	Logprobs         *int               `json:"logprobs"`
	MaxTokens        *int               `json:"max_tokens"`
	N                *int               `json:"n"`
	PresencePenalty  float64            `json:"presence_penalty"`
	Seed             *int64             `json:"seed"`
	Stop             json.RawMessage    `json:"stop"`
	Stream           bool               `json:"stream"`
	StreamOptions    json.RawMessage    `json:"stream_options"`
	Suffix           string             `json:"suffix"`
	Temperature      *float64           `json:"temperature"`
	TopP             *float64           `json:"top_p"`
	User             string             `json:"user"`
}

// chatBody is /v1/chat/completions' request (go-openai's fields).
type chatBody struct {
	Model               string             `json:"model"`
	Messages            []chatMessage      `json:"messages"`
	MaxTokens           *int               `json:"max_tokens"`
	MaxCompletionTokens *int               `json:"max_completion_tokens"`
	Temperature         *float64           `json:"temperature"`
	TopP                *float64           `json:"top_p"`
	N                   *int               `json:"n"`
	Stream              bool               `json:"stream"`
	Stop                json.RawMessage    `json:"stop"`
	PresencePenalty     float64            `json:"presence_penalty"`
	ResponseFormat      json.RawMessage    `json:"response_format"`
	Seed                *int64             `json:"seed"`
	FrequencyPenalty    float64            `json:"frequency_penalty"`
	LogitBias           map[string]float64 `json:"logit_bias"`
	Logprobs            bool               `json:"logprobs"`
	TopLogprobs         int                `json:"top_logprobs"`
	User                string             `json:"user"`
	Functions           json.RawMessage    `json:"functions"`
	FunctionCall        json.RawMessage    `json:"function_call"`
	Tools               json.RawMessage    `json:"tools"`
	ToolChoice          json.RawMessage    `json:"tool_choice"`
	StreamOptions       json.RawMessage    `json:"stream_options"`
	ParallelToolCalls   json.RawMessage    `json:"parallel_tool_calls"`
	Store               bool               `json:"store"`
	ReasoningEffort     string             `json:"reasoning_effort"`
	Metadata            map[string]string  `json:"metadata"`
	Prediction          json.RawMessage    `json:"prediction"`
	ChatTemplateKwargs  json.RawMessage    `json:"chat_template_kwargs"`
	ServiceTier         string             `json:"service_tier"`
	Verbosity           string             `json:"verbosity"`
	SafetyIdentifier    string             `json:"safety_identifier"`
	GuidedChoice        []string           `json:"guided_choice"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
	Name    string          `json:"name"`
}

func (s *Server) authorized(w http.ResponseWriter, r *http.Request) bool {
	if s.cfg.APIKey == "" || r.Header.Get("Authorization") == "Bearer "+s.cfg.APIKey {
		return true
	}
	writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"})
	return false
}

func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	if !s.authorized(w, r) {
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{map[string]any{
		"id": s.cfg.ModelName, "object": "model", "created": time.Now().Unix(), "owned_by": "vllm",
		"root": s.cfg.ModelName, "parent": nil, "max_model_len": s.cfg.MaxModelLen,
	}}})
}

// decodeBody decodes an OpenAI body as vLLM does: unknown fields are
// ignored; bad JSON, a non-object body or a known field of the wrong JSON
// type is a 400 naming the field.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, v any) error {
	body, err := s.readBody(w, r)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		switch {
		case errors.As(err, &te) && te.Field != "":
			return badRequest("invalid request body: %s: got a JSON %s, want %s", te.Field, te.Value, jsonKind(te.Type))
		case errors.As(err, &te):
			return badRequest("invalid request body: want a JSON object, got a JSON %s", te.Value)
		}
		return badRequest("invalid request body: %v", err)
	}
	if dec.More() {
		return badRequest("invalid request body: trailing data after the JSON object")
	}
	return nil
}

// jsonKind names the JSON a Go field type takes, for error messages.
func jsonKind(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.Slice, reflect.Array:
		return "list"
	}
	return "object"
}

func (s *Server) checkModel(model string) error {
	if model != s.cfg.ModelName {
		return &httpError{http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model)}
	}
	return nil
}

// common validates what both routes share and refuses what the double
// does not implement (rather than silently ignoring it).
func common(maxTokens *int, temperature, topP *float64, n *int, seed *int64, stopRaw json.RawMessage,
	stream bool, freq, pres float64, bias map[string]float64) (sampling, error) {
	sp := sampling{maxTokens: 16, temperature: 1, topP: 1, n: 1, seed: seed}
	switch {
	case stream:
		return sp, badRequest("double: stream=true is not supported")
	case freq != 0 || pres != 0:
		return sp, badRequest("double: frequency_penalty and presence_penalty are not supported")
	case len(bias) > 0:
		return sp, badRequest("double: logit_bias is not supported")
	}
	if maxTokens != nil {
		if *maxTokens < 1 {
			return sp, badRequest("max_tokens must be at least 1, got %d", *maxTokens)
		}
		sp.maxTokens = *maxTokens
	}
	if temperature != nil {
		if !(*temperature >= 0 && *temperature <= 100) {
			return sp, badRequest("temperature must be in [0, 100], got %v", *temperature)
		}
		sp.temperature = *temperature
	}
	if topP != nil {
		if !(*topP > 0 && *topP <= 1) {
			return sp, badRequest("top_p must be in (0, 1], got %v", *topP)
		}
		sp.topP = *topP
	}
	if n != nil {
		if *n < 1 || *n > maxN {
			return sp, badRequest("n must be in 1..%d, got %d", maxN, *n)
		}
		sp.n = *n
	}
	stop, err := stopList(stopRaw)
	if err != nil {
		return sp, err
	}
	sp.stop = stop
	return sp, nil
}

func stopList(raw json.RawMessage) ([]string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, nil
	}
	var list []string
	if json.Unmarshal(raw, &list) != nil {
		return nil, badRequest("stop must be a string or a list of strings")
	}
	if len(list) > maxStops {
		return nil, badRequest("at most %d stop strings, got %d", maxStops, len(list))
	}
	return list, nil
}

// prompts reads a completions prompt: a string, a list of strings, a list
// of token ids or a list of token-id lists (ids are bytes, 0..127).
func prompts(raw json.RawMessage) ([]string, error) {
	if isNull(raw) {
		return nil, badRequest("prompt is required")
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, nil
	}
	var list []string
	if json.Unmarshal(raw, &list) == nil {
		return list, nil
	}
	var ids []int
	if json.Unmarshal(raw, &ids) == nil {
		p, err := detokenize(ids)
		return []string{p}, err
	}
	var idLists [][]int
	if json.Unmarshal(raw, &idLists) == nil {
		out := make([]string, len(idLists))
		for i, ids := range idLists {
			p, err := detokenize(ids)
			if err != nil {
				return nil, err
			}
			out[i] = p
		}
		return out, nil
	}
	return nil, badRequest("prompt must be a string, a list of strings, or token ids")
}

func detokenize(ids []int) (string, error) {
	b := make([]byte, len(ids))
	for i, id := range ids {
		if id < 0 || id >= bigram.Vocab {
			return "", badRequest("token id %d out of vocabulary 0..%d", id, bigram.Vocab-1)
		}
		b[i] = byte(id)
	}
	return string(b), nil
}

// reply is a generation route's answer: the body, its sequences, and the
// keys of the seeded samples it delivers once written (sampleKeys; "" for
// an aborted sequence).
type reply struct {
	body      any
	sequences int
	samples   []string
}

// serveJSON answers an OpenAI API request: the API key, the body decoded
// into a B (decodeBody), then answer's reply; a client that went away gets
// nothing. The reply's samples count as delivered once the whole response
// is flushed to the connection.
func serveJSON[B any](s *Server, w http.ResponseWriter, r *http.Request, answer func(context.Context, *B) (*reply, error)) {
	if !s.authorized(w, r) {
		return
	}
	var body B
	if err := s.decodeBody(w, r, &body); err != nil {
		fail(w, err)
		return
	}
	rep, err := answer(r.Context(), &body)
	if err != nil {
		if r.Context().Err() == nil {
			fail(w, err)
		}
		return
	}
	defer s.sched.sent(rep.sequences)
	if writeJSON(w, http.StatusOK, rep.body) != nil || http.NewResponseController(w).Flush() != nil {
		return
	}
	if r.Context().Err() != nil {
		// The client had gone (its connection closed) before the answer
		// was ready: the bytes went to a dead connection, not to it.
		return
	}
	s.count(func(st *Stats) {
		for _, k := range rep.samples {
			if k == "" {
				continue
			}
			if _, ok := s.delivered[k]; ok || len(s.delivered) < maxTrackedPrompts {
				s.delivered[k] = struct{}{}
				st.Delivered++
			} else {
				st.SamplesUntracked++
			}
		}
	})
}

// sampleKeys keys every sequence of a request (prompt i's sample j is
// sequence i*n+j, as generate draws them): route, seed, sequence index,
// sampling parameters and prompt text fix a sample's text on given
// weights. Unseeded requests get no keys.
func sampleKeys(route string, ps []string, sp sampling) []string {
	if sp.seed == nil {
		return nil
	}
	params := fmt.Sprintf("%d|%g|%g|%q|%t|%d", sp.maxTokens, sp.temperature, sp.topP, sp.stop, sp.logprobs, sp.topLogprobs)
	keys := make([]string, 0, len(ps)*sp.n)
	for i, p := range ps {
		for j := range sp.n {
			keys = append(keys, fmt.Sprintf("%s\x00%d\x00%d\x00%s\x00%s", route, *sp.seed, i*sp.n+j, params, p))
		}
	}
	return keys
}

// deliveredKeys keeps the keys of the samples that finished (not aborted).
func deliveredKeys(keys []string, samples []bigram.Sample) []string {
	if keys == nil {
		return nil
	}
	out := make([]string, len(samples))
	for i, smp := range samples {
		if smp.FinishReason != "abort" {
			out[i] = keys[i]
		}
	}
	return out
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) { serveJSON(s, w, r, s.complete) }

func (s *Server) complete(ctx context.Context, b *completionBody) (*reply, error) {
	if err := s.checkModel(b.Model); err != nil {
		return nil, err
	}
	switch {
	case b.Echo:
		return nil, badRequest("double: echo is not supported")
	case b.Suffix != "":
		return nil, badRequest("double: suffix is not supported")
	case b.BestOf != nil && *b.BestOf != 1:
		return nil, badRequest("double: best_of is not supported")
	}
	sp, err := common(b.MaxTokens, b.Temperature, b.TopP, b.N, b.Seed, b.Stop, b.Stream, b.FrequencyPenalty, b.PresencePenalty, b.LogitBias)
	if err != nil {
		return nil, err
	}
	if b.Logprobs != nil {
		if *b.Logprobs < 0 || *b.Logprobs > maxLogprobs {
			return nil, badRequest("logprobs must be in 0..%d, got %d", maxLogprobs, *b.Logprobs)
		}
		sp.logprobs, sp.topLogprobs = true, *b.Logprobs
	}
	ps, err := prompts(b.Prompt)
	if err != nil {
		return nil, err
	}
	if len(ps) == 0 || len(ps) > maxPrompts {
		return nil, badRequest("prompt must hold 1..%d prompts, got %d", maxPrompts, len(ps))
	}
	if len(ps)*sp.n > maxSequences {
		return nil, badRequest("%d prompts x n=%d exceeds %d sequences per request", len(ps), sp.n, maxSequences)
	}
	promptTokens := 0
	for _, p := range ps {
		if err := s.checkLength(len(p), sp.maxTokens); err != nil {
			return nil, err
		}
		promptTokens += len(p)
	}
	keys := sampleKeys("/v1/completions", ps, sp)
	s.seen(ps, keys)
	samples, err := s.generate(ctx, ps, sp)
	if err != nil {
		return nil, err
	}
	choices := make([]map[string]any, len(samples))
	completionTokens := 0
	for i, smp := range samples {
		completionTokens += smp.Tokens
		var lp any
		if sp.logprobs {
			lp = completionLogprobs(smp.Logprobs)
		}
		choices[i] = map[string]any{"index": i, "text": smp.Text, "logprobs": lp, "finish_reason": smp.FinishReason, "stop_reason": nil}
	}
	return &reply{body: map[string]any{
		"id": fmt.Sprintf("cmpl-%016x", s.ids.Add(1)), "object": "text_completion", "created": time.Now().Unix(),
		"model": s.cfg.ModelName, "choices": choices,
		"usage": map[string]int{"prompt_tokens": promptTokens, "completion_tokens": completionTokens, "total_tokens": promptTokens + completionTokens},
	}, sequences: len(samples), samples: deliveredKeys(keys, samples)}, nil
}

func (s *Server) checkLength(promptTokens, maxTokens int) error {
	if promptTokens+maxTokens > s.cfg.MaxModelLen {
		return badRequest("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			s.cfg.MaxModelLen, promptTokens+maxTokens, promptTokens, maxTokens)
	}
	return nil
}

// seen counts a request's prompts, and its samples that were delivered
// before (keys: sampleKeys).
func (s *Server) seen(ps []string, keys []string) {
	s.count(func(st *Stats) {
		for _, p := range ps {
			if _, ok := st.Prompts[p]; ok || len(st.Prompts) < maxTrackedPrompts {
				st.Prompts[p]++
			} else {
				st.PromptsUntracked++
			}
		}
		for _, k := range keys {
			if _, ok := s.delivered[k]; ok {
				st.Rerequested++
			}
		}
	})
}

func completionLogprobs(lps []bigram.TokenLogprob) map[string]any {
	tokens := make([]string, len(lps))
	logps := make([]float64, len(lps))
	tops := make([]map[string]float64, len(lps))
	offsets := make([]int, len(lps))
	off := 0
	for i, lp := range lps {
		tokens[i], logps[i], offsets[i] = lp.Token, lp.Logprob, off
		off += len(lp.Token)
		tops[i] = map[string]float64{}
		for _, t := range lp.Top {
			tops[i][t.Token] = t.Logprob
		}
	}
	return map[string]any{"tokens": tokens, "token_logprobs": logps, "top_logprobs": tops, "text_offset": offsets}
}

func (s *Server) chat(w http.ResponseWriter, r *http.Request) { serveJSON(s, w, r, s.chatComplete) }

func (s *Server) chatComplete(ctx context.Context, b *chatBody) (*reply, error) {
	if err := s.checkModel(b.Model); err != nil {
		return nil, err
	}
	if !isNull(b.Tools) || !isNull(b.Functions) || !isNull(b.ResponseFormat) || len(b.GuidedChoice) > 0 {
		return nil, badRequest("double: tools, functions, response_format and guided_choice are not supported")
	}
	maxTokens := b.MaxTokens
	if b.MaxCompletionTokens != nil {
		maxTokens = b.MaxCompletionTokens
	}
	sp, err := common(maxTokens, b.Temperature, b.TopP, b.N, b.Seed, b.Stop, b.Stream, b.FrequencyPenalty, b.PresencePenalty, b.LogitBias)
	if err != nil {
		return nil, err
	}
	if b.TopLogprobs < 0 || b.TopLogprobs > maxLogprobs || (b.TopLogprobs > 0 && !b.Logprobs) {
		return nil, badRequest("top_logprobs must be in 0..%d and needs logprobs=true", maxLogprobs)
	}
	sp.logprobs, sp.topLogprobs = b.Logprobs, b.TopLogprobs
	prompt, err := chatPrompt(b.Messages)
	if err != nil {
		return nil, err
	}
	if err := s.checkLength(len(prompt), sp.maxTokens); err != nil {
		return nil, err
	}
	keys := sampleKeys("/v1/chat/completions", []string{prompt}, sp)
	s.seen([]string{prompt}, keys)
	samples, err := s.generate(ctx, []string{prompt}, sp)
	if err != nil {
		return nil, err
	}
	choices := make([]map[string]any, len(samples))
	completionTokens := 0
	for i, smp := range samples {
		completionTokens += smp.Tokens
		var lp any
		if sp.logprobs {
			lp = chatLogprobs(smp.Logprobs)
		}
		choices[i] = map[string]any{"index": i, "message": map[string]any{"role": "assistant", "content": smp.Text},
			"logprobs": lp, "finish_reason": smp.FinishReason, "stop_reason": nil}
	}
	return &reply{body: map[string]any{
		"id": fmt.Sprintf("chatcmpl-%016x", s.ids.Add(1)), "object": "chat.completion", "created": time.Now().Unix(),
		"model": s.cfg.ModelName, "choices": choices,
		"usage": map[string]int{"prompt_tokens": len(prompt), "completion_tokens": completionTokens, "total_tokens": len(prompt) + completionTokens},
	}, sequences: len(samples), samples: deliveredKeys(keys, samples)}, nil
}

// chatPrompt is the double's chat template: every message's content on its
// own line, then a newline, so the reply starts a new text (see bigram).
func chatPrompt(msgs []chatMessage) (string, error) {
	if len(msgs) == 0 {
		return "", badRequest("messages must not be empty")
	}
	var b strings.Builder
	for i, m := range msgs {
		switch m.Role {
		case "system", "user", "assistant", "developer":
		default:
			return "", badRequest("messages[%d].role %q is not supported", i, m.Role)
		}
		text, err := messageText(m.Content)
		if err != nil {
			return "", badRequest("messages[%d].content: %v", i, err)
		}
		b.WriteString(text)
		b.WriteByte('\n')
	}
	return b.String(), nil
}

// messageText accepts a string or a list of {"type": "text", "text": ...} parts.
func messageText(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) != nil {
		return "", fmt.Errorf("must be a string or a list of text parts")
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Type != "text" {
			return "", fmt.Errorf("part type %q is not supported", p.Type)
		}
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

func chatLogprobs(lps []bigram.TokenLogprob) map[string]any {
	content := make([]map[string]any, len(lps))
	for i, lp := range lps {
		top := make([]map[string]any, len(lp.Top))
		for j, t := range lp.Top {
			top[j] = map[string]any{"token": t.Token, "logprob": t.Logprob, "bytes": tokenBytes(t.Token)}
		}
		content[i] = map[string]any{"token": lp.Token, "logprob": lp.Logprob, "bytes": tokenBytes(lp.Token), "top_logprobs": top}
	}
	return map[string]any{"content": content}
}

func tokenBytes(t string) []int {
	out := make([]int, len(t))
	for i := range len(t) {
		out[i] = int(t[i])
	}
	return out
}

// generate runs prompts × n sequences concurrently through the scheduler
// and samples each with the model current when it finishes (so a
// keep-paused request resumed after an update uses the new weights). An
// aborted sequence returns the part of its text "generated" so far, with
// finish reason "abort", as vLLM does.
func (s *Server) generate(ctx context.Context, ps []string, sp sampling) ([]bigram.Sample, error) {
	out := make([]bigram.Sample, len(ps)*sp.n)
	errs := make([]error, len(out))
	var wg sync.WaitGroup
	for i := range out {
		wg.Go(func() {
			res, err := s.sched.run(ctx, s.cfg.Latency)
			if err != nil {
				errs[i] = err
				return
			}
			smp := s.Model().Sample(ps[i/sp.n], s.sampleOptions(sp, i))
			if res.aborted {
				smp = truncate(smp, res.done)
			}
			out[i] = smp
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			finished := 0
			for _, e := range errs {
				if e == nil {
					finished++
				}
			}
			s.sched.sent(finished) // no answer goes out
			return nil, err
		}
	}
	served, aborted := 0, 0
	for _, smp := range out {
		if smp.FinishReason == "abort" {
			aborted++
		} else {
			served++
		}
	}
	s.count(func(st *Stats) { st.Completions += served; st.Aborted += aborted })
	return out, nil
}

// sampleOptions gives sequence i its generator: seeded requests are
// reproducible per (seed, sequence index), as vLLM's per-request seed is.
func (s *Server) sampleOptions(sp sampling, i int) bigram.SampleOptions {
	var r *rand.Rand
	if sp.seed != nil {
		r = rand.New(rand.NewPCG(uint64(*sp.seed), uint64(i)))
	} else {
		a, b := s.seed()
		r = rand.New(rand.NewPCG(a, b))
	}
	return bigram.SampleOptions{
		MaxTokens: sp.maxTokens, Temperature: sp.temperature, TopP: sp.topP, Rand: r,
		Stop: sp.stop, Logprobs: sp.logprobs, TopLogprobs: sp.topLogprobs,
	}
}

// truncate keeps the fraction done of a sample's tokens.
func truncate(smp bigram.Sample, done float64) bigram.Sample {
	keep := int(math.Floor(done * float64(len(smp.Text))))
	keep = min(max(keep, 0), len(smp.Text))
	smp.Text = smp.Text[:keep]
	smp.Tokens = keep
	if len(smp.Logprobs) > keep {
		smp.Logprobs = smp.Logprobs[:keep]
	}
	smp.FinishReason = "abort"
	return smp
}
