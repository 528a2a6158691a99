package tcpstore

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

func startServer(t *testing.T, opts Options) *Server {
	t.Helper()
	s, err := Listen(context.Background(), "127.0.0.1:0", opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func rawDial(t *testing.T, s *Server) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func dial(t *testing.T, s *Server) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func ctx5(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// hx decodes hex with spaces and "quoted" ASCII runs, as the spec writes
// transcripts: `04 0500000000000000 "init/"`.
func hx(t *testing.T, s string) []byte {
	t.Helper()
	var out []byte
	for len(s) > 0 {
		s = strings.TrimLeft(s, " \n\t")
		if s == "" {
			break
		}
		if s[0] == '"' {
			end := strings.IndexByte(s[1:], '"')
			out = append(out, s[1:1+end]...)
			s = s[end+2:]
			continue
		}
		end := strings.IndexAny(s, " \n\t\"")
		if end < 0 {
			end = len(s)
		}
		b, err := hex.DecodeString(s[:end])
		if err != nil {
			t.Fatalf("bad hex %q: %v", s[:end], err)
		}
		out = append(out, b...)
		s = s[end:]
	}
	return out
}

func write(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
}

func expect(t *testing.T, c net.Conn, want []byte) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("reading %d reply bytes: %v (got %x)", len(want), err, got)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("reply %x, want %x", got, want)
	}
}

func expectNothing(t *testing.T, c net.Conn, d time.Duration) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(d))
	var b [1]byte
	n, err := c.Read(b[:])
	if n > 0 {
		t.Fatalf("unexpected reply byte %#x", b[0])
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection ended early: %v", err)
	}
}

func expectClosed(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 1<<16)
	for {
		n, err := c.Read(b)
		if err == nil {
			_ = n
			continue // drain whatever was queued before the close
		}
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return
		}
		t.Fatalf("connection not closed by the server: %v", err)
	}
}

func (s *Server) numConns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *Server) numWaiting(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.waiters[key])
}
