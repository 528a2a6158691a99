package ncclengine

// GPU tests of what vLLM's receiver can take (issue 17), beside
// gpu_test.go and with its conventions: real NCCL and CUDA through
// nccl.Load, rank 0 in this process, the vLLM server played by
// tests/gpu/receiver.py --http; they skip, naming what is missing, where
// NCCL or the CUDA runtime cannot be loaded or no GPU is visible.
// TestTorchUnpackRuleMatchesPlan needs only python3 with torch (no GPU)
// and skips without it. nccl/GPU.md has the command.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil/gputest"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/plan"
	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/safetensors"
	"github.com/rlflow/rlflow/transfer"
	"github.com/rlflow/rlflow/vllm"
)

// gpuCheckpoint writes tensors (filled by gputest.XorshiftFill) to a fresh
// file under the test's temporary directory.
func gpuCheckpoint(t *testing.T, name string, specs []gputest.Spec) string {
	t.Helper()
	wt := make([]safetensors.WriteTensor, len(specs))
	for i, s := range specs {
		data := make([]byte, s.Bytes())
		gputest.XorshiftFill(data, 17, i)
		wt[i] = safetensors.WriteTensor{Name: s.Name, DType: s.DType, Shape: s.Shape, Data: data}
	}
	path := filepath.Join(t.TempDir(), name)
	if err := safetensors.Write(path, wt, nil); err != nil {
		t.Fatal(err)
	}
	return path
}

// oneServer starts one receiver.py --http server (rank 1) and an engine on
// the real library for it; wt is the pipeline's weight_transfer.
func oneServer(ctx context.Context, t *testing.T, lib *nccl.Library, wt pipelines.WeightTransfer) (*Engine, transfer.Target, *httpReceiver) {
	t.Helper()
	pl := gputest.Place(t, 2)
	r := startReceiver(ctx, t, pl, 0)
	c, err := vllm.New(r.url, vllm.Options{Generation: vllm.GenD})
	if err != nil {
		t.Fatal(err)
	}
	wt.Backend = pipelines.BackendNCCL
	target := transfer.Target{RunID: "gpu-issue17", Fleet: vllm.Fleet{c}, Pins: []vllm.Generation{vllm.GenD}, Settings: wt}
	tr, err := New(Config{API: lib, Device: pl.Trainer, Advertise: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr, target, r
}

func gpuUpdate(ctx context.Context, tr *Engine, target transfer.Target, path, version string) (transfer.UpdateResult, error) {
	return tr.Update(ctx, transfer.UpdateRequest{Target: target, Checkpoint: path, DType: "keep", Version: version,
		InitTimeout: vllm.DefaultInitTimeout, Progress: &transfer.Progress{}})
}

// receiverState is the part of receiver.py's GET /received these tests read.
type receiverState struct {
	Updates     int  `json:"updates"`
	Calls       int  `json:"calls"` // update_weights that started receiving
	SessionOpen bool `json:"session_open"`
	Stats       struct {
		Packed     bool           `json:"packed"`
		VLLMUnpack bool           `json:"vllm_unpack"`
		NCCLTypes  map[string]int `json:"nccl_types"`
		Broadcasts int            `json:"broadcasts"`
	} `json:"stats"`
	Events []struct {
		What string `json:"what"`
	} `json:"events"`
}

func (r *httpReceiver) state(ctx context.Context) (receiverState, error) {
	var st receiverState
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.url+"/received", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

func (st receiverState) events() string {
	var w []string
	for _, e := range st.Events {
		w = append(w, e.What)
	}
	return strings.Join(w, ", ")
}

// TestGPUFP8NonPacked: float8_e4m3fn tensors (a matrix, an odd-sized 3-D
// one and a 0-dim one) beside bf16 and f32 ones, sent non-packed on the
// real NCCL: each fp8 broadcast is ncclFloat8e4m3 (10) with count = bytes,
// received by receiver.py into torch.float8_e4m3fn tensors with NCCL type
// 10 as a vLLM worker does, byte-exact (SHA-256 per tensor). With an NCCL
// older than 2.24 it checks the refusal instead.
func TestGPUFP8NonPacked(t *testing.T) {
	lib := gputest.Lib(t)
	version, err := lib.NCCLVersion()
	if err != nil {
		t.Fatal(err)
	}
	path := gpuCheckpoint(t, "fp8.safetensors", []gputest.Spec{
		{Name: "model.w", DType: safetensors.BF16, Shape: []int64{256, 1024}},
		{Name: "model.w.fp8", DType: safetensors.F8E4M3, Shape: []int64{1024, 1000}},
		{Name: "model.w.fp8.scale", DType: safetensors.F32, Shape: []int64{1024}},
		{Name: "odd.fp8.3x5x7", DType: safetensors.F8E4M3, Shape: []int64{3, 5, 7}},
		{Name: "odd.fp8.scalar", DType: safetensors.F8E4M3, Shape: []int64{}},
	})
	want := digests(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tr, target, r := oneServer(ctx, t, lib, pipelines.WeightTransfer{})

	out, err := gpuUpdate(ctx, tr, target, path, "fp8-1")
	if version < nccl.Float8MinVersion {
		ok := kindOf(err) == transfer.BadInput && strings.Contains(err.Error(), "the loaded NCCL "+nccl.VersionString(version)+" cannot broadcast 3 tensors non-packed")
		gputest.Verdict(t, ok, "NCCL %s has no fp8: fp8 non-packed refused before sending: %v", nccl.VersionString(version), err)
		return
	}
	if err != nil {
		gputest.Verdict(t, false, "fp8 non-packed on NCCL %s: %v", nccl.VersionString(version), err)
		return
	}
	gputest.Verdict(t, out.Tensors == 5 && out.Bytes == safetensorsBytes(t, path),
		"fp8 non-packed on NCCL %s: %d tensors, %d bytes in %v", nccl.VersionString(version), out.Tensors, out.Bytes, out.Elapsed)
	checkReceived(ctx, t, []*httpReceiver{r}, want, 1, "fp8 non-packed")
	st, err := r.state(ctx)
	if err != nil {
		t.Fatal(err)
	}
	types := st.Stats.NCCLTypes
	ok := !st.Stats.Packed && st.Stats.Broadcasts == 5 && types["model.w.fp8"] == 10 && types["odd.fp8.3x5x7"] == 10 &&
		types["odd.fp8.scalar"] == 10 && types["model.w"] == int(nccl.Bfloat16) && types["model.w.fp8.scale"] == int(nccl.Float32)
	gputest.Verdict(t, ok, "receiver's NCCL type per broadcast (float8_e4m3fn must be 10): %v", types)
}

func safetensorsBytes(t *testing.T, path string) int64 {
	t.Helper()
	ck, err := safetensors.OpenCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	return ck.TotalBytes()
}

// TestGPUPackedZeroDimRefused: a packed checkpoint with a 0-dim tensor is
// refused on the real stack with the clear error (BadInput, the tensor, the
// reason, packed: false) before any update session or broadcast: the
// receiver, which unpacks as vLLM does (RECEIVER_VLLM_UNPACK=1), saw no
// start_weight_update and no update_weights. The same group then carries
// the checkpoint with that tensor shaped [1] byte-exact through vLLM's
// unpacking.
func TestGPUPackedZeroDimRefused(t *testing.T) {
	lib := gputest.Lib(t)
	t.Setenv("RECEIVER_VLLM_UNPACK", "1") // inherited by receiver.py
	specs := func(step []int64) []gputest.Spec {
		return []gputest.Spec{
			{Name: "model.w", DType: safetensors.BF16, Shape: []int64{1024, 1024}},
			{Name: "model.step", DType: safetensors.I64, Shape: step},
			{Name: "model.norm", DType: safetensors.F32, Shape: []int64{1024}},
			{Name: "model.empty", DType: safetensors.BF16, Shape: []int64{0, 16}},
			{Name: "model.head", DType: safetensors.BF16, Shape: []int64{512, 1024}},
		}
	}
	bad := gpuCheckpoint(t, "zero-dim.safetensors", specs([]int64{}))
	good := gpuCheckpoint(t, "one-dim.safetensors", specs([]int64{1}))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tr, target, r := oneServer(ctx, t, lib, pipelines.WeightTransfer{Packed: true, BufferBytes: 1 << 20})

	start := time.Now()
	_, err := gpuUpdate(ctx, tr, target, bad, "zero-dim")
	ok := kindOf(err) == transfer.BadInput && strings.Contains(err.Error(), "nothing sent") &&
		strings.Contains(err.Error(), `"model.step" (shape [], int64, offset 0 in chunk 1): it is 0-dim`) &&
		strings.Contains(err.Error(), "set weight_transfer.packed to false")
	gputest.Verdict(t, ok, "packed checkpoint with a 0-dim tensor refused in %.2fs: %v", time.Since(start).Seconds(), err)
	st, err := r.state(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sent := st.Calls != 0 || st.Updates != 0 || st.SessionOpen || strings.Contains(st.events(), "start")
	gputest.Verdict(t, !sent, "nothing reached the receiver: %d update_weights, %d updates, session open %v, events [%s]",
		st.Calls, st.Updates, st.SessionOpen, st.events())

	out, err := gpuUpdate(ctx, tr, target, good, "one-dim")
	if err != nil {
		gputest.Verdict(t, false, "the receivable checkpoint after the refusal: %v", err)
		return
	}
	gputest.Verdict(t, out.Tensors == 5, "the receivable checkpoint after the refusal: %d tensors, %d bytes", out.Tensors, out.Bytes)
	checkReceived(ctx, t, []*httpReceiver{r}, digests(t, good), 1, "packed through vLLM's unpacking")
	st, err = r.state(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gputest.Verdict(t, st.Stats.Packed && st.Stats.VLLMUnpack, "the receiver unpacked as vLLM does: packed %v, vllm_unpack %v", st.Stats.Packed, st.Stats.VLLMUnpack)
}

// TestTorchUnpackRuleMatchesPlan checks plan.CheckPackedReceivable against
// torch itself: every dtype x byte offset x shape (0-dim, zero-size,
// 1-D, 2-D) is packed after a uint8 pad of that offset and viewed as vLLM's
// packed consumer does (receiver.py --unpack-check, on the CPU); the tensors
// torch refuses must be exactly those the plan refuses.
func TestTorchUnpackRuleMatchesPlan(t *testing.T) {
	py := gputest.Python()
	if out, err := exec.Command(py, "-c", "import torch").CombinedOutput(); err != nil {
		t.Skipf("skipping: %s cannot import torch (%v: %s); this check views packed layouts with torch as vLLM does", py, err, bytes.TrimSpace(out))
	}
	type unpackCase struct {
		Names  []string  `json:"names"`
		DTypes []string  `json:"dtype_names"`
		Shapes [][]int64 `json:"shapes"`
	}
	dtypes := []string{"uint8", "int8", "bool", "float8_e4m3fn", "bfloat16", "float16", "int32", "float32", "int64", "float64"}
	shapes := [][]int64{{}, {0, 4}, {3}, {2, 1}}
	var cases []unpackCase
	var tensors [][]plan.Tensor
	for _, d := range dtypes {
		for _, off := range []int64{0, 1, 2, 3, 4, 6} {
			for _, sh := range shapes {
				var ts []plan.Tensor
				if off > 0 {
					ts = append(ts, tensorOf("pad", "uint8", []int64{off}))
				}
				ts = append(ts, tensorOf("x", d, sh))
				c := unpackCase{}
				for _, x := range ts {
					c.Names, c.DTypes, c.Shapes = append(c.Names, x.Name), append(c.DTypes, x.DType), append(c.Shapes, append([]int64{}, x.Shape...))
				}
				cases, tensors = append(cases, c), append(tensors, ts)
			}
		}
	}
	file := filepath.Join(t.TempDir(), "cases.json")
	raw, _ := json.Marshal(map[string]any{"cases": cases})
	if err := os.WriteFile(file, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, gputest.Script(t, "receiver.py"), "--unpack-check", file)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.Output()
	if err != nil {
		t.Fatalf("receiver.py --unpack-check: %v\n%s", err, stderr.String())
	}
	var got struct {
		Torch   string `json:"torch"`
		Results []struct {
			Refused map[string]string `json:"refused"`
			Missing []string          `json:"missing_dtypes"`
		} `json:"results"`
	}
	sc := bufio.NewScanner(bytes.NewReader(stdout))
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "UNPACK "); ok {
			if err := json.Unmarshal([]byte(rest), &got); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(got.Results) != len(cases) {
		t.Fatalf("receiver.py answered %d cases of %d:\n%s", len(got.Results), len(cases), stdout)
	}
	mismatches, refused, checked := 0, 0, 0
	missing := map[string]bool{}
	for i, ts := range tensors {
		if m := got.Results[i].Missing; len(m) > 0 {
			for _, d := range m {
				missing[d] = true
			}
			continue
		}
		checked++
		if err := plan.Validate(ts); err != nil {
			t.Fatal(err)
		}
		var planSays []string
		if err := plan.CheckPackedReceivable(ts, plan.Packed(ts, 1<<30)); err != nil {
			for _, x := range ts {
				if strings.Contains(err.Error(), fmt.Sprintf("%q (", x.Name)) {
					planSays = append(planSays, x.Name)
				}
			}
		}
		var torchSays []string
		for name := range got.Results[i].Refused {
			torchSays = append(torchSays, name)
		}
		sort.Strings(torchSays)
		refused += len(torchSays)
		if strings.Join(planSays, ",") != strings.Join(torchSays, ",") {
			mismatches++
			x, off := ts[len(ts)-1], int64(0)
			if len(ts) == 2 {
				off = ts[0].Size
			}
			t.Errorf("%s %v at offset %d: plan refuses %v, torch %s refuses %v %v", x.DType, x.Shape, off, planSays, got.Torch, torchSays, got.Results[i].Refused)
		}
	}
	if len(missing) > 0 {
		t.Logf("torch %s lacks %v: %d layouts not checked", got.Torch, slices.Sorted(maps.Keys(missing)), len(cases)-checked)
	}
	gputest.Verdict(t, mismatches == 0 && checked > 0, "torch %s and plan.CheckPackedReceivable agree on %d of %d packed layouts checked (%d tensors refused by torch)",
		got.Torch, checked-mismatches, checked, refused)
}

// tensorOf is a plan.Tensor of prod(shape) * itemsize bytes.
func tensorOf(name, dtype string, shape []int64) plan.Tensor {
	d, _ := safetensors.DTypeFromTorch(dtype)
	size := int64(d.ItemSize())
	for _, n := range shape {
		size *= n
	}
	return plan.Tensor{Name: name, DType: dtype, Shape: shape, Size: size}
}
