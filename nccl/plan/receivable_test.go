package plan

import (
	"fmt"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/nccl"
	"github.com/rlflow/rlflow/safetensors"
)

// tensor builds a Tensor whose size is prod(shape) * itemsize.
func tensor(name, dtype string, shape ...int64) Tensor {
	d, err := safetensors.DTypeFromTorch(dtype)
	if err != nil {
		panic(err)
	}
	size := int64(d.ItemSize())
	for _, n := range shape {
		size *= n
	}
	return Tensor{Name: name, DType: dtype, Shape: shape, Size: size}
}

func TestCheckPackedReceivable(t *testing.T) {
	const big = 1 << 30
	tests := []struct {
		name      string
		threshold int64
		ts        []Tensor
		want      []string // substrings of the error; none: accepted
		notWant   []string
	}{
		{name: "aligned-mix", threshold: big, ts: []Tensor{
			tensor("i", "int64", 2), tensor("w", "bfloat16", 4, 4), tensor("s", "float32", 1), tensor("m", "uint8", 3),
		}},
		{name: "zero-size-non-empty-shape-aligned", threshold: big, ts: []Tensor{
			tensor("a", "float32", 2), tensor("empty", "bfloat16", 0, 4), tensor("empty32", "float32", 4, 0), tensor("b", "float64", 1),
		}},
		{name: "one-byte-dtypes-anywhere", threshold: big, ts: []Tensor{
			tensor("m", "uint8", 3), tensor("q", "int8", 5), tensor("f8", "float8_e4m3fn", 7), tensor("b", "bool", 1), tensor("e5", "float8_e5m2", 3),
		}},
		{name: "offsets-restart-per-chunk", threshold: 2, ts: []Tensor{
			tensor("m", "uint8", 3), // 3 > T closes the chunk: "f" starts the next one at offset 0
			tensor("f", "float32", 2),
		}},
		{name: "0-dim", threshold: big, ts: []Tensor{tensor("w", "float32", 4), tensor("scale", "float32")},
			want:    []string{`vLLM cannot unpack 1 tensor of this packed transfer: "scale" (shape [], float32, offset 16 in chunk 0): it is 0-dim`, "set weight_transfer.packed to false"},
			notWant: []string{"item size"}},
		{name: "0-dim-uint8", threshold: big, ts: []Tensor{tensor("flag", "uint8")},
			want: []string{`"flag" (shape [], uint8, offset 0 in chunk 0): it is 0-dim`}},
		{name: "0-dim-shape-nil-or-empty", threshold: big, ts: []Tensor{{Name: "n", DType: "float32", Shape: nil, Size: 4}},
			want: []string{`"n" (shape [], float32`}},
		{name: "misaligned", threshold: big, ts: []Tensor{tensor("m", "uint8", 1), tensor("f", "float32", 2)},
			want:    []string{`"f" (shape [2], float32, offset 1 in chunk 0): its offset is not a multiple of its item size 4 (torch: storage_offset must be divisible by 4)`},
			notWant: []string{"0-dim", `"m"`}},
		{name: "misaligned-zero-size", threshold: big, ts: []Tensor{tensor("m", "uint8", 2), tensor("e", "float32", 0, 4)},
			want: []string{`"e" (shape [0 4], float32, offset 2 in chunk 0): its offset is not a multiple of its item size 4`}},
		{name: "misaligned-in-second-chunk", threshold: 4, ts: []Tensor{
			tensor("a", "float32", 2), // 8 > 4: chunk 0 is [a]
			tensor("m", "uint8", 3), tensor("h", "bfloat16", 1),
		}, want: []string{`"h" (shape [1], bfloat16, offset 3 in chunk 1)`, "item size 2"}},
		{name: "both-reasons", threshold: big, ts: []Tensor{tensor("m", "uint8", 2), tensor("step", "int64")},
			want: []string{`"step" (shape [], int64, offset 2 in chunk 0): it is 0-dim (vLLM's view(*shape) gets no sizes) and its offset is not a multiple of its item size 8`}},
		{name: "every-offender-listed", threshold: big, ts: []Tensor{
			tensor("s1", "float32"), tensor("m", "uint8", 1), tensor("f", "float32", 1), tensor("ok", "uint8", 3), tensor("s2", "int64"),
		}, want: []string{"3 tensors", `"s1"`, `"f"`, `"s2"`}, notWant: []string{`"ok"`, "more"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := Validate(tc.ts); err != nil {
				t.Fatal(err)
			}
			err := CheckPackedReceivable(tc.ts, Packed(tc.ts, tc.threshold))
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			for _, w := range tc.notWant {
				if strings.Contains(err.Error(), w) {
					t.Errorf("error %q has %q", err, w)
				}
			}
		})
	}
}

// TestCheckPackedReceivableMessage pins one whole message and the cap: the
// first ten offenders, then how many more.
func TestCheckPackedReceivableMessage(t *testing.T) {
	ts := []Tensor{tensor("m", "uint8", 1), tensor("w", "bfloat16", 2)}
	err := CheckPackedReceivable(ts, Packed(ts, 1<<30))
	want := `plan: vLLM cannot unpack 1 tensor of this packed transfer: "w" (shape [2], bfloat16, offset 1 in chunk 0): its offset is not a multiple of its item size 2 (torch: storage_offset must be divisible by 2); set weight_transfer.packed to false (one broadcast per tensor)`
	if err == nil || err.Error() != want {
		t.Fatalf("error\n %v\nwant\n %s", err, want)
	}

	ts = nil
	for i := range 13 {
		ts = append(ts, tensor(fmt.Sprintf("s%02d", i), "float32"))
	}
	err = CheckPackedReceivable(ts, Packed(ts, 1<<30))
	if err == nil {
		t.Fatal("accepted")
	}
	msg := err.Error()
	if !strings.Contains(msg, "cannot unpack 13 tensors") || !strings.Contains(msg, `"s09"`) || strings.Contains(msg, `"s10"`) ||
		!strings.Contains(msg, "; and 3 more; set weight_transfer.packed to false") {
		t.Fatalf("capped list: %v", err)
	}
	if n := strings.Count(msg, "it is 0-dim"); n != 10 {
		t.Fatalf("%d tensors listed, want 10: %v", n, err)
	}
}

func TestCheckPackedReceivableBadLayout(t *testing.T) {
	ts := []Tensor{tensor("a", "uint8", 1)}
	if err := CheckPackedReceivable(ts, []PackedChunk{{Tensors: []int{3}, Offsets: []int64{0}, Size: 1}}); err == nil {
		t.Fatal("a chunk naming a missing tensor was accepted")
	}
	if err := CheckPackedReceivable(ts, []PackedChunk{{Tensors: []int{0}, Size: 1}}); err == nil {
		t.Fatal("a chunk without offsets was accepted")
	}
	if err := CheckPackedReceivable(nil, nil); err != nil {
		t.Fatalf("empty update: %v", err)
	}
}

func TestCheckNCCLVersion(t *testing.T) {
	fp8 := []Tensor{tensor("w", "bfloat16", 4), tensor("w.fp8", "float8_e4m3fn", 3, 5), tensor("w.scale", "float32")}
	plain := []Tensor{tensor("w", "bfloat16", 4), tensor("b", "int64", 2)}
	tests := []struct {
		name    string
		ts      []Tensor
		version int
		want    string // the whole error; "" accepted
	}{
		{"plain-old-library", plain, 2804, ""},
		{"fp8-2.24.0", fp8, 22400, ""},
		{"fp8-2.28.3", fp8, 22803, ""},
		{"fp8-2.23.4", fp8, 22304, `plan: the loaded NCCL 2.23.4 cannot broadcast 1 tensor non-packed, which needs NCCL 2.24.0 or later: "w.fp8" (float8_e4m3fn as ncclFloat8e4m3); point RLFLOW_NCCL_LIB at a newer libnccl or set weight_transfer.packed to true (packed chunks are uint8)`},
		{"fp8-2.8.4", fp8, 2804, `plan: the loaded NCCL 2.8.4 cannot broadcast 1 tensor non-packed`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bs, err := NonPacked(tc.ts)
			if err != nil {
				t.Fatal(err)
			}
			err = CheckNCCLVersion(tc.ts, bs, tc.version)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)):
				t.Fatalf("error\n %v\nwant\n %s", err, tc.want)
			}
		})
	}

	var many []Tensor
	for i := range 12 {
		many = append(many, tensor(fmt.Sprintf("f%02d", i), "float8_e4m3fn", 2))
	}
	bs, err := NonPacked(many)
	if err != nil {
		t.Fatal(err)
	}
	err = CheckNCCLVersion(many, bs, 22304)
	if err == nil || !strings.Contains(err.Error(), "12 tensors non-packed") || !strings.Contains(err.Error(), "; and 2 more; point RLFLOW_NCCL_LIB") {
		t.Fatalf("capped list: %v", err)
	}
	if err := CheckNCCLVersion(many, []Broadcast{{Tensor: 40, DType: nccl.Float8e4m3}}, 22304); err == nil {
		t.Fatal("a broadcast naming a missing tensor was accepted")
	}
}
