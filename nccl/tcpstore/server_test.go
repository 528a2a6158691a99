package tcpstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/rlflow/rlflow/nccl/ncclid"
)

func testPickle() []byte {
	var id ncclid.ID
	for i := range id {
		id[i] = byte(i * 7)
	}
	return ncclid.Pickle(id)
}

// The torch 2.11 worker transcript of the spec, section 5.
const (
	tValidate = `00 cef7853c`
	tPing     = `0d 2a3b4c5d`
	tAdd      = `04 0500000000000000 "init/" 0100000000000000`
	tWait     = `06 0100000000000000 1300000000000000 "/broadcast_from/0/0"`
	tGet      = `03 1300000000000000 "/broadcast_from/0/0"`
)

func TestTorchTranscript(t *testing.T) {
	pickle := testPickle()
	getReply := append(hx(t, `f700000000000000`), pickle...)
	modes := []struct {
		name string
		send func(t *testing.T, c net.Conn, b []byte)
	}{
		{"frame-per-write", write},
		{"byte-per-write", func(t *testing.T, c net.Conn, b []byte) {
			for i := range b {
				write(t, c, b[i:i+1])
			}
		}},
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			s := startServer(t, Options{})
			c := rawDial(t, s)
			m.send(t, c, hx(t, tValidate))
			m.send(t, c, hx(t, tPing))
			expect(t, c, hx(t, `2a3b4c5d`))
			m.send(t, c, hx(t, tAdd))
			expect(t, c, hx(t, `0100000000000000`))
			m.send(t, c, hx(t, tWait))
			expectNothing(t, c, 100*time.Millisecond) // deferred until the key exists
			testutil.Eventually(t, 5*time.Second, "the WAIT to register", func() bool { return s.numWaiting(UniqueIDKey) == 1 })
			s.Set(UniqueIDKey, pickle)
			expect(t, c, hx(t, `00`))
			m.send(t, c, hx(t, tGet))
			expect(t, c, getReply)
			expectNothing(t, c, 50*time.Millisecond) // then idle, connected
			if s.numConns() != 1 {
				t.Fatalf("conns = %d", s.numConns())
			}
		})
	}
	t.Run("pipelined-second-worker", func(t *testing.T) {
		s := startServer(t, Options{})
		first := rawDial(t, s)
		write(t, first, hx(t, tValidate+" "+tPing+" "+tAdd+" "+tWait))
		expect(t, first, hx(t, `2a3b4c5d 0100000000000000`))
		s.Set(UniqueIDKey, pickle)
		expect(t, first, hx(t, `00`))
		// A worker arriving after the publication gets everything at once.
		second := rawDial(t, s)
		write(t, second, hx(t, tValidate+" "+tPing+" "+tAdd+" "+tWait+" "+tGet))
		expect(t, second, append(hx(t, `2a3b4c5d 0200000000000000 00`), getReply...))
		ctx := ctx5(t)
		if err := s.WaitForAdds(ctx, InitKey, 2); err != nil {
			t.Fatal(err)
		}
		if v, _ := s.Get(InitKey); string(v) != "2" {
			t.Fatalf("init/ = %q, want ASCII decimal 2", v)
		}
	})
}

func TestClientQueries(t *testing.T) {
	s := startServer(t, Options{})
	c := dial(t, s)
	ctx := ctx5(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	eq := func(got, want any) {
		t.Helper()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
	must(c.Ping(ctx))
	must(c.Set(ctx, "/a", []byte("1")))
	v, err := c.Get(ctx, "/a")
	must(err)
	eq(string(v), "1")
	v, err = c.Get(ctx, "/missing")
	must(err)
	eq(len(v), 0)

	n, err := c.Add(ctx, "/n", 5)
	must(err)
	eq(n, 5)
	n, err = c.Add(ctx, "/n", -7)
	must(err)
	eq(n, -2)
	v, _ = s.Get("/n")
	eq(string(v), "-2")

	ok, err := c.Check(ctx, "/a", "/n")
	must(err)
	eq(ok, true)
	ok, err = c.Check(ctx, "/a", "/nope")
	must(err)
	eq(ok, false)
	ok, err = c.Check(ctx)
	must(err)
	eq(ok, true)

	must(c.Wait(ctx, "/a"))
	must(c.Wait(ctx))

	// COMPARE_SET: the three PyTorch cases.
	v, err = c.CompareSet(ctx, "/cs", nil, []byte("first"))
	must(err)
	eq(string(v), "first")
	v, err = c.CompareSet(ctx, "/cs", []byte("wrong"), []byte("x"))
	must(err)
	eq(string(v), "first")
	v, err = c.CompareSet(ctx, "/cs", []byte("first"), []byte("second"))
	must(err)
	eq(string(v), "second")
	v, err = c.CompareSet(ctx, "/cs-missing", []byte("exp"), []byte("x"))
	must(err)
	eq(string(v), "exp")
	if _, ok := s.Get("/cs-missing"); ok {
		t.Fatal("COMPARE_SET with non-empty expected created the key")
	}

	num, err := c.NumKeys(ctx)
	must(err)
	eq(num, 3) // /a /n /cs

	must(c.Append(ctx, "/ap", []byte("ab")))
	must(c.Append(ctx, "/ap", []byte("cd")))
	v, _ = c.Get(ctx, "/ap")
	eq(string(v), "abcd")

	must(c.MultiSet(ctx, []string{"/m1", "/m2", "/m3"}, [][]byte{[]byte("x"), {}, []byte("zz")}))
	vs, err := c.MultiGet(ctx, "/m3", "/m1", "/m2", "/nope")
	must(err)
	eq(fmt.Sprintf("%q", vs), `["zz" "x" "" ""]`)
	if err := c.MultiSet(ctx, []string{"/a"}, nil); err == nil {
		t.Fatal("mismatched MultiSet accepted")
	}

	del, err := c.DeleteKey(ctx, "/m1")
	must(err)
	eq(del, true)
	del, err = c.DeleteKey(ctx, "/m1")
	must(err)
	eq(del, false)
	num, _ = c.NumKeys(ctx)
	eq(num, 6) // /a /n /cs /ap /m2 /m3

	// Binary keys and values survive.
	bin := string([]byte{0, 1, 2, 0xff})
	must(c.Set(ctx, bin, []byte{0, 0, 0}))
	v, _ = c.Get(ctx, bin)
	eq(fmt.Sprint(v), "[0 0 0]")

	// ADD on a non-integer closes the connection (torch throws).
	must(c.Set(ctx, "/text", []byte("abc")))
	if _, err := c.Add(ctx, "/text", 1); err == nil {
		t.Fatal("ADD on text succeeded")
	}
	if err := c.Ping(ctx); err == nil || !strings.Contains(err.Error(), "unusable") {
		t.Fatalf("client after failure: %v", err)
	}
	c2 := dial(t, s)
	must(c2.Ping(ctx))
}

func TestJoinAsWorker(t *testing.T) {
	s := startServer(t, Options{})
	const workers = 3
	var wg sync.WaitGroup
	got := make([][]byte, workers)
	errs := make([]error, workers)
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, err := Dial(ctx, s.Addr().String())
			if err != nil {
				errs[i] = err
				return
			}
			defer c.Close()
			got[i], errs[i] = c.JoinAsWorker(ctx)
		}()
	}
	ctx := ctx5(t)
	if err := s.WaitForAdds(ctx, InitKey, workers); err != nil {
		t.Fatal(err)
	}
	s.Set(UniqueIDKey, testPickle())
	wg.Wait()
	for i := range workers {
		if errs[i] != nil || !bytes.Equal(got[i], testPickle()) {
			t.Fatalf("worker %d: %v", i, errs[i])
		}
	}
}

func TestConcurrentClients(t *testing.T) {
	s := startServer(t, Options{})
	const n = 64
	var wg sync.WaitGroup
	errc := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			c, err := Dial(ctx, s.Addr().String())
			if err != nil {
				errc <- err
				return
			}
			defer c.Close()
			if _, err := c.Add(ctx, "/count", 1); err != nil {
				errc <- err
				return
			}
			mine := fmt.Sprintf("/k%d", i)
			if err := c.Set(ctx, mine, []byte(mine)); err != nil {
				errc <- err
				return
			}
			if err := c.Wait(ctx, "/go", fmt.Sprintf("/k%d", (i+1)%n)); err != nil {
				errc <- err
				return
			}
			v, err := c.Get(ctx, "/go")
			if err != nil || string(v) != "go" {
				errc <- fmt.Errorf("client %d: %q %v", i, v, err)
			}
		}()
	}
	ctx := ctx5(t)
	if err := s.WaitForAdds(ctx, "/count", n); err != nil {
		t.Fatal(err)
	}
	s.Set("/go", []byte("go"))
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
}

func TestCancelWait(t *testing.T) {
	s := startServer(t, Options{})
	t.Run("raw", func(t *testing.T) {
		c := rawDial(t, s)
		write(t, c, hx(t, tValidate))
		write(t, c, hx(t, `06 0100000000000000 0200000000000000 "/x"`))
		expectNothing(t, c, 50*time.Millisecond)
		write(t, c, hx(t, `0c`))
		expect(t, c, hx(t, `01`))
		s.Set("/x", []byte("v"))
		expectNothing(t, c, 50*time.Millisecond) // the cancelled wait never fires
		if n := s.numWaiting("/x"); n != 0 {
			t.Fatalf("waiters left: %d", n)
		}
	})
	t.Run("late-wakeup-precedes-cancel", func(t *testing.T) {
		c := rawDial(t, s)
		write(t, c, hx(t, tValidate))
		write(t, c, hx(t, `06 0100000000000000 0200000000000000 "/y"`))
		testutil.Eventually(t, 5*time.Second, "wait", func() bool { return s.numWaiting("/y") == 1 })
		s.Set("/y", []byte("v"))
		write(t, c, hx(t, `0c`))
		expect(t, c, hx(t, `00 01`))
	})
	t.Run("client-timeout", func(t *testing.T) {
		c := dial(t, s)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := c.Wait(ctx, "/never")
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Wait = %v", err)
		}
		if d := time.Since(start); d < 90*time.Millisecond || d > 3*time.Second {
			t.Fatalf("Wait returned after %v", d)
		}
		if n := s.numWaiting("/never"); n != 0 {
			t.Fatalf("waiters left: %d", n)
		}
		// Still usable, and no stray reply confuses the next request.
		ctx2 := ctx5(t)
		if err := c.Ping(ctx2); err != nil {
			t.Fatal(err)
		}
		s.Set("/never", []byte("now"))
		v, err := c.Get(ctx2, "/never")
		if err != nil || string(v) != "now" {
			t.Fatalf("Get = %q, %v", v, err)
		}
	})
	t.Run("client-cancel", func(t *testing.T) {
		c := dial(t, s)
		ctx, cancel := context.WithCancel(context.Background())
		go func() { time.Sleep(50 * time.Millisecond); cancel() }()
		if err := c.Wait(ctx, "/never2"); !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait = %v", err)
		}
		if err := c.Ping(ctx5(t)); err != nil {
			t.Fatal(err)
		}
	})
}

func TestWaitSemantics(t *testing.T) {
	s := startServer(t, Options{})
	c := rawDial(t, s)
	write(t, c, hx(t, tValidate))
	// Duplicate keys count twice, already-present keys not at all; each
	// completed WAIT answers once.
	s.Set("/have", nil)
	write(t, c, hx(t, `06 0300000000000000 0200000000000000 "/p" 0500000000000000 "/have" 0200000000000000 "/q"`))
	write(t, c, hx(t, `06 0100000000000000 0200000000000000 "/q"`))
	expectNothing(t, c, 50*time.Millisecond)
	s.Set("/q", nil)
	expect(t, c, hx(t, `00`)) // the second WAIT
	expectNothing(t, c, 50*time.Millisecond)
	other := dial(t, s)
	ctx := ctx5(t)
	if _, err := other.Add(ctx, "/p", 1); err != nil { // ADD wakes too
		t.Fatal(err)
	}
	expect(t, c, hx(t, `00`))
	// APPEND and COMPARE_SET creating a key wake waiters.
	write(t, c, hx(t, `06 0200000000000000 0200000000000000 "/r" 0200000000000000 "/s"`))
	testutil.Eventually(t, 5*time.Second, "wait", func() bool { return s.numWaiting("/s") == 1 })
	other.Append(ctx, "/r", []byte("x"))
	if _, err := other.CompareSet(ctx, "/s", nil, []byte("y")); err != nil {
		t.Fatal(err)
	}
	expect(t, c, hx(t, `00`))
	// A deleted key must be set again before a WAIT completes.
	other.DeleteKey(ctx, "/r")
	write(t, c, hx(t, `06 0100000000000000 0200000000000000 "/r"`))
	expectNothing(t, c, 50*time.Millisecond)
	other.Set(ctx, "/r", nil)
	expect(t, c, hx(t, `00`))
}

func TestLimitsAndGarbage(t *testing.T) {
	opts := Options{MaxKeyBytes: 16, MaxValueBytes: 64, MaxKeysPerRequest: 4, MaxRequestBytes: 200, MaxWaitsPerConn: 2}
	s := startServer(t, opts)
	u64 := func(n uint64) string {
		return fmt.Sprintf("%016x", binary.BigEndian.Uint64(binary.LittleEndian.AppendUint64(nil, n)))
	}
	long := strings.Repeat("k", 17)
	tests := []struct {
		name     string
		validate bool
		send     string
	}{
		{"no-validate", false, tPing},
		{"wrong-magic", false, `00 cef7853d`},
		{"legacy-torch1-add", false, `03 0500000000000000 "init/" 0100000000000000`},
		{"unknown-query-14", true, `0e`},
		{"unknown-query-ff", true, `ff 00 00`},
		{"key-too-long", true, `03 ` + u64(17) + ` "` + long + `"`},
		{"key-length-huge", true, `03 ffffffffffffffff`},
		{"value-too-long", true, `01 0100000000000000 "k" ` + u64(65)},
		{"compare-set-value-too-long", true, `02 0100000000000000 "k" 0000000000000000 ` + u64(65)},
		{"too-many-keys", true, `06 ` + u64(5)},
		{"multi-set-count-negative", true, `0b ffffffffffffffff`},
		{"frame-too-large", true, `0b 0300000000000000` + strings.Repeat(` 0100000000000000 "k" 4000000000000000 "`+strings.Repeat("v", 64)+`"`, 3)},
		{"too-many-waits", true, strings.Repeat(`06 0100000000000000 0100000000000000 "w" `, 3)},
		{"append-over-limit", true, `09 0100000000000000 "a" 2000000000000000 "` + strings.Repeat("x", 32) + `" 09 0100000000000000 "a" 2100000000000000 "` + strings.Repeat("x", 33) + `"`},
	}
	// A healthy client with a pending wait, to show nobody else is disturbed.
	good := dial(t, s)
	waitDone := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		waitDone <- good.Wait(ctx, "/release")
	}()
	testutil.Eventually(t, 5*time.Second, "the good wait", func() bool { return s.numWaiting("/release") == 1 })
	idle := rawDial(t, s)
	write(t, idle, hx(t, tValidate))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := rawDial(t, s)
			if tc.validate {
				write(t, c, hx(t, tValidate))
			}
			write(t, c, hx(t, tc.send))
			expectClosed(t, c)
		})
	}
	testutil.Eventually(t, 5*time.Second, "bad connections to go", func() bool { return s.numConns() == 2 })
	other := dial(t, s)
	ctx := ctx5(t)
	if err := other.Set(ctx, "/release", []byte("ok")); err != nil {
		t.Fatal(err)
	}
	if err := <-waitDone; err != nil {
		t.Fatalf("the good client's wait: %v", err)
	}
	if v, err := good.Get(ctx, "/release"); err != nil || string(v) != "ok" {
		t.Fatalf("good client: %q %v", v, err)
	}
	write(t, idle, hx(t, tPing))
	expect(t, idle, hx(t, `2a3b4c5d`))
	// Limits at exactly the boundary are fine.
	k16 := strings.Repeat("k", 16)
	if err := other.Set(ctx, k16, bytes.Repeat([]byte{1}, 64)); err != nil {
		t.Fatal(err)
	}
	if v, err := other.Get(ctx, k16); err != nil || len(v) != 64 {
		t.Fatalf("boundary value: %d %v", len(v), err)
	}
	if _, err := other.MultiGet(ctx, "a", "b", "c", "d"); err != nil {
		t.Fatal(err)
	}
}

func TestReadTimeoutOnlyMidFrame(t *testing.T) {
	s := startServer(t, Options{ReadTimeout: 150 * time.Millisecond})
	idle := rawDial(t, s)
	write(t, idle, hx(t, tValidate))
	stalled := rawDial(t, s)
	write(t, stalled, hx(t, tValidate))
	write(t, stalled, hx(t, `05 0100000000000000 0500`)) // CHECK, stalls inside a key length
	start := time.Now()
	expectClosed(t, stalled)
	if d := time.Since(start); d < 100*time.Millisecond || d > 3*time.Second {
		t.Fatalf("stalled connection closed after %v", d)
	}
	// A slowloris sending one byte at a time is bounded by the frame deadline.
	slow := rawDial(t, s)
	write(t, slow, hx(t, tValidate))
	frame := hx(t, `01 0100000000000000 "k" 0400000000000000 "vvvv"`)
	closed := false
	for _, b := range frame[:len(frame)-1] {
		if _, err := slow.Write([]byte{b}); err != nil {
			closed = true
			break
		}
		time.Sleep(30 * time.Millisecond)
	}
	if !closed {
		expectClosed(t, slow)
	}
	time.Sleep(100 * time.Millisecond)
	write(t, idle, hx(t, tPing)) // idle well past ReadTimeout, still served
	expect(t, idle, hx(t, `2a3b4c5d`))
}

func TestMaxConns(t *testing.T) {
	s := startServer(t, Options{MaxConns: 2})
	a, b := dial(t, s), dial(t, s)
	c := rawDial(t, s)
	write(t, c, hx(t, tValidate+" "+tPing))
	expectClosed(t, c)
	ctx := ctx5(t)
	if err := a.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	b.Close()
	testutil.Eventually(t, 5*time.Second, "a free slot", func() bool { return s.numConns() == 1 })
	dial(t, s)
}

func TestSlowReaderIsClosed(t *testing.T) {
	s := startServer(t, Options{MaxPendingBytes: 1 << 20})
	setter := dial(t, s)
	ctx := ctx5(t)
	if err := setter.Set(ctx, "/big", bytes.Repeat([]byte{7}, 256<<10)); err != nil {
		t.Fatal(err)
	}
	// SET has no reply: without this round trip the GETs below, on another
	// connection, could be handled first and get the empty value of a
	// missing key, 8 bytes each, which no backlog limit catches.
	if err := setter.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	c := rawDial(t, s)
	write(t, c, hx(t, tValidate))
	get := hx(t, `03 0400000000000000 "/big"`)
	go func() {
		for range 1024 { // 256 MiB of replies, never read
			if _, err := c.Write(get); err != nil {
				return
			}
		}
	}()
	testutil.Eventually(t, 5*time.Second, "the slow reader to be dropped", func() bool { return s.numConns() == 1 })
	if err := setter.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestStoreLimits(t *testing.T) {
	s := startServer(t, Options{MaxKeys: 2, MaxStoreBytes: 100})
	ctx := ctx5(t)
	c := dial(t, s)
	c.Set(ctx, "/a", nil)
	c.Set(ctx, "/b", nil)
	c.Set(ctx, "/a", []byte("replace is fine"))
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	c.Set(ctx, "/c", nil)
	if err := c.Ping(ctx); err == nil {
		t.Fatal("third key accepted")
	}
	c2 := dial(t, s)
	c2.Set(ctx, "/b", bytes.Repeat([]byte{1}, 90))
	if err := c2.Ping(ctx); err == nil {
		t.Fatal("store byte limit not enforced")
	}
	if v, _ := s.Get("/b"); len(v) != 0 {
		t.Fatal("over-limit SET applied")
	}
}

func TestWaitForAdds(t *testing.T) {
	s := startServer(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := s.WaitForAdds(ctx, InitKey, 1)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), `"init/" to reach 1 (now 0)`) {
		t.Fatalf("err = %v", err)
	}
	c := dial(t, s)
	go func() {
		time.Sleep(20 * time.Millisecond)
		c.Add(context.Background(), InitKey, 1)
		c.Add(context.Background(), InitKey, 1)
	}()
	if err := s.WaitForAdds(ctx5(t), InitKey, 2); err != nil {
		t.Fatal(err)
	}
	s.Set("/text", []byte("x"))
	if err := s.WaitForAdds(ctx5(t), "/text", 1); err == nil {
		t.Fatal("non-counter accepted")
	}
	done := make(chan error)
	go func() { done <- s.WaitForAdds(context.Background(), "/never", 1) }()
	time.Sleep(20 * time.Millisecond)
	s.Close()
	if err := <-done; err == nil || !strings.Contains(err.Error(), "server closed") {
		t.Fatalf("after Close: %v", err)
	}
}

func TestListenAddress(t *testing.T) {
	for _, addr := range []string{":0", "nonsense"} {
		if s, err := Listen(context.Background(), addr, Options{}); err == nil {
			s.Close()
			t.Errorf("Listen(%q) accepted", addr)
		}
	}
	s := startServer(t, Options{})
	if host, _, _ := net.SplitHostPort(s.Addr().String()); host != "127.0.0.1" {
		t.Fatalf("bound %s", s.Addr())
	}
}

func TestCloseWaitsForEverything(t *testing.T) {
	before := runtime.NumGoroutine()
	s, err := Listen(context.Background(), "127.0.0.1:0", Options{})
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	for range 10 {
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		write(t, c, hx(t, tValidate+" "+tWait))
		conns = append(conns, c)
	}
	testutil.Eventually(t, 5*time.Second, "waits", func() bool { return s.numWaiting(UniqueIDKey) == 10 })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, c := range conns {
		expectClosed(t, c)
	}
	if _, err := net.Dial("tcp", s.Addr().String()); err == nil {
		t.Fatal("still accepting")
	}
	testutil.Eventually(t, 5*time.Second, "goroutines to exit", func() bool { return runtime.NumGoroutine() <= before })
}

func TestContextShutsDown(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	s, err := Listen(ctx, "127.0.0.1:0", Options{})
	if err != nil {
		t.Fatal(err)
	}
	c := rawDial(t, s)
	write(t, c, hx(t, tValidate))
	cancel()
	expectClosed(t, c)
	s.Close()
}

func TestClientHonoursDeadline(t *testing.T) {
	// A server that accepts and never answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = Dial(ctx, ln.Addr().String())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial = %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("Dial took %v", d)
	}
}
