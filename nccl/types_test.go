package nccl

import (
	"fmt"
	"testing"
)

// TestDataTypes pins the enum to nccl.h's values and sizes: a wrong value
// here is a broadcast of the wrong type on the wire.
func TestDataTypes(t *testing.T) {
	tests := []struct {
		d          DataType
		value      int
		name       string
		size       int
		minVersion int
	}{
		{Int8, 0, "ncclInt8", 1, 0},
		{Uint8, 1, "ncclUint8", 1, 0},
		{Int32, 2, "ncclInt32", 4, 0},
		{Uint32, 3, "ncclUint32", 4, 0},
		{Int64, 4, "ncclInt64", 8, 0},
		{Uint64, 5, "ncclUint64", 8, 0},
		{Float16, 6, "ncclFloat16", 2, 0},
		{Float32, 7, "ncclFloat32", 4, 0},
		{Float64, 8, "ncclFloat64", 8, 0},
		{Bfloat16, 9, "ncclBfloat16", 2, 0},
		{Float8e4m3, 10, "ncclFloat8e4m3", 1, 22400},
		{Float8e5m2, 11, "ncclFloat8e5m2", 1, 22400},
	}
	for _, tc := range tests {
		if int(tc.d) != tc.value || !tc.d.Valid() || tc.d.String() != tc.name || tc.d.Size() != tc.size || tc.d.MinVersion() != tc.minVersion {
			t.Errorf("%d: value %d, valid %v, %q, size %d, min version %d; want %d, true, %q, %d, %d",
				int(tc.d), int(tc.d), tc.d.Valid(), tc.d.String(), tc.d.Size(), tc.d.MinVersion(), tc.value, tc.name, tc.size, tc.minVersion)
		}
	}
	for _, d := range []DataType{-1, 12, 42} { // ncclNumTypes is 12
		if d.Valid() || d.Size() != 0 || d.MinVersion() != 0 || d.String() != fmt.Sprintf("ncclDataType(%d)", int(d)) {
			t.Errorf("%d: valid %v, size %d, min version %d, %q", int(d), d.Valid(), d.Size(), d.MinVersion(), d.String())
		}
	}
}

func TestVersionString(t *testing.T) {
	for v, want := range map[int]string{
		22803: "2.28.3", 22400: "2.24.0", 22304: "2.23.4", 21903: "2.19.3", 20906: "2.9.6",
		2804: "2.8.4", 2708: "2.7.8", 2400: "2.4.0",
	} {
		if got := VersionString(v); got != want {
			t.Errorf("VersionString(%d) = %q, want %q", v, got, want)
		}
	}
}
