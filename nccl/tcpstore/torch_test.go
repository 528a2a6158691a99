package tcpstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl/ncclid"
)

// torchPython returns a python with torch >= 2, or skips.
func torchPython(t *testing.T) string {
	t.Helper()
	py := os.Getenv("RLFLOW_PYTHON")
	if py == "" {
		py = "python3"
	}
	path, err := exec.LookPath(py)
	if err != nil {
		t.Skipf("skipping the real-torch TCPStore check: %s not found (set RLFLOW_PYTHON)", py)
	}
	out, err := exec.Command(path, "-c", "import torch, torch.distributed; print(torch.__version__)").CombinedOutput()
	if err != nil {
		t.Skipf("skipping the real-torch TCPStore check: %s cannot import torch.distributed (needs torch 2.x): %v", path, err)
	}
	ver := strings.TrimSpace(string(out))
	if i := strings.LastIndexByte(ver, '\n'); i >= 0 {
		ver = ver[i+1:]
	}
	if !strings.HasPrefix(ver, "2.") && !strings.HasPrefix(ver, "3.") {
		t.Skipf("skipping the real-torch TCPStore check: torch %s speaks the 1.x protocol; torch 2.x needed", ver)
	}
	t.Logf("using %s (torch %s)", path, ver)
	return path
}

// TestTorchClient runs tests/gpu/tcpstore_torch_client.py, a real
// torch.distributed.TCPStore client (use_libuv=False, as vLLM workers), against
// this server, playing rank 0's part from Go.
func TestTorchClient(t *testing.T) {
	py := torchPython(t)
	script := testutil.RepoFile(t, "tests/gpu/tcpstore_torch_client.py")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s, err := Listen(ctx, "127.0.0.1:0", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var id ncclid.ID
	for i := range id {
		id[i] = byte(255 - i)
	}
	const world = 3 // rank 0 (this test) + the script's two clients
	host, port, _ := strings.Cut(s.Addr().String(), ":")

	rank0 := make(chan error, 1)
	go func() {
		rank0 <- func() error {
			if err := s.WaitForAdds(ctx, InitKey, world-1); err != nil {
				return err
			}
			if err := waitForWaiter(ctx, s, UniqueIDKey); err != nil {
				return fmt.Errorf("rendezvous WAIT never arrived: %w", err)
			}
			s.Set(UniqueIDKey, ncclid.Pickle(id))
			if err := s.WaitForAdds(ctx, "/py/ready", 1); err != nil {
				return err
			}
			if err := waitForWaiter(ctx, s, "/go/release"); err != nil {
				return err
			}
			time.Sleep(300 * time.Millisecond)
			s.Set("/go/release", []byte("released"))
			return nil
		}()
	}()

	cmd := exec.CommandContext(ctx, py, script, "--host", host, "--port", port,
		"--world-size", fmt.Sprint(world), "--expect-id", hex.EncodeToString(id[:]))
	out, err := cmd.CombinedOutput()
	t.Logf("tcpstore_torch_client.py output:\n%s", out)
	if err != nil {
		t.Fatalf("torch client failed: %v", err)
	}
	if !strings.HasSuffix(strings.TrimSpace(string(out)), "PASS") {
		t.Fatal("torch client did not print PASS")
	}
	if err := <-rank0; err != nil {
		t.Fatal(err)
	}
	// Keys arrive with torch's "/" prefix; the worker counter does not.
	for key, want := range map[string]string{"/py/k": "v1", "/py/done": "1", "/py/ap": "abcd", InitKey: "2"} {
		if v, ok := s.Get(key); !ok || string(v) != want {
			t.Errorf("server key %q = %q (present %v), want %q", key, v, ok, want)
		}
	}
	if _, ok := s.Get("py/k"); ok {
		t.Error("key stored without the torch prefix")
	}
}

func waitForWaiter(ctx context.Context, s *Server, key string) error {
	for s.numWaiting(key) == 0 {
		select {
		case <-ctx.Done():
			return errors.New("timed out")
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// TestTorchWorkerTranscript records what a real torch worker sends (through a
// recording proxy in front of the server) and compares it with the spec's
// transcript, the one TestTorchTranscript replays.
func TestTorchWorkerTranscript(t *testing.T) {
	py := torchPython(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := Listen(ctx, "127.0.0.1:0", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var mu sync.Mutex
	var sent []byte
	go func() {
		in, err := ln.Accept()
		if err != nil {
			return
		}
		defer in.Close()
		out, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			return
		}
		defer out.Close()
		go io.Copy(in, out)
		buf := make([]byte, 4096)
		for {
			n, err := in.Read(buf)
			mu.Lock()
			sent = append(sent, buf[:n]...)
			mu.Unlock()
			if _, werr := out.Write(buf[:n]); err != nil || werr != nil {
				return
			}
		}
	}()
	pickle := ncclid.Pickle(ncclid.ID{1, 2, 3})
	go func() {
		if s.WaitForAdds(ctx, InitKey, 1) == nil && waitForWaiter(ctx, s, UniqueIDKey) == nil {
			s.Set(UniqueIDKey, pickle)
		}
	}()
	host, port, _ := strings.Cut(ln.Addr().String(), ":")
	code := fmt.Sprintf(`import os, sys, datetime, torch.distributed as dist
s = dist.TCPStore(%q, %s, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=60), use_libuv=False)
v = s.get("broadcast_from/0/0")
sys.stdout.write("pid=%%d len=%%d\n" %% (os.getpid(), len(v)))
`, host, port)
	out, err := exec.CommandContext(ctx, py, "-c", code).CombinedOutput()
	t.Logf("python: %s", out)
	if err != nil {
		t.Fatal(err)
	}
	var pid uint32
	if _, err := fmt.Sscanf(string(out[strings.Index(string(out), "pid="):]), "pid=%d len=247", &pid); err != nil {
		t.Fatalf("python output %q: %v", out, err)
	}
	want := hx(t, tValidate)
	want = append(want, qPing)
	want = binary.LittleEndian.AppendUint32(want, pid)
	want = append(want, hx(t, tAdd+" "+tWait+" "+tGet)...)
	mu.Lock()
	got := append([]byte(nil), sent...)
	mu.Unlock()
	if !bytes.Equal(got, want) {
		t.Fatalf("torch worker sent\n%x\nwant (spec transcript)\n%x", got, want)
	}
	t.Logf("torch worker bytes match the spec transcript (%d bytes)", len(got))
}
