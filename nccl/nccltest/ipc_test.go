//go:build unix

package nccltest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/nccl"
)

// shmFile writes data to a new file standing in for an exporter's block.
func shmFile(t *testing.T, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "snapshot.shm")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// The fake's fake_shm import behaves like CUDA IPC: the pointer's bytes
// are the exporter's (both ways, later writes included), a second open
// returns the same pointer and counts, the mapping is not the device's
// memory, cudaFree refuses it, it is a leak until closed and an illegal
// address after.
func TestFakeIPCSharesTheFile(t *testing.T) {
	f := NewFake(Config{Devices: 2, DeviceMemory: 1 << 20})
	data := bytes.Repeat([]byte("rlflow-snapshot!"), 256) // 4 KiB
	path := shmFile(t, data)
	dev, err := nccl.OpenDevice(f, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	ctx := context.Background()
	h := nccl.IPCHandle{Kind: nccl.IPCFakeShm, Path: path, Bytes: 4000} // the block may be shorter than the file
	var p, p2 nccl.DevPtr
	var free uint64
	err = dev.Do(ctx, func(nccl.API) (err error) {
		if p, err = f.OpenIPC(h); err != nil {
			return err
		}
		if p2, err = f.OpenIPC(h); err != nil {
			return err
		}
		free, _, err = f.MemGetInfo()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if p2 != p {
		t.Fatalf("second open %#x, first %#x: CUDA returns the same pointer", p2, p)
	}
	if free != 1<<20 {
		t.Fatalf("device 1 has %d bytes free after the import, want all of them", free)
	}
	got, err := f.DeviceBytes(p, 4000)
	if err != nil || !bytes.Equal(got, data[:4000]) {
		t.Fatalf("imported bytes differ from the file's (%v)", err)
	}
	if _, err := f.DeviceBytes(p, 4001); err == nil {
		t.Fatal("read past the mapped block succeeded")
	}

	// The exporter publishes again into the same file: seen at once.
	fw, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fw.WriteAt([]byte("PUBLISHED"), 100); err != nil {
		t.Fatal(err)
	}
	fw.Close()
	got, _ = f.DeviceBytes(p+100, 9)
	if string(got) != "PUBLISHED" {
		t.Fatalf("a later write into the file is not seen through the pointer: %q", got)
	}
	// And device writes reach the file.
	if err := f.Memset(p+200, 'z', 3); err != nil {
		t.Fatal(err)
	}
	file, _ := os.ReadFile(path)
	if string(file[200:203]) != "zzz" {
		t.Fatalf("a device write is not in the file: %q", file[200:203])
	}

	if err := f.Free(p); !errors.Is(err, nccl.CudaErrorInvalidValue) || !strings.Contains(err.Error(), "IPC mapping") {
		t.Fatalf("cudaFree of the mapping: %v", err)
	}
	if l := f.Leaks(); l != "1 IPC mappings" {
		t.Fatalf("leaks %q with the mapping open twice", l)
	}
	if err := f.CloseIPC(p); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "1 IPC mappings" {
		t.Fatalf("leaks %q after one of two closes", l)
	}
	if err := f.CloseIPC(p); err != nil {
		t.Fatal(err)
	}
	if l := f.Leaks(); l != "" {
		t.Fatalf("leaked %s", l)
	}
	if _, err := f.DeviceBytes(p, 1); !errors.Is(err, nccl.CudaErrorIllegalAddress) {
		t.Fatalf("read after close: %v, want an illegal address", err)
	}
	if err := f.CloseIPC(p); !errors.Is(err, nccl.CudaErrorInvalidValue) {
		t.Fatalf("third close: %v", err)
	}
}

func TestFakeIPCRefusals(t *testing.T) {
	f := NewFake(Config{})
	path := shmFile(t, make([]byte, 64))
	cases := []struct {
		name string
		h    nccl.IPCHandle
		is   error
		want string
	}{
		{"cuda handle", nccl.IPCHandle{Kind: nccl.IPCCUDA}, nccl.ErrIPCKind,
			`nccltest: the fake NCCL (a TEST DOUBLE) opens fake_shm snapshots only, not "cuda": nccl: IPC handle of a kind this importer does not open`},
		{"file shorter than the block", nccl.IPCHandle{Kind: nccl.IPCFakeShm, Path: path, Bytes: 65}, nccl.CudaErrorInvalidValue,
			"cudaIpcOpenMemHandle (fake_shm): cudaErrorInvalidValue: invalid argument: " + path + " holds 64 bytes, the handle maps 65"},
		{"no bytes", nccl.IPCHandle{Kind: nccl.IPCFakeShm, Path: path}, nccl.CudaErrorInvalidValue,
			"cudaIpcOpenMemHandle (fake_shm): cudaErrorInvalidValue: invalid argument: " + path + ": 0 bytes to map"},
		{"missing file", nccl.IPCHandle{Kind: nccl.IPCFakeShm, Path: path + ".gone", Bytes: 8}, nccl.CudaErrorInvalidValue,
			"cudaIpcOpenMemHandle (fake_shm): cudaErrorInvalidValue: invalid argument: open " + path + ".gone: no such file or directory"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, err := f.OpenIPC(c.h)
			if p != 0 || !errors.Is(err, c.is) || err.Error() != c.want {
				t.Fatalf("got %#x, %v\nwant %s", p, err, c.want)
			}
		})
	}
	if l := f.Leaks(); l != "" {
		t.Fatalf("leaked %s", l)
	}
}

// A broadcast from an imported mapping moves its bytes to a real second
// rank: the path the NCCL engine takes for a resident trainer's snapshot.
func TestFakeIPCBroadcastFromMapping(t *testing.T) {
	f := NewFake(Config{Devices: 2})
	data := []byte("0123456789abcdef0123456789ABCDEF")
	path := shmFile(t, data)
	id, _ := f.GetUniqueID()
	ctx := context.Background()
	comms := make([]*nccl.Comm, 2)
	errs := make([]error, 2)
	done := make(chan int)
	for r := range comms {
		go func() { comms[r], errs[r] = nccl.NewComm(ctx, f, r, 2, r, id); done <- r }()
	}
	<-done
	<-done
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	var src, dst nccl.DevPtr
	if err := comms[0].Device().Do(ctx, func(nccl.API) (err error) {
		src, err = f.OpenIPC(nccl.IPCHandle{Kind: nccl.IPCFakeShm, Path: path, Bytes: int64(len(data))})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if err := comms[1].Device().Do(ctx, func(api nccl.API) (err error) { dst, err = api.Malloc(16); return err }); err != nil {
		t.Fatal(err)
	}
	go func() { errs[0] = comms[0].Broadcast(ctx, src+8, 16, nccl.Uint8); done <- 0 }()
	errs[1] = comms[1].Broadcast(ctx, dst, 16, nccl.Uint8)
	<-done
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if got, _ := f.DeviceBytes(dst, 16); string(got) != string(data[8:24]) {
		t.Fatalf("received %q, want %q", got, data[8:24])
	}
	_ = comms[1].Device().Do(ctx, func(api nccl.API) error { return api.Free(dst) })
	_ = comms[0].Device().Do(ctx, func(nccl.API) error { return f.CloseIPC(src) })
	for _, c := range comms {
		_ = c.Close(ctx)
	}
	if l := f.Leaks(); l != "" {
		t.Fatalf("leaked %s", l)
	}
}
