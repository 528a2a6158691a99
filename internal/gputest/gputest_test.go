package gputest

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"github.com/rlflow/rlflow/nccl/safetensors"
)

func TestDecoderSpecs(t *testing.T) {
	for _, c := range []struct {
		hidden, inter, vocab, layers int
		tensors                      int
		bytes                        int64
	}{
		{1024, 2816, 32000, 12, 68, 439509266},  // gpu: TestGPUTransferToHTTPReceivers
		{2048, 5632, 32000, 10, 58, 1289920786}, // e2e: the GPU-host recovery test, 1.29 GB
	} {
		specs := DecoderSpecs(c.hidden, c.inter, c.vocab, c.layers)
		var total int64
		seen := map[string]bool{}
		for _, s := range specs {
			if seen[s.Name] {
				t.Errorf("%s twice", s.Name)
			}
			seen[s.Name] = true
			total += s.Bytes()
		}
		if len(specs) != c.tensors || total != c.bytes {
			t.Errorf("DecoderSpecs(%d, %d, %d, %d): %d tensors, %d bytes; want %d, %d",
				c.hidden, c.inter, c.vocab, c.layers, len(specs), total, c.tensors, c.bytes)
		}
		first, last := specs[0], specs[len(specs)-1]
		if first.Name != "model.embed_tokens.weight" || last.Name != "lm_head.weight" || specs[3].Name != "odd.scalar" ||
			specs[3].DType != safetensors.F32 || specs[3].Elements() != 1 || specs[4].Elements() != 0 {
			t.Errorf("unexpected layout: %+v ... %+v", specs[:7], last)
		}
	}
}

func TestXorshiftFill(t *testing.T) {
	// Golden digests: the bytes of the generated checkpoints must not move
	// (receivers' results and cached checkpoints are compared by them).
	for _, c := range []struct {
		n     int
		seed  uint64
		index int
		want  string
	}{
		{0, 1, 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
		{13, 1, 0, "4eb9ccb34d0032a9354e32c75f526bf8d672afcef755c573ee79835e027e620f"},
		{65537 * 2, 101, 6, "aa0081e35e783b74b9d23e0676bf38aff8f226b26164cfa790f1ad80c9297df5"},
	} {
		b := make([]byte, c.n)
		XorshiftFill(b, c.seed, c.index)
		sum := sha256.Sum256(b)
		got := hex.EncodeToString(sum[:])
		t.Logf("n %d seed %d index %d: %s", c.n, c.seed, c.index, got)
		if got != c.want {
			t.Errorf("n %d seed %d index %d: sha256 %s, want %s", c.n, c.seed, c.index, got, c.want)
		}
	}
	// The last len%8 bytes are byte(j)+byte(seed).
	b := make([]byte, 11)
	XorshiftFill(b, 44, 2)
	for j := 8; j < 11; j++ {
		if b[j] != byte(j)+44 {
			t.Errorf("byte %d = %d", j, b[j])
		}
	}
}

func TestEnvIntAndDevice(t *testing.T) {
	t.Setenv("RLFLOW_GPU_DEVICE", "")
	if Device() != 0 {
		t.Errorf("Device() = %d with RLFLOW_GPU_DEVICE unset", Device())
	}
	t.Setenv("RLFLOW_GPU_DEVICE", "3")
	if Device() != 3 {
		t.Errorf("Device() = %d, want 3", Device())
	}
	t.Setenv("RLFLOW_TEST_INT", "x")
	if EnvInt("RLFLOW_TEST_INT", 7) != 7 {
		t.Error("EnvInt of a non-integer is not the default")
	}
}

func TestLogDir(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("RLFLOW_GPU_LOGS", "")
	def := filepath.Join(dir, "gpu-logs")
	if d := LogDir(t, def); d != def {
		t.Errorf("LogDir = %s, want %s", d, def)
	}
	tmp := LogDir(t, "")
	defer os.RemoveAll(tmp)
	if tmp == "" || tmp == def {
		t.Errorf("LogDir with no default = %q", tmp)
	}
	env := filepath.Join(dir, "env")
	t.Setenv("RLFLOW_GPU_LOGS", env)
	if d := LogDir(t, def); d != env {
		t.Errorf("LogDir = %s, want $RLFLOW_GPU_LOGS %s", d, env)
	}
	for _, d := range []string{def, tmp, env} {
		if st, err := os.Stat(d); err != nil || !st.IsDir() {
			t.Errorf("%s not created: %v", d, err)
		}
	}
}
