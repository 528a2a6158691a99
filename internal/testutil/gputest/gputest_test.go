package gputest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/safetensors"
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
		if first.Name != "model.embed_tokens.weight" || last.Name != "lm_head.weight" || specs[3].Name != "odd.f32x1" ||
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
	if Device(t) != 0 {
		t.Errorf("Device(t) = %d with RLFLOW_GPU_DEVICE unset", Device(t))
	}
	t.Setenv("RLFLOW_GPU_DEVICE", "3")
	if Device(t) != 3 {
		t.Errorf("Device(t) = %d, want 3", Device(t))
	}
	t.Setenv("RLFLOW_TEST_INT", "")
	if v := EnvInt(t, "RLFLOW_TEST_INT", 7); v != 7 {
		t.Errorf("EnvInt of an empty value = %d, want the default 7", v)
	}
	t.Setenv("RLFLOW_TEST_INT", "12")
	if v := EnvInt(t, "RLFLOW_TEST_INT", 7); v != 12 {
		t.Errorf("EnvInt = %d, want 12", v)
	}
	t.Setenv("RLFLOW_TEST_INT", "x")
	rec := &fatalRecorder{TB: t}
	EnvInt(rec, "RLFLOW_TEST_INT", 7)
	if want := `RLFLOW_TEST_INT="x": not an integer`; rec.msg != want {
		t.Errorf("EnvInt of a non-integer failed with %q, want %q", rec.msg, want)
	}
}

func TestEnvIntAtLeast(t *testing.T) {
	for _, tc := range []struct {
		value string
		want  int
		fatal string
	}{
		{"", 2, ""},
		{"2", 2, ""},
		{"5", 5, ""},
		{"1", 0, `RLFLOW_TEST_WORLD=1: must be at least 2`},
		{"-3", 0, `RLFLOW_TEST_WORLD=-3: must be at least 2`},
		{"two", 0, `RLFLOW_TEST_WORLD="two": not an integer`},
	} {
		t.Run("value="+tc.value, func(t *testing.T) {
			t.Setenv("RLFLOW_TEST_WORLD", tc.value)
			rec := &fatalRecorder{TB: t}
			v := EnvIntAtLeast(rec, "RLFLOW_TEST_WORLD", 2, 2)
			if rec.msg != tc.fatal {
				t.Fatalf("failed with %q, want %q", rec.msg, tc.fatal)
			}
			if tc.fatal == "" && v != tc.want {
				t.Fatalf("= %d, want %d", v, tc.want)
			}
		})
	}
}

// fatalRecorder records Fatalf instead of ending the test. It keeps the
// first message: a real Fatalf would have stopped there.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	if r.msg == "" {
		r.msg = fmt.Sprintf(format, args...)
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

func TestDecide(t *testing.T) {
	for _, c := range []struct {
		mode           string
		devices, world int
		single         int // RLFLOW_GPU_DEVICE
		want           string
		trainer        int
		ranks          []int // devices of ranks 1..
		err            bool
	}{
		// One GPU (the H200 of today's runs): always single, on Device(t).
		{"", 1, 2, 0, Single, 0, []int{0}, false},
		{"", 1, 3, 0, Single, 0, []int{0, 0}, false},
		{"auto", 1, 2, 0, Single, 0, []int{0}, false},
		{"single", 1, 2, 0, Single, 0, []int{0}, false},
		{"", 1, 2, 5, Single, 5, []int{5}, false},
		{"spread", 1, 2, 0, "", 0, nil, true},
		// Two GPUs: spread for world 2, single (on Device(t)) for world 3.
		{"", 2, 2, 0, Spread, 0, []int{1}, false},
		{"", 2, 3, 1, Single, 1, []int{1, 1}, false},
		{"spread", 2, 2, 1, Spread, 0, []int{1}, false},
		{"spread", 2, 3, 0, "", 0, nil, true},
		{"single", 2, 2, 1, Single, 1, []int{1}, false},
		// Four and eight GPUs.
		{"", 4, 4, 0, Spread, 0, []int{1, 2, 3}, false},
		{"", 4, 5, 0, Single, 0, []int{0, 0, 0, 0}, false},
		{"", 8, 3, 0, Spread, 0, []int{1, 2}, false},
		{"", 8, 8, 3, Spread, 0, []int{1, 2, 3, 4, 5, 6, 7}, false},
		{"single", 8, 8, 3, Single, 3, []int{3, 3, 3, 3, 3, 3, 3}, false},
		{"spread", 8, 9, 0, "", 0, nil, true},
		// Unknown mode.
		{"both", 8, 2, 0, "", 0, nil, true},
	} {
		name := fmt.Sprintf("mode=%q devices=%d world=%d device=%d", c.mode, c.devices, c.world, c.single)
		p, err := Decide(c.mode, c.devices, c.world, c.single)
		if c.err {
			if err == nil {
				t.Errorf("%s: no error, placement %v", name, p)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if p.Mode != c.want || p.Trainer != c.trainer || p.Device(0) != c.trainer || p.World != c.world || p.Devices != c.devices {
			t.Errorf("%s: %+v (device of rank 0 %d), want mode %s, trainer %d", name, p, p.Device(0), c.want, c.trainer)
		}
		var ranks []int
		for r := 1; r < c.world; r++ {
			ranks = append(ranks, p.Device(r))
		}
		if fmt.Sprint(ranks) != fmt.Sprint(c.ranks) {
			t.Errorf("%s: receiver devices %v, want %v", name, ranks, c.ranks)
		}
		env := p.ProcEnv("rlflow-worker1")
		if p.Spread() == p.HostIDs() || (p.HostIDs() && fmt.Sprint(env) != "[NCCL_HOSTID=rlflow-worker1]") || (p.Spread() && env != nil) {
			t.Errorf("%s: spread %v, host ids %v, ProcEnv %v", name, p.Spread(), p.HostIDs(), env)
		}
		if !strings.Contains(p.String(), "placement "+c.want) {
			t.Errorf("%s: String() = %q", name, p.String())
		}
	}
}

func TestProcessEnv(t *testing.T) {
	trainer := map[string]string{"NCCL_HOSTID": "rlflow-trainer"}
	nvls := map[string]string{"NCCL_NVLS_ENABLE": "0"}
	for _, c := range []struct {
		mode    string
		devices int
		want    map[string]string
	}{
		// One GPU: exactly the single-GPU tests' environment, whatever the mode.
		{"", 1, trainer}, {"auto", 1, trainer}, {"single", 1, trainer}, {"spread", 1, trainer},
		{"", 0, trainer},
		// Several GPUs: spread possible unless single is asked for.
		{"", 2, nvls}, {"auto", 4, nvls}, {"spread", 8, nvls},
		{"single", 2, trainer}, {"single", 8, trainer},
		{"bogus", 8, trainer},
	} {
		if got := ProcessEnv(c.mode, c.devices); fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("ProcessEnv(%q, %d) = %v, want %v", c.mode, c.devices, got, c.want)
		}
	}
}
