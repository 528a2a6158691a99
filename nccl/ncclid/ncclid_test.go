package ncclid

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/testutil"
)

// goldenHex is CPython's pickle.dumps(ncclUniqueId, protocol=4) of the id
// whose byte i is (37*i + 5) % 256 (checked with Python 3.11; the layout of
// the spec's section 4).
const goldenHex = "800495ec00000000000000" + // PROTO, FRAME
	"8c075f637479706573948c095f756e7069636b6c65949394" + // _ctypes _unpickle STACK_GLOBAL
	"8c34766c6c6d2e64697374726962757465642e6465766963655f636f6d6d756e696361746f72732e70796e63636c5f7772617070657294" + // module
	"8c0c6e63636c556e6971756549649493947d944380" + // class, {}, SHORT_BINBYTES 128
	"052a4f7499bee3082d52779cc1e60b30557a9fc4e90e33587da2c7ec11365b80a5caef14395e83a8cdf2173c6186abd0f51a3f6489aed3f81d42678cb1d6fb20456a8fb4d9fe23486d92b7dc01264b7095badf04294e7398bde2072c51769bc0e50a2f54799ec3e80d32577ca1c6eb10355a7fa4c9ee13385d82a7ccf1163b60" + // the id
	"948694869452942e" // TUPLE2, TUPLE2, REDUCE, STOP

func goldenID() ID {
	var id ID
	for i := range id {
		id[i] = byte((37*i + 5) % 256)
	}
	return id
}

func TestPickleGolden(t *testing.T) {
	want, err := hex.DecodeString(goldenHex)
	if err != nil {
		t.Fatal(err)
	}
	got := Pickle(goldenID())
	if !bytes.Equal(got, want) {
		t.Fatalf("Pickle =\n%x\nwant\n%x", got, want)
	}
	if len(got) != 247 {
		t.Fatalf("len = %d", len(got))
	}
	// The spec's offsets.
	for _, c := range []struct {
		off  int
		want []byte
	}{
		{0, []byte{0x80, 0x04}},
		{2, []byte{0x95, 236, 0, 0, 0, 0, 0, 0, 0}},
		{11, append(append([]byte{0x8c, 7}, "_ctypes"...), 0x94, 0x8c, 9)},
		{35, append([]byte{0x8c, 0x34}, ModulePath...)},
		{89, []byte{0x94, 0x8c, 0x0c}},
		{107, []byte{0x7d, 0x94, 0x43, 0x80}},
		{239, []byte{0x94, 0x86, 0x94, 0x86, 0x94, 0x52, 0x94, 0x2e}},
	} {
		if !bytes.Equal(got[c.off:c.off+len(c.want)], c.want) {
			t.Errorf("offset %d: %x, want %x", c.off, got[c.off:c.off+len(c.want)], c.want)
		}
	}
	id, err := Unpickle(want)
	if err != nil || id != goldenID() {
		t.Fatalf("Unpickle(golden) = %x, %v", id, err)
	}
	p5 := bytes.Clone(want)
	p5[1] = 5
	if id, err := Unpickle(p5); err != nil || id != goldenID() {
		t.Fatalf("Unpickle(protocol 5) = %v", err)
	}
}

func TestUnpickleErrors(t *testing.T) {
	good := Pickle(goldenID())
	mut := func(off int, v byte) []byte {
		b := bytes.Clone(good)
		b[off] = v
		return b
	}
	tests := []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, "truncated at offset 0"},
		{"protocol-3", mut(1, 3), "offset 1: pickle protocol 3, want 4 or 5"},
		{"not-proto", mut(0, 0x28), "offset 0: byte 0x28, want 0x80 (PROTO)"},
		{"frame-length", mut(3, 0xed), "offset 3"},
		{"module-name", mut(40, 'X'), "offset 40: byte 0x58, want 0x6d (module " + ModulePath + ")"},
		{"class-name", mut(95, 'x'), "offset 95"},
		{"bytes-opcode", mut(109, 0x42), "offset 109"},
		{"suffix", mut(244, 0x00), "offset 244"},
		{"stop", mut(246, 0x00), "offset 246"},
		{"truncated-id", good[:150], "truncated at offset 150"},
		{"truncated-suffix", good[:243], "truncated at offset 243"},
		{"trailing", append(bytes.Clone(good), 0), "offset 247: 1 trailing bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Unpickle(tc.in)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
	// Every single-byte change outside the id and the protocol byte is rejected.
	for off := range good {
		if off == 1 || (off >= 111 && off < 111+Size) {
			continue
		}
		if _, err := Unpickle(mut(off, good[off]^0x01)); err == nil {
			t.Fatalf("offset %d: flipped byte accepted", off)
		}
	}
}

func TestBackendsLayout(t *testing.T) {
	b, err := PickleIn(goldenID(), BackendsModulePath)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 256 || len(BackendsModulePath) != 61 {
		t.Fatalf("backends pickle is %d bytes (module %d), want 256 (61)", len(b), len(BackendsModulePath))
	}
	if got := binary.LittleEndian.Uint64(b[3:11]); got != 245 {
		t.Fatalf("frame length %d, want 245", got)
	}
	id, mod, err := UnpickleModule(b)
	if err != nil || id != goldenID() || mod != BackendsModulePath {
		t.Fatalf("UnpickleModule = %q, %v", mod, err)
	}
	if _, mod, _ := UnpickleModule(Pickle(goldenID())); mod != ModulePath {
		t.Fatalf("legacy module = %q", mod)
	}
	if _, err := PickleIn(goldenID(), "vllm.pynccl_wrapper"); err == nil || !strings.Contains(err.Error(), "not where vLLM keeps") {
		t.Fatalf("unknown module: %v", err)
	}
	// Every single-byte change outside the id and the protocol byte is rejected.
	for off := range b {
		if off == 1 || (off >= 120 && off < 120+Size) {
			continue
		}
		m := bytes.Clone(b)
		m[off] ^= 0x01
		if _, err := Unpickle(m); err == nil {
			t.Fatalf("offset %d: flipped byte accepted", off)
		}
	}
}

func TestRoundTripRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for range 1000 {
		var id ID
		for i := range id {
			id[i] = byte(r.Uint32())
		}
		got, err := Unpickle(Pickle(id))
		if err != nil || got != id {
			t.Fatalf("pickle round trip: %v", err)
		}
		got, err = DecodeB64(EncodeB64(id))
		if err != nil || got != id {
			t.Fatalf("b64 round trip: %v", err)
		}
	}
}

func TestB64(t *testing.T) {
	var id ID
	for i := range id {
		id[i] = byte(i)
	}
	s := EncodeB64(id)
	if !strings.HasPrefix(s, "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8g") || !strings.HasSuffix(s, "fn8=") || len(s) != 172 {
		t.Errorf("EncodeB64 = %s", s)
	}
	for _, bad := range []string{"", "AAEC", s[:170], s + "AA==", strings.Replace(s, "A", "-", 1), s[:171] + "x"} {
		if _, err := DecodeB64(bad); err == nil {
			t.Errorf("DecodeB64(%q) accepted", bad)
		}
	}
}

func python(t *testing.T) string {
	t.Helper()
	py := os.Getenv("RLFLOW_PYTHON")
	if py == "" {
		py = "python3"
	}
	path, err := exec.LookPath(py)
	if err != nil {
		t.Skipf("skipping the CPython cross-check: %s not found (set RLFLOW_PYTHON)", py)
	}
	if out, err := exec.Command(path, "-c", "import ctypes, pickle").CombinedOutput(); err != nil {
		t.Skipf("skipping the CPython cross-check: %s cannot import ctypes: %v: %s", path, err, out)
	}
	return path
}

// TestCPython checks the pickle byte for byte against the real CPython
// pickle module, both directions.
func TestCPython(t *testing.T) {
	py := python(t)
	script := testutil.RepoFile(t, "tests/gpu/check_pickle.py")
	for _, module := range Modules {
		t.Run(module, func(t *testing.T) { checkCPython(t, py, script, module) })
	}
}

func checkCPython(t *testing.T, py, script, module string) {
	pickleOf := func(id ID) []byte {
		b, err := PickleIn(id, module)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(py, append([]string{script}, args...)...)
		cmd.Env = append(os.Environ(), "CHECK_PICKLE_MODULE="+module)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("check_pickle.py %s: %v\n%s", args[0], err, out)
		}
		return strings.TrimSpace(string(out))
	}
	r := rand.New(rand.NewPCG(9, 10))
	ids := []ID{goldenID(), {}}
	var ff ID
	for i := range ff {
		ff[i] = 0xff
	}
	ids = append(ids, ff)
	for range 3 {
		var id ID
		for i := range id {
			id[i] = byte(r.Uint32())
		}
		ids = append(ids, id)
	}
	for _, id := range ids {
		idHex := hex.EncodeToString(id[:])
		// (a) Python loads what Go pickled.
		if out := run("loads", hex.EncodeToString(pickleOf(id)), idHex); !strings.HasPrefix(out, "PASS") {
			t.Fatalf("loads: %s", out)
		}
		// (b) Go reads, byte for byte, what Python pickled.
		for _, proto := range []string{"4", "5"} {
			pyHex := run("dumps", idHex, proto)
			blob, err := hex.DecodeString(pyHex)
			if err != nil {
				t.Fatalf("dumps output %q: %v", pyHex, err)
			}
			got, mod, err := UnpickleModule(blob)
			if err != nil || got != id || mod != module {
				t.Fatalf("UnpickleModule(python protocol %s) = %q, %v", proto, mod, err)
			}
			want := pickleOf(id)
			want[1] = blob[1]
			if !bytes.Equal(blob, want) {
				t.Fatalf("python protocol %s pickle differs:\n py %x\n go %x", proto, blob, want)
			}
		}
	}
	if out := run("selftest"); !strings.HasSuffix(out, "PASS") {
		t.Fatalf("selftest: %s", out)
	}
}
