package safetensors

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func seq(n int, start byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = start + byte(i)
	}
	return b
}

func TestWriteOpenRoundTrip(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "model.safetensors")
	in := []WriteTensor{
		{Name: "w<&>", DType: BF16, Shape: []int64{2, 3}, Data: seq(12, 1)},
		{Name: "scalar", DType: F32, Shape: []int64{}, Data: seq(4, 50)},
		{Name: "empty", DType: I64, Shape: []int64{0, 7}, Data: nil},
		{Name: "ünï", DType: U8, Shape: []int64{5}, Data: seq(5, 100)},
	}
	meta := map[string]string{"format": "pt", "b": "2"}
	if err := Write(path, in, meta); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(raw)
	if n%8 != 0 {
		t.Errorf("header length %d is not 8-byte aligned", n)
	}
	hdr := string(raw[8 : 8+n])
	if !strings.HasPrefix(hdr, `{"__metadata__":{"b":"2","format":"pt"},"w<&>":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},`) {
		t.Errorf("header = %s", hdr)
	}
	if strings.TrimRight(hdr, " ") != strings.TrimSpace(hdr) || !strings.HasSuffix(strings.TrimRight(hdr, " "), "}") {
		t.Errorf("header padding is not trailing spaces: %q", hdr)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := f.Metadata(); !reflect.DeepEqual(got, meta) {
		t.Errorf("metadata = %v", got)
	}
	ts := f.Tensors()
	// Data-offset order: w, scalar, empty (at 16, size 0) before ünï (at 16, size 5).
	var names []string
	for _, ti := range ts {
		names = append(names, ti.Name)
	}
	if got := strings.Join(names, ","); got != "w<&>,scalar,empty,ünï" {
		t.Errorf("order = %s", got)
	}
	for _, w := range in {
		b, err := f.Bytes(w.Name)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, w.Data) {
			t.Errorf("%s: bytes = %v, want %v", w.Name, b, w.Data)
		}
		ti, ok := f.Tensor(w.Name)
		if !ok || ti.Size != int64(len(w.Data)) || !bytes.Equal(raw[ti.Offset:ti.Offset+ti.Size], w.Data) {
			t.Errorf("%s: info %+v does not locate the data", w.Name, ti)
		}
		if cap(b) != len(b) {
			t.Errorf("%s: slice capacity %d exposes neighbouring tensors", w.Name, cap(b))
		}
	}
	if _, err := f.Bytes("nope"); err == nil || !strings.Contains(err.Error(), `no tensor "nope"`) {
		t.Errorf("missing tensor: %v", err)
	}
	f.Close()
	if _, err := f.Bytes("scalar"); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("after close: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("temporary files left behind: %v", ents)
	}
}

// TestReferenceLayout checks the exact bytes the reference implementation
// (safetensors.torch.save_file) produces for a one-tensor file.
func TestReferenceLayout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a.safetensors")
	if err := Write(path, []WriteTensor{{Name: "a", DType: F32, Shape: []int64{2}, Data: seq(8, 0)}}, nil); err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(path)
	hdr := `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`
	want := file(hdr+strings.Repeat(" ", (8-len(hdr)%8)%8), 0)
	want = append(want, seq(8, 0)...)
	if !bytes.Equal(raw, want) {
		t.Errorf("file = %q\nwant %q", raw, want)
	}
}

func TestWriteRejects(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name string
		ts   []WriteTensor
		want string
	}{
		{"empty-name", []WriteTensor{{Name: "", DType: U8, Shape: []int64{0}}}, "empty tensor name"},
		{"reserved", []WriteTensor{{Name: "__metadata__", DType: U8, Shape: []int64{0}}}, "reserved"},
		{"dup", []WriteTensor{{Name: "a", DType: U8, Shape: []int64{0}}, {Name: "a", DType: U8, Shape: []int64{0}}}, "duplicate tensor name"},
		{"dtype", []WriteTensor{{Name: "a", DType: "X", Shape: []int64{0}}}, `unknown dtype "X"`},
		{"negative", []WriteTensor{{Name: "a", DType: U8, Shape: []int64{-1}}}, "negative dimension"},
		{"size", []WriteTensor{{Name: "a", DType: F32, Shape: []int64{3}, Data: make([]byte, 8)}}, "needs 12 bytes, data has 8"},
		{"overflow", []WriteTensor{{Name: "a", DType: F64, Shape: []int64{1 << 62, 4}}}, "overflows"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, tc.name+".safetensors")
			err := Write(path, tc.ts, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("err = %v, want %q naming the file", err, tc.want)
			}
			if _, err := os.Stat(path); !os.IsNotExist(err) {
				t.Fatalf("file created despite the error")
			}
		})
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 0 {
		t.Errorf("leftovers: %v", ents)
	}
}

func TestWriteReplacesAtomically(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.safetensors")
	for i := range 3 {
		if err := Write(path, []WriteTensor{{Name: "v", DType: U8, Shape: []int64{1}, Data: []byte{byte(i)}}}, nil); err != nil {
			t.Fatal(err)
		}
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if b, _ := f.Bytes("v"); !bytes.Equal(b, []byte{2}) {
		t.Errorf("bytes = %v", b)
	}
}

func TestOpenErrors(t *testing.T) {
	if _, err := Open(filepath.Join(t.TempDir(), "missing")); err == nil || !os.IsNotExist(unwrapAll(err)) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := Open(t.TempDir()); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("directory: %v", err)
	}
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}

func writeFile(t *testing.T, path string, ts ...WriteTensor) {
	t.Helper()
	if err := Write(path, ts, nil); err != nil {
		t.Fatal(err)
	}
}

func u8(name string, data ...byte) WriteTensor {
	return WriteTensor{Name: name, DType: U8, Shape: []int64{int64(len(data))}, Data: data}
}

func names(ts []TensorInfo) string {
	var s []string
	for _, t := range ts {
		s = append(s, filepath.Base(t.File)+":"+t.Name)
	}
	return strings.Join(s, ",")
}

func TestCheckpointSharded(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), u8("b", 1, 2), u8("a", 3))
	writeFile(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), u8("c", 4, 5, 6))
	writeFile(t, filepath.Join(dir, "consolidated.safetensors"), u8("a", 9)) // not in the index: ignored
	// Shard 2 appears first in the weight_map: it comes first.
	index := `{"metadata":{"total_size":6},"weight_map":{"c":"model-00002-of-00002.safetensors","a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors"}}`
	os.WriteFile(filepath.Join(dir, IndexFile), []byte(index), 0o644)
	c, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := names(c.Tensors()); got != "model-00002-of-00002.safetensors:c,model-00001-of-00002.safetensors:b,model-00001-of-00002.safetensors:a" {
		t.Errorf("order = %s", got)
	}
	if c.TotalBytes() != 6 {
		t.Errorf("total = %d", c.TotalBytes())
	}
	var all []byte
	for _, ti := range c.Tensors() {
		b, err := c.Bytes(ti)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, b...)
	}
	if !bytes.Equal(all, []byte{4, 5, 6, 1, 2, 3}) {
		t.Errorf("bytes = %v", all)
	}
	ti, _ := c.Tensor("a")
	ti.Offset++
	if _, err := c.Bytes(ti); err == nil {
		t.Errorf("Bytes accepted a forged TensorInfo")
	}
}

func TestCheckpointIndexErrors(t *testing.T) {
	tests := []struct {
		name  string
		index string
		want  string
	}{
		{"missing-shard", `{"weight_map":{"a":"s1.safetensors","z":"gone.safetensors"}}`, "gone.safetensors"},
		{"tensor-not-in-shard", `{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","x":"s1.safetensors","c":"s2.safetensors"}}`, `tensor "x" is not in shard`},
		{"wrong-shard", `{"weight_map":{"a":"s2.safetensors","b":"s1.safetensors","c":"s2.safetensors"}}`, `tensor "a" is mapped to`},
		{"unlisted", `{"weight_map":{"a":"s1.safetensors","c":"s2.safetensors"}}`, `holds tensor "b", which the weight_map does not list`},
		{"duplicate", `{"weight_map":{"a":"s1.safetensors","a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}}`, `tensor "a" appears twice in weight_map`},
		{"traversal", `{"weight_map":{"a":"../s1.safetensors"}}`, "not a .safetensors file inside the checkpoint directory"},
		{"not-safetensors", `{"weight_map":{"a":"s1.bin"}}`, "not a .safetensors file"},
		{"no-map", `{"metadata":{}}`, "no weight_map"},
		{"empty-map", `{"weight_map":{}}`, "weight_map lists no tensors"},
		{"bad-json", `{"weight_map":`, "invalid JSON"},
		{"value-not-string", `{"weight_map":{"a":1}}`, `weight_map entry for tensor "a" is not a string`},
		{"corrupt-shard", `{"weight_map":{"a":"bad.safetensors"}}`, "header length is 0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			writeFile(t, filepath.Join(dir, "s1.safetensors"), u8("a", 1), u8("b", 2))
			writeFile(t, filepath.Join(dir, "s2.safetensors"), u8("c", 3))
			os.WriteFile(filepath.Join(dir, "bad.safetensors"), make([]byte, 8), 0o644)
			os.WriteFile(filepath.Join(dir, IndexFile), []byte(tc.index), 0o644)
			c, err := OpenCheckpoint(dir)
			if err == nil {
				c.Close()
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestCheckpointDirectory(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "b.safetensors"), u8("y", 2))
	writeFile(t, filepath.Join(dir, "a.safetensors"), u8("x", 1))
	os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("hi"), 0o644)
	os.Mkdir(filepath.Join(dir, "sub.safetensors"), 0o755)
	c, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := names(c.Tensors()); got != "a.safetensors:x,b.safetensors:y" {
		t.Errorf("order = %s", got)
	}
	c.Close()

	writeFile(t, filepath.Join(dir, "c.safetensors"), u8("x", 3))
	if _, err := OpenCheckpoint(dir); err == nil || !strings.Contains(err.Error(), `tensor "x" is in both`) {
		t.Errorf("duplicate across files: %v", err)
	}
	if _, err := OpenCheckpoint(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no *.safetensors files") {
		t.Errorf("empty dir: %v", err)
	}
	single, err := OpenCheckpoint(filepath.Join(dir, "a.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer single.Close()
	if got := names(single.Tensors()); got != "a.safetensors:x" {
		t.Errorf("single = %s", got)
	}
}

func TestRandomRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	dts := DTypes()
	dir := t.TempDir()
	for iter := range 200 {
		var ts []WriteTensor
		for i := range r.IntN(8) {
			d := dts[r.IntN(len(dts))]
			shape := make([]int64, r.IntN(4))
			n := int64(1)
			for j := range shape {
				shape[j] = int64(r.IntN(4))
				n *= shape[j]
			}
			data := make([]byte, n*int64(d.ItemSize()))
			for k := range data {
				data[k] = byte(r.Uint32())
			}
			ts = append(ts, WriteTensor{Name: string(rune('a'+i)) + "x", DType: d, Shape: shape, Data: data})
		}
		path := filepath.Join(dir, "r.safetensors")
		if err := Write(path, ts, map[string]string{"iter": string(rune('0' + iter%10))}); err != nil {
			t.Fatal(err)
		}
		f, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		if len(f.Tensors()) != len(ts) {
			t.Fatalf("count %d vs %d", len(f.Tensors()), len(ts))
		}
		for _, w := range ts {
			ti, ok := f.Tensor(w.Name)
			b, _ := f.Bytes(w.Name)
			if !ok || ti.DType != w.DType || !reflect.DeepEqual(ti.Shape, w.Shape) || !bytes.Equal(b, w.Data) {
				t.Fatalf("tensor %s mismatch", w.Name)
			}
		}
		f.Close()
	}
}

func TestDTypes(t *testing.T) {
	tests := []struct {
		d     DType
		size  int
		torch string
	}{
		{Bool, 1, "bool"}, {U8, 1, "uint8"}, {I8, 1, "int8"}, {I16, 2, "int16"}, {U16, 2, "uint16"},
		{I32, 4, "int32"}, {U32, 4, "uint32"}, {I64, 8, "int64"}, {U64, 8, "uint64"},
		{F16, 2, "float16"}, {BF16, 2, "bfloat16"}, {F32, 4, "float32"}, {F64, 8, "float64"},
		{F8E4M3, 1, "float8_e4m3fn"}, {F8E5M2, 1, "float8_e5m2"}, {F8E8M0, 1, "float8_e8m0fnu"},
		{"F128", 0, ""},
	}
	for _, tc := range tests {
		if tc.d.ItemSize() != tc.size || tc.d.TorchName() != tc.torch {
			t.Errorf("%s: %d %q", tc.d, tc.d.ItemSize(), tc.d.TorchName())
		}
		if tc.size > 0 {
			if d, err := DTypeFromTorch(tc.torch); err != nil || d != tc.d {
				t.Errorf("DTypeFromTorch(%q) = %v, %v", tc.torch, d, err)
			}
		}
	}
	if _, err := DTypeFromTorch("complex32"); err == nil {
		t.Error("complex32 accepted")
	}
	if len(DTypes()) != 16 {
		t.Errorf("DTypes = %v", DTypes())
	}
}
