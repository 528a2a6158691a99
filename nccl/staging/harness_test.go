package staging

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil/gputest"
)

// The GPU tests' receiver plans the wire sequence on its own; on CPU, check
// that it reads our metadata into exactly our layout (torch is not needed).
func TestReceiverPlansOurLayout(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not on PATH: this test runs the GPU tests' Python scripts (tests/gpu); .ci/run installs it")
	}
	script := gputest.Script(t, "receiver.py")
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	for _, tc := range []struct {
		packed    bool
		threshold int64
		toBF16    bool
	}{{true, 1, false}, {true, 1000, false}, {true, 4226, true}, {true, 1 << 30, false}, {false, 0, false}, {false, 0, true}} {
		u := gpuLayout(t, ck, tc.packed, tc.threshold, tc.toBF16)
		chunks := u.Chunks
		meta := writeMeta(t, "/nonexistent", u)
		out, err := exec.Command(py, script, "--plan-only", "--meta", meta).CombinedOutput()
		if err != nil {
			t.Fatalf("receiver.py --plan-only: %v\n%s", err, out)
		}
		var plan struct {
			Chunks [][]string
			Bytes  []int64
		}
		line := strings.TrimSpace(string(out))
		if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "PLAN ")), &plan); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		if len(plan.Chunks) != len(chunks) {
			t.Fatalf("%+v: receiver plans %d broadcasts, we send %d", tc, len(plan.Chunks), len(chunks))
		}
		for k, c := range chunks {
			if plan.Bytes[k] != c.Bytes || len(plan.Chunks[k]) != len(c.Pieces) || plan.Chunks[k][0] != c.Pieces[0].Src.Name {
				t.Fatalf("%+v: chunk %d: receiver %v (%d bytes), we %s (%d bytes)", tc, k, plan.Chunks[k], plan.Bytes[k], firstName(c), c.Bytes)
			}
		}
	}
}

// The process helpers of the GPU tests, with a stand-in script.
func TestProcessHarness(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not on PATH: this test runs the GPU tests' Python scripts (tests/gpu); .ci/run installs it")
	}
	t.Setenv("RLFLOW_GPU_LOGS", t.TempDir())
	script := filepath.Join(t.TempDir(), "fake.py")
	os.WriteFile(script, []byte(`import os, sys, time, json
print("READY {}", flush=True)
print("PROGRESS " + json.dumps({"index": 1, "hostid": os.environ["NCCL_HOSTID"]}), flush=True)
if sys.argv[1] == "hang":
    time.sleep(60)
print("RESULT " + json.dumps({"verdict": "PASS", "bytes": 42}), flush=True)
`), 0o644)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p := launch(t, "ok", "host-a", script, "ok")
	if _, err := p.waitFor(ctx, "READY"); err != nil {
		t.Fatal(err)
	}
	l, err := p.waitFor(ctx, "PROGRESS")
	if err != nil || !strings.Contains(l, "host-a") {
		t.Fatalf("%q %v", l, err)
	}
	r, err := p.finish(ctx)
	if err != nil || r["verdict"] != "PASS" || num(r, "bytes") != 42 {
		t.Fatalf("%v %v", r, err)
	}
	h := launch(t, "hang", "host-b", script, "hang")
	if _, err := h.waitFor(ctx, "PROGRESS"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	h.kill()
	if _, err := h.finish(ctx); err == nil || time.Since(start) > 5*time.Second {
		t.Fatalf("killed process: %v after %v", err, time.Since(start))
	}
}

// A process launched again under the same name in one test (the raw
// benchmark's rounds) must not overwrite the log of the first.
func TestLaunchEnvKeepsEveryLog(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not on PATH: this test runs the GPU tests' process launcher; .ci/run installs it")
	}
	t.Setenv("RLFLOW_PYTHON", "python3")
	dir := t.TempDir()
	t.Setenv("RLFLOW_GPU_LOGS", dir)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i, word := range []string{"first", "second", "third"} {
		p := launchEnv(t, "twin", nil, "-c", `print('RESULT {"round": "`+word+`"}')`)
		r, err := p.finish(ctx)
		if err != nil || r["round"] != word {
			t.Fatalf("launch %d: %v %v", i+1, r, err)
		}
	}
	base := filepath.Join(dir, "TestLaunchEnvKeepsEveryLog.twin")
	for _, tc := range []struct{ path, want string }{
		{base + ".log", "first"},
		{base + ".2.log", "second"},
		{base + ".3.log", "third"},
	} {
		b, err := os.ReadFile(tc.path)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), tc.want) {
			t.Fatalf("%s: %q, want the %s launch's output", tc.path, b, tc.want)
		}
	}
}
