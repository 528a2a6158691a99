package staging

import (
	"reflect"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/safetensors"
)

// Plan (nccl/plan underneath) must produce exactly the oracle's layout.
func TestPlanMatchesOracle(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), mixed)
	for _, tc := range []struct {
		packed    bool
		threshold int64
		toBF16    bool
	}{{true, 1, false}, {true, 1000, false}, {true, 4226, false}, {true, 4227, true}, {true, 1 << 30, true}, {false, 0, false}, {false, 0, true}} {
		wire := KeepDType
		if tc.toBF16 {
			wire = F32ToBF16
		}
		u, err := Plan(ck.Tensors(), tc.packed, tc.threshold, wire)
		if err != nil {
			t.Fatal(err)
		}
		want := oracle(t, ck, tc.packed, tc.threshold, tc.toBF16)
		if !reflect.DeepEqual(u.Chunks, want) {
			t.Fatalf("%+v: Plan and the oracle differ:\n%+v\n%+v", tc, u.Chunks, want)
		}
		info, err := u.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		var i int
		for _, c := range u.Chunks {
			for _, p := range c.Pieces {
				if info.Names[i] != p.Src.Name || info.DTypeNames[i] != p.Wire.TorchName() || !reflect.DeepEqual(info.Shapes[i], append([]int64{}, p.Src.Shape...)) {
					t.Fatalf("update_info entry %d (%s %s %v) does not describe broadcast piece %s %s", i, info.Names[i], info.DTypeNames[i], info.Shapes[i], p.Src.Name, p.Wire)
				}
				i++
			}
		}
		if tc.toBF16 && strings.Contains(strings.Join(info.DTypeNames, ","), "float32") {
			t.Fatal("update_info still announces float32")
		}
		if !tc.toBF16 && u.Bytes() != ck.TotalBytes() {
			t.Fatalf("update of %d bytes, checkpoint %d", u.Bytes(), ck.TotalBytes())
		}
	}
}

func TestPlanErrors(t *testing.T) {
	ck := writeCheckpoint(t, t.TempDir(), []testTensor{
		{"flags", safetensors.Bool, []int64{9}},
		{"w", safetensors.F64, []int64{3}},
	})
	if _, err := Plan(ck.Tensors(), false, 0, nil); err == nil || !strings.Contains(err.Error(), "packed") {
		t.Fatalf("bool tensor non-packed: %v", err)
	}
	if _, err := Plan(ck.Tensors(), true, 1<<20, nil); err != nil {
		t.Fatalf("bool tensor packed: %v", err)
	}
	toBF16 := func(safetensors.TensorInfo) safetensors.DType { return safetensors.BF16 }
	if _, err := Plan(ck.Tensors(), true, 1<<20, toBF16); err == nil || !strings.Contains(err.Error(), "no conversion") {
		t.Fatalf("impossible conversion: %v", err)
	}
	if _, err := Plan(ck.Tensors(), true, 0, nil); err == nil {
		t.Fatal("zero threshold accepted")
	}
}
