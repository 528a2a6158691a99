//go:build linux && cgo

package cudaipc

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/nccl"
)

// stubRuntime stands in for libcudart with the real C signatures, so that
// the dlopen/dlsym machinery and the shims (the 64-byte handle passed by
// value, the out-pointer, the error name and string) run on a machine
// without a GPU. It accepts exactly the handle whose byte i is i*3+5 and
// maps it at an address of its own.
const stubRuntime = `
typedef struct { char reserved[64]; } handle_t;
static char block[4096];

int cudaIpcOpenMemHandle(void **p, handle_t h, unsigned int flags) {
	if (flags != 1) return 1; /* cudaErrorInvalidValue */
	for (int i = 0; i < 64; i++) if (h.reserved[i] != (char)(i * 3 + 5)) return 400;
	*p = block + 256;
	return 0;
}
#ifndef OMIT_CLOSE
int cudaIpcCloseMemHandle(void *p) { return p == block + 256 ? 0 : 205; }
#endif
const char *cudaGetErrorName(int e) {
	switch (e) {
	case 1: return "cudaErrorInvalidValue";
	case 205: return "cudaErrorMapBufferObjectFailed";
	case 400: return "cudaErrorInvalidResourceHandle";
	}
	return "cudaErrorUnknown";
}
const char *cudaGetErrorString(int e) {
	switch (e) {
	case 1: return "invalid argument";
	case 205: return "mapping of buffer object failed";
	case 400: return "invalid resource handle";
	}
	return "unknown error";
}
`

func buildStub(t *testing.T, defines ...string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("gcc not found: cannot build the stub CUDA runtime")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "stub.c")
	if err := os.WriteFile(src, []byte(stubRuntime), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "libcudart-stub.so")
	args := append([]string{"-shared", "-fPIC", "-O1", "-o", out, src}, defines...)
	if b, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, b)
	}
	return out
}

func stubHandle() MemHandle {
	var h MemHandle
	for i := range h {
		h[i] = byte(i*3 + 5)
	}
	return h
}

func TestImporterThroughStubRuntime(t *testing.T) {
	so := buildStub(t)
	// New's RTLD_NOLOAD: a runtime this process has not loaded is refused.
	if _, err := load(so, true); err == nil || !strings.Contains(err.Error(), so) {
		t.Fatalf("load of a runtime not yet loaded: %v, want an error naming %s", err, so)
	}
	im, err := load(so, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := load(so, true); err != nil {
		t.Fatalf("load of the now loaded runtime: %v", err)
	}

	p, err := im.Open(stubHandle())
	if err != nil || p == 0 {
		t.Fatalf("Open: %#x, %v", p, err)
	}
	if err := im.Close(p); err != nil {
		t.Fatalf("Close: %v", err)
	}

	cases := []struct {
		name string
		call func() error
		code nccl.CudaError
		want string
	}{
		{"open of a handle the runtime rejects", func() error {
			h := stubHandle()
			h[63] ^= 1 // the last byte must arrive too
			_, err := im.Open(h)
			return err
		}, nccl.CudaErrorInvalidHandle, "cudaipc: cudaIpcOpenMemHandle: cudaErrorInvalidResourceHandle: invalid resource handle"},
		{"close of a pointer not opened, code unknown to nccl", func() error {
			return im.Close(p + 1)
		}, nccl.CudaError(205), "cudaipc: cudaIpcCloseMemHandle: cudaError(205): cudaErrorMapBufferObjectFailed: mapping of buffer object failed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			var e *nccl.Error
			if !errors.Is(err, c.code) || !errors.As(err, &e) || err.Error() != c.want {
				t.Fatalf("got %v\nwant %s (errors.Is %d)", err, c.want, int(c.code))
			}
		})
	}
}

func TestImporterMissingSymbol(t *testing.T) {
	so := buildStub(t, "-DOMIT_CLOSE")
	_, err := load(so, false)
	if err == nil || !strings.Contains(err.Error(), "lacks symbol cudaIpcCloseMemHandle") || !strings.Contains(err.Error(), nccl.EnvCUDARTLib) {
		t.Fatalf("got %v", err)
	}
}

// The nccl.IPCImporter adapter reaches the runtime with the handle's bytes.
func TestOpenIPCThroughStubRuntime(t *testing.T) {
	im, err := load(buildStub(t), false)
	if err != nil {
		t.Fatal(err)
	}
	p, err := im.OpenIPC(nccl.IPCHandle{Kind: nccl.IPCCUDA, Mem: stubHandle()})
	if err != nil || p == 0 {
		t.Fatalf("OpenIPC: %#x, %v", p, err)
	}
	if err := im.CloseIPC(p); err != nil {
		t.Fatalf("CloseIPC: %v", err)
	}
	if _, err := im.OpenIPC(nccl.IPCHandle{Kind: nccl.IPCCUDA}); !errors.Is(err, nccl.CudaErrorInvalidHandle) {
		t.Fatalf("OpenIPC of a handle the runtime rejects: %v", err)
	}
}
