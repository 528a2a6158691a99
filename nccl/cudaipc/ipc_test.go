package cudaipc

import (
	"errors"
	"testing"

	"github.com/rlflow/rlflow/nccl"
)

// OpenIPC refuses every kind but cuda before it reaches the runtime (the
// zero Importer has none: a call into it would crash).
func TestOpenIPCRefusesOtherKinds(t *testing.T) {
	im := &Importer{}
	cases := []struct {
		kind, want string
	}{
		{nccl.IPCFakeShm, "cudaipc: a fake_shm snapshot (a TEST DOUBLE) cannot be opened on a real GPU: nccl: IPC handle of a kind this importer does not open"},
		{"rocm", `cudaipc: IPC kind "rocm": want "cuda": nccl: IPC handle of a kind this importer does not open`},
		{"", `cudaipc: IPC kind "": want "cuda": nccl: IPC handle of a kind this importer does not open`},
	}
	for _, c := range cases {
		p, err := im.OpenIPC(nccl.IPCHandle{Kind: c.kind, Path: "/dev/shm/x", Bytes: 8})
		if p != 0 || !errors.Is(err, nccl.ErrIPCKind) || err.Error() != c.want {
			t.Errorf("kind %q: %#x, %v\nwant %s", c.kind, p, err, c.want)
		}
	}
}
