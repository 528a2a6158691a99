// Package gputest is test support shared by the GPU tests (gpu,
// nccl/staging and e2e): loading the real NCCL and CUDA runtime or
// skipping, the device and integer settings from the environment, the
// greppable GPU-PASS/GPU-FAIL verdict lines, the process-log directory and
// the decoder-shaped checkpoints those tests generate. It is imported by
// _test.go files only and is not part of rlflow's API.
//
// Environment: RLFLOW_GPU_DEVICE (CUDA device, default 0), RLFLOW_GPU_LOGS
// (process logs; the default is the caller's), NCCL_HOSTID (set to
// rlflow-trainer by Lib when unset).
package gputest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/nccl/safetensors"
)

// EnvInt is the integer in the environment variable name, or def where it
// is unset or not an integer.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// Device is the CUDA device of every rank: $RLFLOW_GPU_DEVICE, default 0.
func Device() int { return EnvInt("RLFLOW_GPU_DEVICE", 0) }

var once struct {
	sync.Once
	lib *nccl.Library
	err error
}

// Lib loads the real libraries (once per test binary) and checks that
// Device can be opened and that the CUDA runtime sees a device, or skips
// the test with "skipping GPU test: <reason>". Before loading it sets
// NCCL_HOSTID=rlflow-trainer in this process where unset: NCCL reads it
// when it first initialises, and the trainer must look like another host
// than the receivers on the same GPU.
func Lib(t testing.TB) *nccl.Library {
	t.Helper()
	once.Do(func() {
		if os.Getenv("NCCL_HOSTID") == "" {
			os.Setenv("NCCL_HOSTID", "rlflow-trainer")
		}
		lib, err := nccl.Load(nccl.Config{})
		if err != nil {
			once.err = err
			return
		}
		dev, err := nccl.OpenDevice(lib, Device())
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
			return err
		})
		once.lib = lib
	})
	if once.err != nil {
		t.Skipf("skipping GPU test: %v", once.err)
	}
	v, _ := once.lib.NCCLVersion()
	t.Logf("NCCL %d from %s, CUDA runtime %s, NCCL_HOSTID=%s", v, once.lib.NCCLPath(), once.lib.CUDARTPath(), os.Getenv("NCCL_HOSTID"))
	return once.lib
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

// FreePort is a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
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
// GPU tests check: 1, 3x5x7 and 65537 elements, an f32 scalar, a zero-size
// tensor and int64. It has 8+5*layers tensors.
func DecoderSpecs(hidden, inter, vocab, layers int) []Spec {
	h, in, v := int64(hidden), int64(inter), int64(vocab)
	specs := []Spec{
		{"model.embed_tokens.weight", safetensors.BF16, []int64{v, h}},
		{"odd.one", safetensors.BF16, []int64{1}},
		{"odd.3x5x7", safetensors.BF16, []int64{3, 5, 7}},
		{"odd.scalar", safetensors.F32, []int64{}},
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
