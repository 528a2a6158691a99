package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	cdpinput "github.com/chromedp/cdproto/input"
	"github.com/chromedp/chromedp"
	"github.com/rlflow/rlflow/devserver"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/runs"
	"github.com/rlflow/rlflow/vllm/double"
	"github.com/rlflow/rlflow/workflows"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
)

// uiPageTimeout bounds the wait for one page to show what a test expects:
// the UI fetches over HTTP after load and visibility lags the history, so
// the page is polled and reloaded until then.
const uiPageTimeout = 45 * time.Second

// demoSteps are rlhf-demo.yaml's steps as the UI names their activities:
// "<step id> · <step type>" (the activity summary).
var demoSteps = []string{
	"before · generate", "train · exec", "pause · pause", "sync · broadcast",
	"resume · resume", "after · generate", "eval · evaluate",
}

// The Temporal UI as a user sees it, in a real browser (Debian's chromium,
// headless), on the dev server's UI: after a 2-iteration RLHF demo run, an
// iteration's timeline shows every step by name, its Current Details (User
// Metadata tab) a table of the steps and the eval score, and the pipeline's
// a table of the steps and the eval score per iteration; a run started with the UI's own Start Workflow form is listed
// by `RlflowPipeline = "rlhf-demo"`; a paused run is listed by
// `RlflowStatus = "Paused"`. Full-page screenshots (uistatus-*.png) go to
// $RLFLOW_TEST_OUT, or to a directory the test logs.
func TestBrowserUIShowsTheRun(t *testing.T) {
	chrome := findChromium(t)
	temporal := testutil.TemporalCLI(t)
	shots := screenshotDir(t)
	bin := testutil.RlflowBinary(t)

	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	srv, err := devserver.Start(ctx, devserver.Options{TemporalPath: temporal, UIPort: testutil.FreePort(t)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Stop() })
	c, err := runs.Connect(ctx, srv.Address, "default")
	require.NoError(t, err)
	t.Cleanup(c.Close)

	d := startDouble(t, double.Faults{})
	spec, params, work := demoSpec(t, bin, 2, d.URL)
	queue := "ui-" + t.Name()
	startWorker(t, bin, srv.Address, queue, filepath.Join(work, "logs"), "--data-dir", filepath.Join(work, "data"), "--roots", work, "--metrics-address", "127.0.0.1:0")

	// The demo, started as `rlflow run` starts it.
	demo, err := runs.Start(ctx, c, runs.StartOptions{Spec: spec, Params: params, TaskQueue: queue, SearchAttributes: true})
	require.NoError(t, err)
	var res workflows.PipelineResult
	require.NoError(t, demo.Get(ctx, &res), "the demo run")
	require.Len(t, res.Recent, 2)
	var scores []float64
	for _, it := range res.Recent {
		score, ok := it.Outputs["eval"]["score"].(float64)
		require.True(t, ok, "iteration %d: eval score %v", it.Iteration, it.Outputs["eval"])
		scores = append(scores, score)
	}
	t.Logf("demo run %s: eval scores %v", demo.GetID(), scores)

	b := newBrowser(ctx, t, chrome, shots)

	t.Run("iteration: timeline of the steps, details table with the score", func(t *testing.T) {
		child := workflows.IterationWorkflowID(demo.GetID(), 1)
		desc, err := describeRaw(ctx, c, child)
		require.NoError(t, err)
		page := runs.UIURL(srv.UIURL, "default", child, desc.GetWorkflowExecutionInfo().GetExecution().GetRunId())
		b.expect(t, "iteration", page, literals(demoSteps...), nil)
		wants := append(append(literals("Current Details"), stepRows()...), regexp.MustCompile(`\bscore\s*[=:]?\s*(`+scoreForms(scores[0])+`)(\s|$)`))
		b.expect(t, "iteration-details", tab(page, "user-metadata"), wants, []string{"No Current Details"})
	})

	t.Run("pipeline: details table with the steps and every iteration's score", func(t *testing.T) {
		page := runs.UIURL(srv.UIURL, "default", demo.GetID(), demo.GetRunID())
		wants := append(literals("Current Details", "score"), stepRows()...)
		for i, s := range scores {
			wants = append(wants, regexp.MustCompile(fmt.Sprintf(`(?m)^\s*%d\s+succeeded\s(.*\s)?(%s)(\s|$)`, i+1, scoreForms(s))))
		}
		b.expect(t, "pipeline-details", tab(page, "user-metadata"), wants, []string{"No Current Details"})
	})

	// A run started from the UI's Start Workflow form, as a user starts one:
	// the pipeline inline, no search_attributes (the workflow sets them).
	uiSpec := *spec
	uiSpec.Loop.Iterations = 3
	uiParams := map[string]any{"rlflow": bin, "ckpt_root": "ckpt-ui"}
	input, err := json.Marshal(workflows.PipelineInput{Spec: &uiSpec, Params: uiParams})
	require.NoError(t, err)
	uiID := "ui-started-" + runs.NewRunID(spec.Name)
	b.startWorkflowForm(t, srv.UIURL, uiID, queue, workflows.PipelineWorkflow, string(input))
	testutil.Eventually(t, 30*time.Second, "the run started from the UI form to exist", func() bool {
		_, err := describeRaw(ctx, c, uiID)
		return err == nil
	})
	t.Cleanup(func() { _ = c.CancelWorkflow(context.Background(), uiID, "") })
	// Paused at once, so that it is still open, and paused, when looked at.
	require.NoError(t, c.SignalWorkflow(ctx, uiID, "", workflows.SignalPause, nil))

	t.Run("runs started by rlflow and from the UI are found by RlflowPipeline", func(t *testing.T) {
		b.expect(t, "list-pipeline", listURL(srv.UIURL, `RlflowPipeline = "rlhf-demo"`), literals(demo.GetID(), uiID), nil)
	})

	t.Run("a paused run's RlflowStatus reads Paused", func(t *testing.T) {
		b.expect(t, "list-paused", listURL(srv.UIURL, `RlflowStatus = "Paused"`), literals(uiID), nil)
		desc, err := describeRaw(ctx, c, uiID)
		require.NoError(t, err)
		page := runs.UIURL(srv.UIURL, "default", uiID, desc.GetWorkflowExecutionInfo().GetExecution().GetRunId())
		b.expect(t, "paused", tab(page, "search-attributes"), []*regexp.Regexp{regexp.MustCompile(`"?RlflowStatus"?\s*:?\s*"?Paused\b`)}, nil)
	})
	logRun(ctx, t, c, uiID)
}

// logRun logs a run's status and search attributes, for the test's reader.
func logRun(ctx context.Context, t *testing.T, c client.Client, id string) {
	t.Helper()
	desc, err := describeRaw(ctx, c, id)
	if err != nil {
		t.Logf("describing %s: %v", id, err)
		return
	}
	sa := desc.GetWorkflowExecutionInfo().GetSearchAttributes().GetIndexedFields()
	attrs := map[string]string{}
	for k, v := range sa {
		attrs[k] = string(v.GetData())
	}
	t.Logf("run %s: status %s, search attributes %v", id, desc.GetWorkflowExecutionInfo().GetStatus(), attrs)
}

// stepRows match a details table's rows of the demo's steps, succeeded.
func stepRows() []*regexp.Regexp {
	var out []*regexp.Regexp
	for _, st := range demoSteps {
		out = append(out, regexp.MustCompile(`(?m)^\s*`+regexp.QuoteMeta(st)+`\s+succeeded\b`))
	}
	return out
}

// scoreForms is a pattern of the ways a table may print a score: 4
// significant digits, or 2 to 4 decimals.
func scoreForms(s float64) string {
	var alts []string
	for _, f := range []string{"%.4g", "%.2f", "%.3f", "%.4f"} {
		alts = append(alts, regexp.QuoteMeta(fmt.Sprintf(f, s)))
	}
	return strings.Join(alts, "|")
}

// literals are patterns matching the strings as written.
func literals(ss ...string) []*regexp.Regexp {
	out := make([]*regexp.Regexp, len(ss))
	for i, s := range ss {
		out[i] = regexp.MustCompile(regexp.QuoteMeta(s))
	}
	return out
}

// tab is a tab of a run's page (history, user-metadata, search-attributes).
func tab(historyURL, name string) string {
	return strings.TrimSuffix(historyURL, "/history") + "/" + name
}

// listURL is the UI's workflow list filtered by a visibility query.
func listURL(base, query string) string {
	return fmt.Sprintf("%s/namespaces/default/workflows?query=%s", strings.TrimRight(base, "/"), url.QueryEscape(query))
}

// findChromium finds a Chromium or Chrome binary; without one the test
// skips, saying how to get it, except under CI (CI=true), where that is a
// failure (.ci/run installs Debian's chromium).
func findChromium(t *testing.T) string {
	t.Helper()
	names := []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"}
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	msg := fmt.Sprintf("needs a Chromium browser (none of %s in PATH; on Debian: apt-get install chromium)", strings.Join(names, ", "))
	if os.Getenv("CI") != "" {
		t.Fatal("CI " + msg)
	}
	t.Skip(msg)
	return ""
}

// screenshotDir is $RLFLOW_TEST_OUT, or a new directory under the system's
// temporary one that outlives the test (t.TempDir would be removed), logged.
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("RLFLOW_TEST_OUT")
	if dir == "" {
		var err error
		dir, err = os.MkdirTemp("", "rlflow-uistatus-")
		require.NoError(t, err)
	} else {
		require.NoError(t, os.MkdirAll(dir, 0o755))
	}
	t.Logf("screenshots (uistatus-*.png) in %s", dir)
	return dir
}

// browser is one headless Chromium tab.
type browser struct {
	ctx   context.Context
	shots string
}

func newBrowser(parent context.Context, t *testing.T, chrome, shots string) *browser {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chrome), chromedp.WindowSize(1600, 1200), chromedp.DisableGPU)
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox) // Chromium refuses its sandbox as root
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(parent, opts...)
	ctx, cancelTab := chromedp.NewContext(actx)
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	require.NoError(t, chromedp.Do(ctx), "starting %s", chrome)
	return &browser{ctx: ctx, shots: shots}
}

// pageText is what a user reads on the page: the body's text, and that of
// its iframes (the UI renders Markdown in one; a sandboxed frame's text is
// taken from its srcdoc).
const pageText = `(() => {
  let s = document.body ? document.body.innerText : "";
  for (const f of document.querySelectorAll("iframe")) {
    let d = null;
    try { d = f.contentDocument; } catch (e) {}
    s += "\n" + (d && d.body ? d.body.innerText : (f.getAttribute("srcdoc") || "").replace(/<[^>]*>/g, " "));
  }
  return s;
})()`

// expect loads page until its text matches every want and holds none of unwanted, or uiPageTimeout passes, reloading every few
// seconds, then asserts that and saves a full-page screenshot
// uistatus-<name>.png.
func (b *browser) expect(t *testing.T, name, page string, wants []*regexp.Regexp, unwanted []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, uiPageTimeout+30*time.Second)
	defer cancel()
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(page)), "loading %s", page)
	var text string
	deadline := time.Now().Add(uiPageTimeout)
	lastLoad := time.Now()
	for {
		var err error
		text, err = chromedp.Run(ctx, chromedp.Evaluate[string](pageText))
		require.NoError(t, err, "reading %s", page)
		if (len(missing(text, wants)) == 0 && len(present(text, unwanted)) == 0) || time.Now().After(deadline) {
			break
		}
		if time.Since(lastLoad) > 5*time.Second {
			require.NoError(t, chromedp.Do(ctx, chromedp.Reload()), "reloading %s", page)
			lastLoad = time.Now()
		}
		time.Sleep(500 * time.Millisecond)
	}
	b.screenshot(ctx, t, name)
	miss := missing(text, wants)
	for _, w := range miss {
		assert.Fail(t, "text not shown", "%s does not show %s", page, w)
	}
	for _, u := range present(text, unwanted) {
		assert.Fail(t, "unwanted text", "%s shows %q", page, u)
	}
	if len(miss) > 0 || len(present(text, unwanted)) > 0 {
		t.Logf("%s: page text:\n%s", page, text)
	}
}

// missing lists the wants that text does not match.
func missing(text string, wants []*regexp.Regexp) []*regexp.Regexp {
	var out []*regexp.Regexp
	for _, w := range wants {
		if !w.MatchString(text) {
			out = append(out, w)
		}
	}
	return out
}

// present lists the unwanted strings that text holds.
func present(text string, unwanted []string) []string {
	var out []string
	for _, u := range unwanted {
		if strings.Contains(text, u) {
			out = append(out, u)
		}
	}
	return out
}

func (b *browser) screenshot(ctx context.Context, t *testing.T, name string) {
	t.Helper()
	buf, err := chromedp.Run(ctx, chromedp.FullScreenshot(100) /* 100: PNG */)
	if !assert.NoError(t, err, "screenshot %s", name) {
		return
	}
	path := filepath.Join(b.shots, "uistatus-"+name+".png")
	require.NoError(t, os.WriteFile(path, buf, 0o644))
	t.Logf("screenshot: %s", path)
}

// startWorkflowForm fills and submits the UI's Start Workflow form (its
// fields' ids and test ids are the UI's own), input as json/plain: the
// text is inserted in one piece, as a paste, so that the JSON editor does
// not close brackets behind it.
func (b *browser) startWorkflowForm(t *testing.T, uiBase, id, queue, workflowType, input string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 60*time.Second)
	defer cancel()
	page := strings.TrimRight(uiBase, "/") + "/namespaces/default/workflows/start-workflow"
	editor := chromedp.CSS(`[data-language="json"][contenteditable="true"]`)
	err := chromedp.Do(ctx,
		chromedp.Navigate(page),
		chromedp.WaitVisible(chromedp.ID("workflowId")),
		chromedp.SendKeys(chromedp.ID("workflowId"), id),
		chromedp.SendKeys(chromedp.ID("taskQueue"), queue),
		chromedp.SendKeys(chromedp.ID("workflowType"), workflowType),
		chromedp.Click(editor),
		chromedp.Func(func(ctx context.Context, tab *chromedp.Target) error {
			_, err := cdp.Call(ctx, tab, cdpinput.InsertText, cdpinput.InsertTextParams{Text: input})
			return err
		}),
		chromedp.Click(chromedp.CSS(`input[name="encoding"][value="json/plain"]`)),
	)
	require.NoError(t, err, "filling the Start Workflow form at %s", page)
	b.screenshot(ctx, t, "start-form")
	require.NoError(t, chromedp.Do(ctx,
		chromedp.WaitEnabled(chromedp.CSS(`[data-testid="start-workflow-button"]`)),
		chromedp.Click(chromedp.CSS(`[data-testid="start-workflow-button"]`)),
	), "submitting the Start Workflow form at %s", page)
}

// describeRaw is the server's description of a run (its latest run).
func describeRaw(ctx context.Context, c client.Client, id string) (*workflowservice.DescribeWorkflowExecutionResponse, error) {
	d, err := c.DescribeWorkflow(ctx, id, "")
	if err != nil {
		return nil, err
	}
	return d.RawResponse, nil
}
