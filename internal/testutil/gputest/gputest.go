// Package gputest is test support shared by the GPU tests (gpu,
// nccl/staging and e2e): loading the real NCCL and CUDA runtime or
// skipping, the device and integer settings from the environment, the
// greppable GPU-PASS/GPU-FAIL verdict lines, the process-log directory and
// the decoder-shaped checkpoints those tests generate. It is imported by
// _test.go files only and is not part of rlflow's API.
//
// Environment: RLFLOW_GPU_DEVICE (CUDA device of every rank in single
// placement, default 0), RLFLOW_GPU_PLACEMENT (single|spread, see Place),
// RLFLOW_GPU_LOGS (process logs; the default is the caller's), NCCL_HOSTID
// (set to rlflow-trainer by Lib when unset and no test of the process can
// be spread), NCCL_NVLS_ENABLE (set to 0 by Lib when unset and a test can
// be spread).
package gputest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

// EnvInt is the integer in the environment variable name, or def where it
// is unset or empty. A value that is not an integer fails the test: a knob
// mistyped must not quietly run the default.
func EnvInt(t testing.TB, name string, def int) int {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%s=%q: not an integer", name, s)
	}
	return v
}

// EnvIntAtLeast is EnvInt for a knob with a floor (a count of passes, a
// world size): a value below least fails the test instead of being raised
// to it quietly.
func EnvIntAtLeast(t testing.TB, name string, def, least int) int {
	t.Helper()
	v := EnvInt(t, name, def)
	if v < least {
		t.Fatalf("%s=%d: must be at least %d", name, v, least)
	}
	return v
}

// Device is the CUDA device of every rank: $RLFLOW_GPU_DEVICE, default 0.
func Device(t testing.TB) int { return EnvInt(t, "RLFLOW_GPU_DEVICE", 0) }

var once struct {
	sync.Once
	lib     *nccl.Library
	devices int
	err     error
}

// Lib loads the real libraries (once per test binary), checks that Device
// can be opened and that the CUDA runtime sees a device, or skips the test
// with "skipping GPU test: <reason>", and then, before anything initialises
// NCCL (which reads NCCL_HOSTID and NCCL_NVLS_ENABLE once), sets this
// process's NCCL environment for the placement (ProcessEnv): with one
// visible device or RLFLOW_GPU_PLACEMENT=single, NCCL_HOSTID=rlflow-trainer
// where unset (the trainer must look like another host than the receivers
// on the same GPU), exactly as before placements existed; otherwise
// NCCL_NVLS_ENABLE=0 where unset and no NCCL_HOSTID, so that ranks on
// different GPUs of this host use P2P/NVLink. Child processes inherit both.
func Lib(t testing.TB) *nccl.Library {
	t.Helper()
	once.Do(func() {
		lib, err := nccl.Load(nccl.Config{})
		if err != nil {
			once.err = err
			return
		}
		dev, err := nccl.OpenDevice(lib, Device(t))
		if err != nil {
			once.err = err
			return
		}
		defer dev.Close()
		once.err = dev.Do(context.Background(), func(api nccl.API) error {
			n, err := api.GetDeviceCount()
			if err == nil && n == 0 {
				err = errors.New("no CUDA device")
			}
			once.devices = n
			return err
		})
		if once.err != nil {
			return
		}
		for k, v := range ProcessEnv(os.Getenv(EnvPlacement), once.devices) {
			if os.Getenv(k) == "" {
				os.Setenv(k, v)
			}
		}
		once.lib = lib
	})
	if once.err != nil {
		t.Skipf("skipping GPU test: %v", once.err)
	}
	v, _ := once.lib.NCCLVersion()
	t.Logf("NCCL %d from %s, CUDA runtime %s, %d CUDA devices, NCCL_HOSTID=%s, NCCL_NVLS_ENABLE=%s",
		v, once.lib.NCCLPath(), once.lib.CUDARTPath(), once.devices, os.Getenv("NCCL_HOSTID"), os.Getenv("NCCL_NVLS_ENABLE"))
	return once.lib
}

// EnvPlacement selects how the ranks of a GPU test are laid out on the
// host's GPUs: "single" or "spread"; unset or "auto" chooses per test.
const EnvPlacement = "RLFLOW_GPU_PLACEMENT"

// Placement modes.
const (
	// Single: every rank on Device(), each process with its own
	// NCCL_HOSTID (rlflow-trainer, rlflow-worker<r>, ...) so that NCCL
	// treats them as separate hosts (socket transport).
	Single = "single"
	// Spread: rank r on device r, no NCCL_HOSTID, NCCL_NVLS_ENABLE=0:
	// the ranks talk P2P/NVLink as on a real multi-GPU node.
	Spread = "spread"
)

// Placement is where the ranks of one GPU test run.
type Placement struct {
	Mode    string // Single or Spread
	World   int    // ranks, the trainer's included
	Devices int    // CUDA devices visible to the test process
	Trainer int    // CUDA device of rank 0 (the Go trainer)
	single  int    // Single: the device of every rank
}

// Spread reports whether the ranks are on distinct devices.
func (p Placement) Spread() bool { return p.Mode == Spread }

// HostIDs reports whether every process needs its own NCCL_HOSTID (Single).
func (p Placement) HostIDs() bool { return p.Mode == Single }

// Device is the CUDA device of rank r: r in Spread, Device() in Single.
func (p Placement) Device(rank int) int {
	if p.Mode == Spread {
		return rank
	}
	return p.single
}

// ProcEnv is what a child process playing a rank adds to its environment:
// NCCL_HOSTID=hostID in Single, nothing in Spread (NCCL_NVLS_ENABLE=0 is
// inherited from this process, see Lib).
func (p Placement) ProcEnv(hostID string) []string {
	if p.HostIDs() {
		return []string{"NCCL_HOSTID=" + hostID}
	}
	return nil
}

func (p Placement) String() string {
	if p.Spread() {
		return fmt.Sprintf("placement spread: world %d over %d visible GPUs, rank r on GPU r (trainer GPU %d), no NCCL_HOSTID, NCCL_NVLS_ENABLE=%s",
			p.World, p.Devices, p.Trainer, os.Getenv("NCCL_NVLS_ENABLE"))
	}
	return fmt.Sprintf("placement single: world %d, every rank on GPU %d (%d visible), one NCCL_HOSTID per process (trainer NCCL_HOSTID=%s)",
		p.World, p.single, p.Devices, os.Getenv("NCCL_HOSTID"))
}

// Decide is the placement of world ranks for mode ($RLFLOW_GPU_PLACEMENT)
// on devices visible GPUs, single being the device of Single: "" or "auto"
// is Spread when devices >= world and Single otherwise; "spread" with
// fewer devices than ranks is an error, as is an unknown mode.
func Decide(mode string, devices, world, single int) (Placement, error) {
	p := Placement{World: world, Devices: devices, single: single}
	switch mode {
	case "", "auto":
		mode = Single
		if devices >= world {
			mode = Spread
		}
	case Single, Spread:
	default:
		return p, fmt.Errorf("%s=%q: want single, spread or auto", EnvPlacement, mode)
	}
	if mode == Spread && devices < world {
		return p, fmt.Errorf("%s=spread: world size %d needs %d GPUs, %d visible", EnvPlacement, world, world, devices)
	}
	p.Mode, p.Trainer = mode, single
	if mode == Spread {
		p.Trainer = 0
	}
	return p, nil
}

// ProcessEnv is the NCCL environment of the test process (and so, by
// inheritance, of every rank it starts) for mode on devices visible GPUs:
// where no test can be spread (one device, or mode single)
// NCCL_HOSTID=rlflow-trainer, as the single-GPU tests always had; otherwise
// NCCL_NVLS_ENABLE=0 and no NCCL_HOSTID. NCCL reads both once per process,
// so this is decided for the whole process, before the first test: a test
// that is placed Single on a multi-GPU host (more ranks than GPUs) then
// runs with a trainer that keeps its real host identity, still distinct
// from each receiver's rlflow-worker<r>.
func ProcessEnv(mode string, devices int) map[string]string {
	if mode == Single || devices < 2 || (mode != "" && mode != "auto" && mode != Spread) {
		return map[string]string{"NCCL_HOSTID": "rlflow-trainer"}
	}
	return map[string]string{"NCCL_NVLS_ENABLE": "0"}
}

// Place is the placement of a test with world ranks (Decide over
// $RLFLOW_GPU_PLACEMENT and the visible devices), logged. It loads the
// libraries (Lib) and skips where they are missing; it fails the test on
// an unknown mode and skips it where RLFLOW_GPU_PLACEMENT=spread asks for
// more GPUs than are visible.
func Place(t testing.TB, world int) Placement {
	t.Helper()
	Lib(t)
	mode := os.Getenv(EnvPlacement)
	p, err := Decide(mode, once.devices, world, Device(t))
	if err != nil {
		if mode == Spread {
			t.Skipf("skipping: %v", err)
		}
		t.Fatal(err)
	}
	t.Logf("%v", p)
	return p
}

// Verdict prints one greppable line per check, "GPU-PASS <test>: msg" or
// "GPU-FAIL <test>: msg", and fails the test (without stopping it) on a
// FAIL.
func Verdict(t testing.TB, ok bool, format string, args ...any) {
	t.Helper()
	word := "PASS"
	if !ok {
		word = "FAIL"
	}
	msg := fmt.Sprintf(format, args...)
	fmt.Printf("GPU-%s %s: %s\n", word, t.Name(), msg)
	if !ok {
		t.Error(msg)
	}
}

// LogDir is the directory for process logs, created if missing:
// $RLFLOW_GPU_LOGS, else def, else (def "") a new temporary directory
// rlflow-gpu-logs-*. The path is returned as given (not made absolute).
func LogDir(t testing.TB, def string) string {
	t.Helper()
	d := os.Getenv("RLFLOW_GPU_LOGS")
	if d == "" {
		d = def
	}
	if d == "" {
		var err error
		if d, err = os.MkdirTemp("", "rlflow-gpu-logs-"); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// Spec is one tensor of a generated checkpoint.
type Spec struct {
	Name  string
	DType safetensors.DType
	Shape []int64
}

// Elements is the number of elements of s (1 for a scalar).
func (s Spec) Elements() int64 {
	n := int64(1)
	for _, d := range s.Shape {
		n *= d
	}
	return n
}

// Bytes is the size of s's data.
func (s Spec) Bytes() int64 { return s.Elements() * int64(s.DType.ItemSize()) }

// DecoderSpecs is a bf16 decoder-shaped model with fused projections
// (embedding, layers of input_layernorm, qkv_proj, o_proj, gate_up_proj and
// down_proj, lm_head) plus, after the embedding, the awkward tensors the
// GPU tests check: 1, 3x5x7 and 65537 elements, a one-element f32, a zero-size
// tensor and int64. It has 8+5*layers tensors.
func DecoderSpecs(hidden, inter, vocab, layers int) []Spec {
	h, in, v := int64(hidden), int64(inter), int64(vocab)
	specs := []Spec{
		{"model.embed_tokens.weight", safetensors.BF16, []int64{v, h}},
		{"odd.one", safetensors.BF16, []int64{1}},
		{"odd.3x5x7", safetensors.BF16, []int64{3, 5, 7}},
		{"odd.f32x1", safetensors.F32, []int64{1}}, // not 0-dim: vLLM cannot unpack a packed 0-dim tensor
		{"odd.empty", safetensors.BF16, []int64{0, 16}},
		{"odd.i64", safetensors.I64, []int64{7}},
		{"odd.65537", safetensors.BF16, []int64{65537}},
	}
	for l := range layers {
		p := fmt.Sprintf("model.layers.%d.", l)
		specs = append(specs,
			Spec{p + "input_layernorm.weight", safetensors.BF16, []int64{h}},
			Spec{p + "self_attn.qkv_proj.weight", safetensors.BF16, []int64{3 * h, h}},
			Spec{p + "self_attn.o_proj.weight", safetensors.BF16, []int64{h, h}},
			Spec{p + "mlp.gate_up_proj.weight", safetensors.BF16, []int64{2 * in, h}},
			Spec{p + "mlp.down_proj.weight", safetensors.BF16, []int64{h, in}},
		)
	}
	return append(specs, Spec{"lm_head.weight", safetensors.BF16, []int64{v, h}})
}

// XorshiftFill fills data, the bytes of tensor index (0-based) of the
// checkpoint for seed, with xorshift64 words (little-endian) and its last
// len%8 bytes with byte(j)+byte(seed): every tensor and every seed differ.
func XorshiftFill(data []byte, seed uint64, index int) {
	x := seed*0x9e3779b97f4a7c15 + uint64(index+1)*0xbf58476d1ce4e5b9
	for j := 0; j+8 <= len(data); j += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(data[j:], x)
	}
	for j := len(data) &^ 7; j < len(data); j++ {
		data[j] = byte(j) + byte(seed)
	}
}

// Python is the interpreter of the GPU tests' Python scripts:
// $RLFLOW_PYTHON (the GPU host's torch environment), else python3.
func Python() string {
	if py := os.Getenv("RLFLOW_PYTHON"); py != "" {
		return py
	}
	return "python3"
}

// Script is the absolute path of one of the GPU tests' Python scripts in
// tests/gpu: $RLFLOW_GPU_SCRIPTS/name, else found in the repository
// (testutil.ModuleRoot). The test fails when it is not there.
func Script(t testing.TB, name string) string {
	t.Helper()
	if d := os.Getenv("RLFLOW_GPU_SCRIPTS"); d != "" {
		p, err := filepath.Abs(filepath.Join(d, name))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("RLFLOW_GPU_SCRIPTS=%s: %v", d, err)
		}
		return p
	}
	return testutil.RepoFile(t, filepath.Join("tests", "gpu", name))
}

// DigestMismatches counts the tensors of want (name -> SHA-256) that got
// does not hold with the same digest, and those got holds beyond want.
func DigestMismatches(got, want map[string]string) int {
	bad := 0
	for name, sum := range want {
		if got[name] != sum {
			bad++
		}
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			bad++
		}
	}
	return bad
}
