package activities

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
)

const (
	benchPrompts     = 2000
	benchConcurrency = double.BenchSlots
	benchMaxTokens   = 32
)

// idealClient is the least a Go client can do at the same concurrency:
// workers posting a fixed body and discarding the answer.
func idealClient(t testing.TB, url string, prompts int) time.Duration {
	hc := vllm.NewHTTPClient(benchConcurrency)
	jobs := make(chan int)
	var wg sync.WaitGroup
	start := time.Now()
	for range benchConcurrency {
		wg.Go(func() {
			for i := range jobs {
				body := fmt.Sprintf(`{"model":%q,"prompt":"prompt number %d: ","max_tokens":%d}`, double.DefaultModelName, i, benchMaxTokens)
				resp, err := hc.Post(url+"/v1/completions", "application/json", bytes.NewBufferString(body))
				if err != nil {
					t.Error(err)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Errorf("status %d", resp.StatusCode)
				}
			}
		})
	}
	for i := range prompts {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	return time.Since(start)
}

func benchGenerate(t testing.TB, a *Activities, in GenerateInput) time.Duration {
	start := time.Now()
	out, err := a.Generate(context.Background(), in)
	require.NoError(t, err)
	require.Equal(t, benchPrompts, out.Samples)
	return time.Since(start)
}

// TestGenerateThroughput is the benchmark: 2,000 prompts against
// the double at 50 ms per sequence with 256 slots. generate must beat the
// one-at-a-time pattern (2,000 × 50 ms = 100 s) by 100× and stay within
// 10% of an ideal minimal client at the same concurrency: asserted with
// RLFLOW_BENCH_STRICT=1, on a machine with cores to spare.
func TestGenerateThroughput(t *testing.T) {
	if testing.Short() {
		t.Skip("benchmark")
	}
	d := newDouble(t, double.BenchConfig())
	a := newActivities(t)
	sc := stepContext(t, "bench", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(t, sc.BaseDir, "p.jsonl", promptLines(benchPrompts)...),
		MaxTokens: benchMaxTokens, Concurrency: benchConcurrency}
	idealClient(t, d.URL, benchConcurrency) // warm both servers' connections up
	best, ideal := time.Duration(1<<62), time.Duration(1<<62)
	for range 3 {
		ideal = min(ideal, idealClient(t, d.URL, benchPrompts))
		best = min(best, benchGenerate(t, a, in))
	}
	sequential := time.Duration(benchPrompts) * double.BenchLatency
	floor := double.IdealDuration(d.Config(), benchPrompts)
	t.Logf("generate %v, ideal client %v (%.2fx), floor %v, one-at-a-time %v (%.0fx faster)",
		best, ideal, float64(best)/float64(ideal), floor, sequential, float64(sequential)/float64(best))
	if os.Getenv("RLFLOW_BENCH_STRICT") == "1" {
		assert.GreaterOrEqual(t, float64(sequential)/float64(best), 100.0)
		assert.LessOrEqual(t, float64(best)/float64(ideal), 1.10)
		return
	}
	// On a loaded machine both clients are CPU-bound; these bounds still
	// catch a serial pool or per-request connection churn.
	assert.GreaterOrEqual(t, float64(sequential)/float64(best), 20.0)
	assert.LessOrEqual(t, float64(best)/float64(ideal), 2.0)
}

func BenchmarkGenerate(b *testing.B) {
	d := newDouble(b, double.BenchConfig())
	a := New(Deps{DataDir: b.TempDir()})
	sc := stepContext(b, "bench", d)
	in := GenerateInput{Context: sc, Prompts: writeLines(b, sc.BaseDir, "p.jsonl", promptLines(benchPrompts)...),
		MaxTokens: benchMaxTokens, Concurrency: benchConcurrency}
	for b.Loop() {
		benchGenerate(b, a, in)
	}
}
