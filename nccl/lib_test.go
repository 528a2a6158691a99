//go:build linux && cgo

package nccl

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// stubSource is a stand-in for libnccl.so.2 and libcudart.so with the real
// C signatures, so that the dlopen/dlsym machinery and the C shims (the
// 128-byte id passed by value, the ncclConfig_t prefix, out-parameters,
// error strings) are exercised on a machine without a GPU. "Device" memory
// is malloc'd host memory.
const stubSource = `
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } uid;
typedef struct {
	size_t size; unsigned int magic; unsigned int version;
	int blocking; int cgaClusterSize; int minCTAs; int maxCTAs; const char *netName; int splitShare;
} config;

int ncclGetVersion(int *v) { *v = 22803; return 0; }
int ncclGetUniqueId(uid *id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 1); return 0; }
const char *ncclGetErrorString(int r) { return "stub error string"; }
const char *ncclGetLastError(void *comm) { return "stub: peer 1 closed the socket"; }

// The id must arrive intact by value: byte i is i*7+1.
static int idOK(uid id) {
	for (int i = 0; i < 128; i++) if (id.internal[i] != (char)(i * 7 + 1)) return 0;
	return 1;
}
int ncclCommInitRank(void **comm, int n, uid id, int rank) {
	if (!idOK(id)) return 4;
	*comm = calloc(1, 16);
	return 0;
}
int ncclCommInitRankConfig(void **comm, int n, uid id, int rank, config *cfg) {
	if (!idOK(id) || n != 2 || rank != 1) return 4;
	if (cfg->size != sizeof(config) || cfg->magic != 0xcafebeef || cfg->version != 21400) return 4;
	if (cfg->blocking != 0 || cfg->minCTAs != (int)0x80000000 || cfg->netName != 0) return 5;
	*comm = calloc(1, 16);
	return 7; // ncclInProgress
}
// Non-blocking init: in progress for the first two queries.
int ncclCommGetAsyncError(void *comm, int *res) {
	int *n = comm;
	*res = (*n)++ < 2 ? 7 : 0;
	return 0;
}
int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *comm, void *st) {
	if (n != 1 || dt != 7 || op != 0 || s != r) return 4;
	*(float *)r += 1.0f;
	return 0;
}
int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *comm, void *st) {
	if (root != 0 || s != r) return 4;
	if (n == 12345) return 6; // ncclRemoteError
	return 0;
}
int ncclCommAbort(void *c) { free(c); return 0; }
int ncclCommFinalize(void *c) { return 0; }
int ncclCommDestroy(void *c) { free(c); return 0; }

int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
int cudaGetDeviceCount(int *n) { *n = 1; return 0; }
int cudaSetDevice(int d) { return d == 0 ? 0 : 101; }
const char *cudaGetErrorString(int e) { return e == 101 ? "invalid device ordinal" : "stub cuda error"; }
int cudaMemGetInfo(size_t *f, size_t *t) { *f = (size_t)1 << 30; *t = (size_t)2 << 30; return 0; }
int cudaMalloc(void **p, size_t n) { if (n > ((size_t)1 << 40)) return 2; *p = malloc(n); return 0; }
int cudaFree(void *p) { free(p); return 0; }
int cudaMemset(void *p, int v, size_t n) { memset(p, v, n); return 0; }
int cudaMemsetAsync(void *p, int v, size_t n, void *s) { memset(p, v, n); return 0; }
int cudaHostAlloc(void **p, size_t n, unsigned int f) { *p = malloc(n); return 0; }
int cudaFreeHost(void *p) { free(p); return 0; }
int cudaHostRegister(void *p, size_t n, unsigned int f) { return 0; }
int cudaHostUnregister(void *p) { return 0; }
int cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, void *st) {
	if (kind < 1 || kind > 3) return 21;
	memcpy(d, s, n);
	return 0;
}
int cudaStreamCreateWithFlags(void **s, unsigned int f) { if (f != 1) return 1; *s = malloc(8); return 0; }
int cudaStreamDestroy(void *s) { free(s); return 0; }
int cudaStreamSynchronize(void *s) { return 0; }
static int q;
int cudaStreamQuery(void *s) { return (q++ % 2) ? 0 : 600; } // every other query: not ready
int cudaStreamWaitEvent(void *s, void *e, unsigned int f) { return f == 0 ? 0 : 1; }
int cudaEventCreateWithFlags(void **e, unsigned int f) { *e = malloc(8); return 0; }
int cudaEventRecord(void *e, void *s) { return 0; }
int cudaEventSynchronize(void *e) { return 0; }
int cudaEventQuery(void *e) { return 0; }
#ifndef OMIT_ELAPSED
int cudaEventElapsedTime(float *ms, void *a, void *b) { *ms = 1.5f; return 0; }
#endif
#ifdef V2_ELAPSED
int cudaEventElapsedTime_v2(float *ms, void *a, void *b) { *ms = 2.5f; return 0; }
#endif
int cudaEventDestroy(void *e) { free(e); return 0; }
int cudaDeviceSynchronize(void) { return 0; }
`

func buildStub(t *testing.T, name string, defines ...string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("gcc not found: cannot build the stub libraries")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "stub.c")
	if err := os.WriteFile(src, []byte(stubSource), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, name)
	args := append([]string{"-shared", "-fPIC", "-O1", "-o", out, src}, defines...)
	if b, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, b)
	}
	return out
}

func TestLoadStubLibraries(t *testing.T) {
	so := buildStub(t, "libstub.so")
	t.Setenv(EnvNCCLLib, "")
	t.Setenv(EnvCUDARTLib, "")
	lib, err := Load(Config{NCCLPath: so, CUDARTPath: so})
	if err != nil {
		t.Fatal(err)
	}
	if lib.NCCLPath() != so || lib.CUDARTPath() != so {
		t.Errorf("paths %q %q", lib.NCCLPath(), lib.CUDARTPath())
	}
	if v, err := lib.NCCLVersion(); err != nil || v != 22803 {
		t.Fatalf("version %d %v", v, err)
	}
	id, err := lib.GetUniqueID()
	if err != nil || id[5] != 36 {
		t.Fatalf("id %v %v", id[:8], err)
	}
	// Through a Comm: non-blocking init (InProgress twice), warm-up,
	// stream polling that sees "not ready", a broadcast, then close.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := NewComm(ctx, lib, 0, 2, 1, id)
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte("round trip through the shims")
	var back []byte
	err = c.Device().Do(ctx, func(api API) error {
		p, err := api.Malloc(len(payload))
		if err != nil {
			return err
		}
		defer api.Free(p)
		if err := api.MemcpyHtoDAsync(p, payload, c.Stream()); !errors.Is(err, ErrNotPinned) {
			t.Errorf("copy from Go memory: %v, want ErrNotPinned", err)
		}
		h, err := api.HostAlloc(2*len(payload), HostAllocPortable)
		if err != nil {
			return err
		}
		defer api.FreeHost(h)
		copy(h, payload)
		if err := api.MemcpyHtoDAsync(p, h[:len(payload)], c.Stream()); err != nil {
			return err
		}
		if err := api.MemcpyDtoHAsync(h[len(payload):], p, c.Stream()); err != nil {
			return err
		}
		back = append([]byte(nil), h[len(payload):]...)
		if err := c.Broadcast(ctx, p, len(payload), Uint8); err != nil {
			return err
		}
		e1, _ := api.EventCreate(EventDefault)
		e2, _ := api.EventCreate(EventDefault)
		defer api.EventDestroy(e1)
		defer api.EventDestroy(e2)
		if d, err := api.EventElapsedTime(e1, e2); err != nil || d != 1500*time.Microsecond {
			t.Errorf("elapsed %v %v", d, err)
		}
		if free, total, err := api.MemGetInfo(); err != nil || free != 1<<30 || total != 2<<30 {
			t.Errorf("meminfo %d %d %v", free, total, err)
		}
		err = api.SetDevice(7)
		var e *Error
		if !errors.As(err, &e) || e.Code != CudaErrorInvalidDevice || e.Detail != "invalid device ordinal" {
			t.Errorf("SetDevice(7): %v", err)
		}
		return api.SetDevice(0)
	})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, payload) {
		t.Fatalf("round trip %q", back)
	}
	// A synchronous NCCL failure aborts and poisons, with NCCL's last error.
	var p DevPtr
	_ = c.Device().Do(ctx, func(api API) error { p, err = api.Malloc(12345); return err })
	err = c.Broadcast(ctx, p, 12345, Uint8)
	if !errors.Is(err, RemoteError) || !errors.Is(err, ErrAborted) || !strings.Contains(err.Error(), "peer 1 closed the socket") {
		t.Fatalf("got %v", err)
	}
	_ = c.Device().Do(ctx, func(api API) error { return api.Free(p) })
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestLoadElapsedTimeV2Fallback(t *testing.T) {
	so := buildStub(t, "libstub.so", "-DOMIT_ELAPSED", "-DV2_ELAPSED")
	t.Setenv(EnvNCCLLib, "")
	t.Setenv(EnvCUDARTLib, "")
	lib, err := Load(Config{NCCLPath: so, CUDARTPath: so})
	if err != nil {
		t.Fatal(err)
	}
	if d, err := lib.EventElapsedTime(1, 2); err != nil || d != 2500*time.Microsecond {
		t.Fatalf("elapsed %v %v", d, err)
	}
}

func TestLoadErrorsNameLibraryAndOverride(t *testing.T) {
	t.Setenv(EnvCUDARTLib, "")
	t.Setenv(EnvNCCLLib, "/nonexistent/libnccl.so.2")
	_, err := Load(Config{})
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/libnccl.so.2") || !strings.Contains(err.Error(), EnvNCCLLib) {
		t.Fatalf("got %v", err)
	}

	// A library without a required symbol: the stub built without
	// cudaEventElapsedTime (and without its _v2 alternative).
	so := buildStub(t, "libstub.so", "-DOMIT_ELAPSED")
	t.Setenv(EnvNCCLLib, so)
	t.Setenv(EnvCUDARTLib, so)
	_, err = Load(Config{NCCLPath: "/ignored/because/env/wins"})
	if err == nil || !strings.Contains(err.Error(), "cudaEventElapsedTime") || !strings.Contains(err.Error(), EnvCUDARTLib) {
		t.Fatalf("got %v", err)
	}
	t.Logf("missing symbol: %v", err)

	// Default search on a machine without NCCL (skip where it exists).
	t.Setenv(EnvNCCLLib, "")
	t.Setenv(EnvCUDARTLib, "")
	if _, err := Load(Config{}); err != nil {
		if !strings.Contains(err.Error(), "RLFLOW_") {
			t.Fatalf("search failure should name the override: %v", err)
		}
		t.Logf("default search: %v", err)
	}
}
