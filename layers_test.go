package rlflow_test

import (
	"encoding/json"
	"io"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"testing"
)

const module = "github.com/rlflow/rlflow/"

// layers places every package of the module that is not test-only, lowest
// first. A package may import only packages of lower layers: data flows
// one way, cmd -> worker -> {workflows, activities} -> {transfer, vllm,
// pipelines, nccl...}. A new package must be placed here (the test fails
// until it is), which is where its place in the design is decided.
var layers = [][]string{
	// Foundations: file formats, the C bindings and the NCCL wire formats,
	// the vLLM client, GPU health, a command's processes, secret masking,
	// payload encryption; the tests' golden-file check. They import nothing
	// of the module.
	{"safetensors", "nccl", "nccl/ncclid", "nccl/tcpstore", "vllm", "gpuhealth", "procs", "redact", "codec", "internal/goldenfile"},
	// The pipeline spec and step registry (whose server-call defaults are
	// the vLLM client's), NCCL's planner and test double, CUDA IPC import
	// (over nccl's CUDA runtime), the double's model, the resident
	// trainer's protocol and supervisor (over procs).
	{"pipelines", "nccl/plan", "nccl/nccltest", "nccl/cudaipc", "gpuhealth/gpuhealthtest", "vllm/double/bigram", "trainer"},
	// The interpreter, the weight-transfer contract with the disk and ipc
	// backends, the staging pipeline, the vLLM double and its trainer, the
	// workers' metrics (which the activities record into), the resident
	// trainer's test double.
	{"workflows", "transfer", "nccl/staging", "vllm/double", "vllm/double/demotrain", "metrics", "trainer/trainertest"},
	// The activities, the NCCL engine (GPU workers only), run control, the
	// dev server, run reports.
	{"activities", "transfer/ncclengine", "runs", "devserver", "report", "vllm/double/fakeplane"},
	// The control worker.
	{"worker"},
	// The GPU worker, test support over everything.
	{"worker/gpuworker", "internal/testutil", "internal/testutil/tlstest"},
	{"internal/testutil/gputest"},
	// Flags and wiring.
	{"cmd/rlflow"},
	// The repository's own tests.
	{""},
}

type listedPackage struct {
	ImportPath string
	Imports    []string // non-test imports
	GoFiles    []string
	CgoFiles   []string
}

// goList runs `go list -json` with args and decodes its packages.
func goList(t *testing.T, args ...string) []listedPackage {
	t.Helper()
	out, err := exec.Command("go", append([]string{"list", "-json"}, args...)...).Output()
	if err != nil {
		t.Fatalf("go list %s: %v", strings.Join(args, " "), err)
	}
	var pkgs []listedPackage
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p listedPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs
}

func rel(path string) string {
	if path == strings.TrimSuffix(module, "/") {
		return ""
	}
	return strings.TrimPrefix(path, module)
}

// TestLayers checks the import rule over the non-test code: every package
// is placed in a layer, and every import of the module's packages points to
// a lower layer.
func TestLayers(t *testing.T) {
	layerOf := map[string]int{}
	for i, l := range layers {
		for _, p := range l {
			layerOf[p] = i
		}
	}
	for _, p := range goList(t, "./...") {
		name := rel(p.ImportPath)
		if len(p.GoFiles)+len(p.CgoFiles) == 0 {
			continue // test-only (e2e, bench)
		}
		mine, ok := layerOf[name]
		if !ok {
			t.Errorf("package %q has no layer: place it in layers", name)
			continue
		}
		for _, imp := range p.Imports {
			if !strings.HasPrefix(imp, module) {
				continue
			}
			dep := rel(imp)
			if theirs, ok := layerOf[dep]; ok && theirs >= mine {
				t.Errorf("%s (layer %d) imports %s (layer %d): imports must point to lower layers", name, mine, dep, theirs)
			}
		}
	}
}

// TestControlWorkerNeedsNoNCCL: the control worker (package worker and all
// it depends on) runs on any host, so nothing it links may be NCCL, the
// NCCL engine or GPU code.
func TestControlWorkerNeedsNoNCCL(t *testing.T) {
	var bad []string
	for _, p := range goList(t, "-deps", "./worker") {
		name := rel(p.ImportPath)
		if !strings.HasPrefix(p.ImportPath, module) {
			continue
		}
		if name == "nccl" || strings.HasPrefix(name, "nccl/") || strings.HasPrefix(name, "transfer/ncclengine") ||
			strings.HasPrefix(name, "gpuhealth") || strings.HasPrefix(name, "worker/gpuworker") {
			bad = append(bad, name)
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		t.Errorf("the control worker depends on %v", bad)
	}
}

// TestLayersTableIsCurrent: every package the table names exists, so the
// table cannot keep stale names after a move.
func TestLayersTableIsCurrent(t *testing.T) {
	var have []string
	for _, p := range goList(t, "./...") {
		have = append(have, rel(p.ImportPath))
	}
	for i, l := range layers {
		for _, p := range l {
			if !slices.Contains(have, p) {
				t.Errorf("layer %d names %q, which is not a package of the module", i, p)
			}
		}
	}
}
