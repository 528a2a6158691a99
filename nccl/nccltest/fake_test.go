package nccltest

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/nccl"
)

// The Fake's HostRegister behaves like CUDA: overlapping registrations are
// refused, copies from registered memory work, unregistering before a
// pending copy ran is caught, and leftover registrations are leaks.
func TestFakeHostRegister(t *testing.T) {
	f := NewFake(Config{OpDelay: 20e6}) // 20 ms per stream op
	mem := make([]byte, 4*4096)
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	if err := f.HostRegister(mem[:8192], nccl.HostRegisterReadOnly|nccl.HostRegisterPortable); err != nil {
		t.Fatal(err)
	}
	if err := f.HostRegister(mem[4096:12288], nccl.HostRegisterReadOnly); !errors.Is(err, nccl.CudaErrorHostMemAlreadyReg) {
		t.Fatalf("overlapping registration: %v, want cudaErrorHostMemoryAlreadyRegistered", err)
	}
	if err := f.HostRegister(mem[8192:], nccl.HostRegisterReadOnly); err != nil {
		t.Fatalf("adjacent registration: %v", err)
	}
	if l := f.Leaks(); !strings.Contains(l, "2 host registrations") {
		t.Fatalf("leaks %q, want the 2 registrations", l)
	}
	d, err := f.Malloc(len(mem))
	if err != nil {
		t.Fatal(err)
	}
	s, _ := f.StreamCreate(nccl.StreamNonBlocking)
	// A copy spanning two registrations is refused, as by nccl.Library:
	// each registration is its own pinned range.
	if err := f.MemcpyHtoDAsync(d, mem[4000:9000], s); !errors.Is(err, nccl.ErrNotPinned) {
		t.Fatalf("copy across registrations: %v, want ErrNotPinned", err)
	}
	if err := f.MemcpyHtoDAsync(d, mem[:8192], s); err != nil {
		t.Fatal(err)
	}
	if err := f.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	got, _ := f.DeviceBytes(d, 8192)
	if !bytes.Equal(got, mem[:8192]) {
		t.Fatal("copy from registered memory: wrong bytes")
	}
	// Unregistered while the copy is still queued: the stream fails.
	if err := f.MemcpyHtoDAsync(d+8192, mem[8192:], s); err != nil {
		t.Fatal(err)
	}
	if err := f.HostUnregister(mem[8192:]); err != nil {
		t.Fatal(err)
	}
	if err := f.StreamSynchronize(s); !errors.Is(err, nccl.CudaErrorIllegalAddress) {
		t.Fatalf("copy after unregister: %v, want an illegal address", err)
	}
	if err := f.HostUnregister(mem[:8192]); err != nil {
		t.Fatal(err)
	}
	if err := f.HostUnregister(mem[:8192]); !errors.Is(err, nccl.CudaErrorHostMemNotReg) {
		t.Fatalf("second unregister: %v", err)
	}
	_ = f.StreamDestroy(s)
	_ = f.Free(d)
	if l := f.Leaks(); l != "" {
		t.Fatalf("leaked %s", l)
	}
}
