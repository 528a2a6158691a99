package vllm

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	openai "github.com/sashabaranov/go-openai"
)

// greedyTemperature is sent for a requested temperature of 0: go-openai
// drops a zero float (omitempty) and vLLM would then sample at its default
// of 1.0, while any temperature below vLLM's 1e-5 already means greedy.
const greedyTemperature = 1e-6

// CompletionRequest is one /v1/completions call. Choices come back in
// prompt order, N per prompt.
type CompletionRequest struct {
	Model   string
	Prompts []string
	// MaxTokens bounds each sample; 0 takes the server's default (16 in vLLM).
	MaxTokens int
	// Temperature: nil takes the server's default; 0 is greedy.
	Temperature *float32
	TopP        float32 // 0: server default
	N           int     // samples per prompt; 0 means 1
	Seed        *int
	Stop        []string
	// Logprobs > 0 returns, per generated token, its logprob and that many
	// top alternatives (go-openai cannot send logprobs=0).
	Logprobs int
}

// ChatRequest is one /v1/chat/completions call.
type ChatRequest struct {
	Model       string
	Messages    []Message
	MaxTokens   int
	Temperature *float32
	TopP        float32
	N           int
	Seed        *int
	Stop        []string
	Logprobs    bool
	TopLogprobs int
}

// Message is one chat message.
type Message struct {
	Role    string // "system", "user", "assistant"
	Content string
}

// Choice is one generated text.
type Choice struct {
	Index        int // position in the response
	PromptIndex  int // completions: the prompt it continues (Index / N)
	Text         string
	FinishReason string // "stop", "length", "abort" (server paused with mode=abort), ...
	Logprobs     []TokenLogprob
}

// TokenLogprob is one generated token's log-probability and alternatives.
type TokenLogprob struct {
	Token   string
	Logprob float64
	Top     map[string]float64
}

// Usage counts tokens as the server reports them.
type Usage struct {
	PromptTokens     int
	CompletionTokens int
	TotalTokens      int
}

// Result is a completions or chat answer.
type Result struct {
	ID      string
	Model   string
	Choices []Choice
	Usage   Usage
}

func temperature(t *float32) float32 {
	if t == nil {
		return 0 // omitted: server default
	}
	if *t == 0 {
		return greedyTemperature
	}
	return *t
}

// Completions calls /v1/completions under Timeouts.Generate. Not retried:
// the caller decides which prompts to send again.
func (c *Client) Completions(ctx context.Context, r CompletionRequest) (*Result, error) {
	const callName = "POST /v1/completions"
	if len(r.Prompts) == 0 {
		return nil, &Error{Server: c.base, Call: callName, Message: "no prompts"}
	}
	n := max(r.N, 1)
	budget := budgetFor(ctx, c.opts.Timeouts.generate(), "Generate")
	ctx, cancel := context.WithTimeout(ctx, budget.timeout)
	defer cancel()
	resp, err := c.oai.CreateCompletion(ctx, openai.CompletionRequest{
		Model:       r.Model,
		Prompt:      r.Prompts,
		MaxTokens:   r.MaxTokens,
		Temperature: temperature(r.Temperature),
		TopP:        r.TopP,
		N:           r.N,
		Seed:        r.Seed,
		Stop:        r.Stop,
		LogProbs:    r.Logprobs,
	})
	if err != nil {
		return nil, c.openaiError(ctx, callName, budget, err)
	}
	out := &Result{ID: resp.ID, Model: resp.Model}
	if resp.Usage != nil {
		out.Usage = Usage{resp.Usage.PromptTokens, resp.Usage.CompletionTokens, resp.Usage.TotalTokens}
	}
	if want := len(r.Prompts) * n; len(resp.Choices) != want {
		return nil, &Error{Server: c.base, Call: callName, Status: http.StatusOK,
			Message: fmt.Sprintf("%d choices for %d prompts x %d samples", len(resp.Choices), len(r.Prompts), n)}
	}
	out.Choices = make([]Choice, len(resp.Choices))
	seen := make([]bool, len(resp.Choices))
	for _, ch := range resp.Choices {
		if ch.Index < 0 || ch.Index >= len(resp.Choices) || seen[ch.Index] {
			return nil, &Error{Server: c.base, Call: callName, Status: http.StatusOK, Message: fmt.Sprintf("choice index %d out of range or repeated", ch.Index)}
		}
		seen[ch.Index] = true
		choice := Choice{Index: ch.Index, PromptIndex: ch.Index / n, Text: ch.Text, FinishReason: ch.FinishReason}
		lp := ch.LogProbs
		for j, tok := range lp.Tokens {
			t := TokenLogprob{Token: tok}
			if j < len(lp.TokenLogprobs) {
				t.Logprob = float64(lp.TokenLogprobs[j])
			}
			if j < len(lp.TopLogprobs) && len(lp.TopLogprobs[j]) > 0 {
				t.Top = make(map[string]float64, len(lp.TopLogprobs[j]))
				for k, v := range lp.TopLogprobs[j] {
					t.Top[k] = float64(v)
				}
			}
			choice.Logprobs = append(choice.Logprobs, t)
		}
		out.Choices[ch.Index] = choice
	}
	return out, nil
}

// Chat calls /v1/chat/completions under Timeouts.Generate. Not retried.
func (c *Client) Chat(ctx context.Context, r ChatRequest) (*Result, error) {
	const callName = "POST /v1/chat/completions"
	if len(r.Messages) == 0 {
		return nil, &Error{Server: c.base, Call: callName, Message: "no messages"}
	}
	msgs := make([]openai.ChatCompletionMessage, len(r.Messages))
	for i, m := range r.Messages {
		msgs[i] = openai.ChatCompletionMessage{Role: m.Role, Content: m.Content}
	}
	budget := budgetFor(ctx, c.opts.Timeouts.generate(), "Generate")
	ctx, cancel := context.WithTimeout(ctx, budget.timeout)
	defer cancel()
	// max_completion_tokens: the chat API's name for the bound since
	// max_tokens was deprecated; vLLM's chat route takes both.
	resp, err := c.oai.CreateChatCompletion(ctx, openai.ChatCompletionRequest{
		Model:               r.Model,
		Messages:            msgs,
		MaxCompletionTokens: r.MaxTokens,
		Temperature:         temperature(r.Temperature),
		TopP:                r.TopP,
		N:                   r.N,
		Seed:                r.Seed,
		Stop:                r.Stop,
		LogProbs:            r.Logprobs,
		TopLogProbs:         r.TopLogprobs,
	})
	if err != nil {
		return nil, c.openaiError(ctx, callName, budget, err)
	}
	if want := max(r.N, 1); len(resp.Choices) != want {
		return nil, &Error{Server: c.base, Call: callName, Status: http.StatusOK,
			Message: fmt.Sprintf("%d choices for %d samples", len(resp.Choices), want)}
	}
	out := &Result{ID: resp.ID, Model: resp.Model,
		Usage: Usage{resp.Usage.PromptTokens, resp.Usage.CompletionTokens, resp.Usage.TotalTokens}}
	for _, ch := range resp.Choices {
		choice := Choice{Index: ch.Index, Text: ch.Message.Content, FinishReason: string(ch.FinishReason)}
		if ch.LogProbs != nil {
			for _, lp := range ch.LogProbs.Content {
				t := TokenLogprob{Token: lp.Token, Logprob: lp.LogProb}
				if len(lp.TopLogProbs) > 0 {
					t.Top = make(map[string]float64, len(lp.TopLogProbs))
					for _, top := range lp.TopLogProbs {
						t.Top[top.Token] = top.LogProb
					}
				}
				choice.Logprobs = append(choice.Logprobs, t)
			}
		}
		out.Choices = append(out.Choices, choice)
	}
	return out, nil
}

// openaiError maps go-openai's errors onto *Error.
func (c *Client) openaiError(ctx context.Context, callName string, budget callBudget, err error) *Error {
	e := &Error{Server: c.base, Call: callName, Err: err}
	var apiErr *openai.APIError
	var reqErr *openai.RequestError
	// RequestError first: it may wrap an empty APIError (go-openai leaves
	// one behind when the error body is not OpenAI-shaped, e.g. vLLM's
	// {"error": "Unauthorized"}); its raw body has the real text.
	switch {
	case errors.As(err, &reqErr):
		e.Status, e.Message = reqErr.HTTPStatusCode, errorMessage(reqErr.HTTPStatusCode, reqErr.Body)
	case errors.As(err, &apiErr):
		e.Status, e.Message = apiErr.HTTPStatusCode, clip(apiErr.Message)
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		// ctx is the call's own budget: Timeouts.Generate, or what the
		// caller's deadline left it.
		e.Message, e.Err = budget.expired(), budget.cause()
	case ctx.Err() != nil:
		e.Message, e.Err = ctx.Err().Error(), ctx.Err()
	default:
		e.Message = err.Error()
	}
	return e
}
