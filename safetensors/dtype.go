package safetensors

import (
	"fmt"
	"sort"
)

// DType is a safetensors dtype name as it appears in the header ("F32", "BF16", ...).
type DType string

// The dtypes this package understands. The F8 variants are accepted in files
// but have no NCCL data type of their own.
const (
	Bool    DType = "BOOL"
	U8      DType = "U8"
	I8      DType = "I8"
	I16     DType = "I16"
	U16     DType = "U16"
	I32     DType = "I32"
	U32     DType = "U32"
	I64     DType = "I64"
	U64     DType = "U64"
	F16     DType = "F16"
	BF16    DType = "BF16"
	F32     DType = "F32"
	F64     DType = "F64"
	F8E4M3  DType = "F8_E4M3"
	F8E5M2  DType = "F8_E5M2"
	F8E8M0  DType = "F8_E8M0"
	unknown DType = ""
)

type dtypeInfo struct {
	size  int
	torch string
}

var dtypeTable = map[DType]dtypeInfo{
	Bool:   {1, "bool"},
	U8:     {1, "uint8"},
	I8:     {1, "int8"},
	I16:    {2, "int16"},
	U16:    {2, "uint16"},
	I32:    {4, "int32"},
	U32:    {4, "uint32"},
	I64:    {8, "int64"},
	U64:    {8, "uint64"},
	F16:    {2, "float16"},
	BF16:   {2, "bfloat16"},
	F32:    {4, "float32"},
	F64:    {8, "float64"},
	F8E4M3: {1, "float8_e4m3fn"},
	F8E5M2: {1, "float8_e5m2"},
	F8E8M0: {1, "float8_e8m0fnu"},
}

var torchToDType = func() map[string]DType {
	m := make(map[string]DType, len(dtypeTable))
	for d, info := range dtypeTable {
		m[info.torch] = d
	}
	return m
}()

// Valid reports whether d is a dtype this package knows.
func (d DType) Valid() bool {
	_, ok := dtypeTable[d]
	return ok
}

// ItemSize is the size of one element in bytes, or 0 for an unknown dtype.
func (d DType) ItemSize() int {
	return dtypeTable[d].size
}

// TorchName is the torch attribute name of the dtype ("bfloat16" for BF16),
// the spelling vLLM expects in update_info.dtype_names; "" for an unknown dtype.
func (d DType) TorchName() string {
	return dtypeTable[d].torch
}

// DTypeFromTorch maps a torch attribute name ("bfloat16", "float32", ...) back
// to its safetensors dtype.
func DTypeFromTorch(name string) (DType, error) {
	d, ok := torchToDType[name]
	if !ok {
		return unknown, fmt.Errorf("safetensors: unknown torch dtype %q", name)
	}
	return d, nil
}

// DTypes lists every known dtype, sorted by name.
func DTypes() []DType {
	out := make([]DType, 0, len(dtypeTable))
	for d := range dtypeTable {
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}
