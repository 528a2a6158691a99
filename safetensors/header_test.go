package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the checked-in corrupt-header corpus")

// file builds a safetensors image from a header string and a data length.
func file(hdr string, dataLen int) []byte {
	b := make([]byte, 8, 8+len(hdr)+dataLen)
	binary.LittleEndian.PutUint64(b, uint64(len(hdr)))
	b = append(b, hdr...)
	return append(b, make([]byte, dataLen)...)
}

// withLen is a file whose length prefix is n whatever follows.
func withLen(n uint64, rest string) []byte {
	b := make([]byte, 8)
	binary.LittleEndian.PutUint64(b, n)
	return append(b, rest...)
}

const okT = `"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}`

// corruptCases is the corrupt-header corpus: every case must be rejected
// with an error containing want. The files are also checked in under
// safetensors/testdata/corrupt/ (regenerate with -update).
var corruptCases = []struct {
	name string
	data []byte
	want string
}{
	{"empty-file", nil, "shorter than the 8-byte header length"},
	{"short-prefix", []byte{1, 0, 0, 0, 0, 0, 0}, "shorter than the 8-byte header length"},
	{"zero-header-length", withLen(0, "{}"), "header length is 0"},
	{"header-over-100mb", withLen(100_000_001, "{}"), "exceeds the 100000000 byte limit"},
	{"header-length-huge", withLen(1<<63, "{}"), "exceeds the 100000000 byte limit"},
	{"header-past-eof", withLen(64, "{}"), "runs past the end of the 10 byte file"},
	{"invalid-utf8", file("{\"\xff\":1}", 0), "not valid UTF-8"},
	{"not-object-start", file(` {}     `, 0), "does not start with '{'"},
	{"array-header", file(`[]`, 0), "does not start with '{'"},
	{"truncated-json", file(`{"t":{"dtype":`, 0), "truncated"},
	{"json-syntax", file(`{"t" 1}`, 0), "not valid JSON"},
	{"trailing-garbage", file(`{} x`, 0), "unexpected data after the header JSON object"},
	{"trailing-nul-padding", file("{}\x00\x00", 0), "unexpected data after the header JSON object"},
	{"metadata-not-object", file(`{"__metadata__":[1]}`, 0), "__metadata__ is not an object"},
	{"metadata-value-not-string", file(`{"__metadata__":{"k":1}}`, 0), `__metadata__ value of "k" is not a string`},
	{"metadata-duplicate-key", file(`{"__metadata__":{"k":"a","k":"b"}}`, 0), `duplicate __metadata__ key "k"`},
	{"metadata-twice", file(`{"__metadata__":{},"__metadata__":{}}`, 0), "duplicate __metadata__ entry"},
	{"duplicate-tensor", file(`{`+okT+`,`+okT+`}`, 16), `tensor "t": duplicate tensor entry`},
	{"tensor-not-object", file(`{"t":[1,2]}`, 0), `tensor "t": entry is not an object`},
	{"missing-dtype", file(`{"t":{"shape":[1],"data_offsets":[0,4]}}`, 4), `tensor "t": missing dtype`},
	{"missing-shape", file(`{"t":{"dtype":"F32","data_offsets":[0,4]}}`, 4), `tensor "t": missing shape`},
	{"missing-offsets", file(`{"t":{"dtype":"F32","shape":[1]}}`, 4), `tensor "t": missing data_offsets`},
	{"unknown-dtype", file(`{"t":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}`, 16), `tensor "t": unknown dtype "F128"`},
	{"dtype-not-string", file(`{"t":{"dtype":4,"shape":[1],"data_offsets":[0,4]}}`, 4), `tensor "t": dtype is not a string`},
	{"unknown-field", file(`{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}}`, 4), `tensor "t": unknown field "extra"`},
	{"duplicate-field", file(`{"t":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 4), `tensor "t": duplicate field "dtype"`},
	{"shape-not-array", file(`{"t":{"dtype":"F32","shape":4,"data_offsets":[0,4]}}`, 4), `tensor "t": shape is not an array`},
	{"negative-dim", file(`{"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, 4), `tensor "t": shape dimension 0 is negative`},
	{"fractional-dim", file(`{"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}`, 4), `tensor "t": shape element 0 (1.5) is not an integer`},
	{"dim-over-int64", file(`{"t":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,4]}}`, 4), `is not an integer in [0, 2^63)`},
	{"dim-string", file(`{"t":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}}`, 4), `tensor "t": shape element 0 is not a number`},
	{"offsets-three", file(`{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}`, 8), `data_offsets has 3 elements, want 2`},
	{"offsets-negative", file(`{"t":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}`, 4), `data_offsets element 0 is negative`},
	{"offsets-reversed", file(`{"t":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}`, 4), `end before they begin`},
	{"offsets-past-data", file(`{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}`, 8), `run past the 8 byte data area`},
	{"size-mismatch", file(`{"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}`, 12), `shape [2 2] of F32 needs 16 bytes but data_offsets [0, 12] span 12`},
	{"size-overflow", file(`{"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}}`, 4), `overflows the byte size`},
	{"overlap", file(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}`, 6), `tensor "b": data_offsets [2, 6] overlap tensor "a"`},
	{"zero-size-inside-tensor", file(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}}`, 4), `tensor "z": data_offsets [2, 2] overlap tensor "a"`},
	{"gap", file(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}}`, 10), `tensor "b": data_offsets [6, 10] leave a gap of 2 bytes`},
	{"leading-gap", file(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}`, 8), `leave a gap of 4 bytes at data offset 0`},
	{"trailing-bytes", file(`{`+okT+`}`, 20), `data area is 20 bytes but the tensors cover only 16 (4 trailing bytes)`},
	{"no-tensors-with-data", file(`{}`, 3), `(3 trailing bytes)`},
}

func TestCorruptCorpus(t *testing.T) {
	if len(corruptCases) < 20 {
		t.Fatalf("corpus has %d cases, want at least 20", len(corruptCases))
	}
	dir := filepath.Join("testdata", "corrupt")
	if *update {
		os.RemoveAll(dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	names := map[string]bool{}
	for _, tc := range corruptCases {
		t.Run(tc.name, func(t *testing.T) {
			if names[tc.name] {
				t.Fatalf("duplicate case name")
			}
			names[tc.name] = true
			path := filepath.Join(dir, tc.name+".safetensors")
			if *update {
				if err := os.WriteFile(path, tc.data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			onDisk, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("corpus file missing (run go test -run TestCorruptCorpus -update): %v", err)
			}
			if !bytes.Equal(onDisk, tc.data) {
				t.Fatalf("checked-in %s differs from the table (run with -update)", path)
			}
			f, err := Open(path)
			if err == nil {
				f.Close()
				t.Fatalf("Open accepted a corrupt file")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
			if !strings.Contains(err.Error(), path) {
				t.Fatalf("error %q does not name the file", err)
			}
			var fe *FormatError
			if !errors.As(err, &fe) {
				t.Fatalf("error %T is not a *FormatError", err)
			}
			// The in-memory parser must agree with Open.
			if _, err2 := parseHeader(path, tc.data); err2 == nil || err2.Error() != err.Error() {
				t.Fatalf("parseHeader = %v, Open = %v", err2, err)
			}
		})
	}
	if !*update {
		ents, _ := os.ReadDir(dir)
		if len(ents) != len(corruptCases) {
			t.Errorf("%s holds %d files, the table %d (run with -update)", dir, len(ents), len(corruptCases))
		}
	}
}

func TestParseValid(t *testing.T) {
	tests := []struct {
		name string
		data []byte
		want []TensorInfo
		meta map[string]string
	}{
		{"empty", file(`{}`, 0), []TensorInfo{}, map[string]string{}},
		{"padded", file(`{}      `, 0), []TensorInfo{}, map[string]string{}},
		{"metadata-null", file(`{"__metadata__":null}`, 0), []TensorInfo{}, map[string]string{}},
		{"metadata", file(`{"__metadata__":{"format":"pt","x":""}}`, 0), []TensorInfo{}, map[string]string{"format": "pt", "x": ""}},
		{"scalar", file(`{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}`, 8),
			[]TensorInfo{{Name: "s", DType: F64, Shape: []int64{}, Offset: 0, Size: 8}}, map[string]string{}},
		{"offset-order-and-zero-size", file(`{"b":{"dtype":"BF16","shape":[3],"data_offsets":[4,10]},"z":{"dtype":"I64","shape":[0,5],"data_offsets":[4,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"y":{"dtype":"BOOL","shape":[0],"data_offsets":[10,10]}}`, 10),
			nil, map[string]string{}},
		{"huge-dims-with-zero", file(`{"z":{"dtype":"F32","shape":[9223372036854775807,0,9223372036854775807],"data_offsets":[0,0]}}`, 0),
			[]TensorInfo{{Name: "z", DType: F32, Shape: []int64{9223372036854775807, 0, 9223372036854775807}, Offset: 0, Size: 0}}, map[string]string{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, err := parseHeader("x", tc.data)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(h.metadata, tc.meta) {
				t.Errorf("metadata = %v, want %v", h.metadata, tc.meta)
			}
			if tc.want == nil {
				return
			}
			base := int64(8 + binary.LittleEndian.Uint64(tc.data)) // want offsets are data-relative
			for i := range tc.want {
				tc.want[i].File = "x"
				tc.want[i].Offset += base
			}
			if !reflect.DeepEqual(h.tensors, tc.want) {
				t.Errorf("tensors = %+v\nwant %+v", h.tensors, tc.want)
			}
		})
	}
	h, err := parseHeader("x", tests[5].data)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, ti := range h.tensors {
		order = append(order, ti.Name)
	}
	if got := strings.Join(order, ","); got != "a,z,b,y" {
		t.Errorf("order = %s, want a,z,b,y (offset, then end, then name)", got)
	}
}

func FuzzHeader(f *testing.F) {
	for _, tc := range corruptCases {
		f.Add(tc.data)
	}
	f.Add(file(`{}`, 0))
	f.Add(file(`{"__metadata__":{"a":"b"},`+okT+`}`, 16))
	f.Add(file(`{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"z":{"dtype":"I64","shape":[0],"data_offsets":[4,4]},"b":{"dtype":"BF16","shape":[1,1],"data_offsets":[4,6]}}`, 6))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := parseHeader("fuzz", data)
		if err != nil {
			var fe *FormatError
			if !errors.As(err, &fe) {
				t.Fatalf("error %T is not a *FormatError: %v", err, err)
			}
			return
		}
		// Invariants of an accepted file: tensors tile the data area in order.
		n := binary.LittleEndian.Uint64(data)
		pos := int64(8 + n)
		var wts []WriteTensor
		for _, ti := range h.tensors {
			if ti.Offset != pos {
				t.Fatalf("tensor %q at %d, want %d", ti.Name, ti.Offset, pos)
			}
			want, ok := byteSize(ti.Shape, ti.DType)
			if !ok || int64(want) != ti.Size {
				t.Fatalf("tensor %q size %d, shape says %d", ti.Name, ti.Size, want)
			}
			pos += ti.Size
			if ti.Name != "" && ti.Name != metadataKey {
				wts = append(wts, WriteTensor{Name: ti.Name, DType: ti.DType, Shape: ti.Shape, Data: data[ti.Offset : ti.Offset+ti.Size]})
			}
		}
		if pos != int64(len(data)) {
			t.Fatalf("tensors end at %d, file is %d", pos, len(data))
		}
		if len(wts) != len(h.tensors) {
			return // names the writer refuses
		}
		// Re-encoding reproduces the same tensors.
		hdr, err := encodeHeader("fuzz", wts, h.metadata)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		img := make([]byte, 8)
		binary.LittleEndian.PutUint64(img, uint64(len(hdr)))
		img = append(img, hdr...)
		for _, w := range wts {
			img = append(img, w.Data...)
		}
		h2, err := parseHeader("fuzz", img)
		if err != nil {
			t.Fatalf("re-parse: %v", err)
		}
		if len(h2.tensors) != len(h.tensors) || !reflect.DeepEqual(h2.metadata, h.metadata) {
			t.Fatalf("round trip changed the header")
		}
		for i := range h.tensors {
			a, b := h.tensors[i], h2.tensors[i]
			if a.Name != b.Name || a.DType != b.DType || !reflect.DeepEqual(a.Shape, b.Shape) || a.Size != b.Size {
				t.Fatalf("round trip changed tensor %d: %+v vs %+v", i, a, b)
			}
			if !bytes.Equal(data[a.Offset:a.Offset+a.Size], img[b.Offset:b.Offset+b.Size]) {
				t.Fatalf("round trip changed the bytes of %q", a.Name)
			}
		}
	})
}
