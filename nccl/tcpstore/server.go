package tcpstore

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"
)

// Options bound what clients may do. Zero fields take the defaults shown.
type Options struct {
	MaxKeyBytes   int // 8 KiB, PyTorch's libuv server limit
	MaxValueBytes int // 8 MiB, likewise; also bounds a value grown by APPEND
	// MaxKeysPerRequest bounds the key count of CHECK, WAIT, MULTI_GET and
	// MULTI_SET (128 Ki, PyTorch's limit).
	MaxKeysPerRequest int
	MaxRequestBytes   int   // one frame, all fields together: 64 MiB
	MaxConns          int   // open connections: 1024; more are closed at once
	MaxKeys           int   // keys in the store: 1 Mi
	MaxStoreBytes     int64 // keys and values in the store: 1 GiB
	// MaxWaitsPerConn bounds the WAITs one connection may have pending (64).
	MaxWaitsPerConn int
	// MaxPendingBytes bounds the replies queued for a connection that does
	// not read them (64 MiB).
	MaxPendingBytes int
	// ReadTimeout bounds how long a frame may take to arrive once its first
	// byte has (30s). Idle connections between frames are never timed out.
	ReadTimeout time.Duration
	// WriteTimeout bounds one write of queued replies (30s).
	WriteTimeout time.Duration
}

func (o Options) withDefaults() Options {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.MaxKeyBytes, 8<<10)
	def(&o.MaxValueBytes, 8<<20)
	def(&o.MaxKeysPerRequest, 128<<10)
	def(&o.MaxRequestBytes, 64<<20)
	def(&o.MaxConns, 1024)
	def(&o.MaxKeys, 1<<20)
	def(&o.MaxWaitsPerConn, 64)
	def(&o.MaxPendingBytes, 64<<20)
	if o.MaxStoreBytes <= 0 {
		o.MaxStoreBytes = 1 << 30
	}
	if o.ReadTimeout <= 0 {
		o.ReadTimeout = 30 * time.Second
	}
	if o.WriteTimeout <= 0 {
		o.WriteTimeout = 30 * time.Second
	}
	return o
}

// Server is a TCPStore master. Its methods are safe for concurrent use.
type Server struct {
	opts Options
	ln   net.Listener
	stop func() bool // detaches the Listen context

	mu         sync.Mutex
	store      map[string][]byte
	storeBytes int64
	waiters    map[string][]*waiter // key -> waits missing it (once per occurrence)
	changed    chan struct{}        // closed and replaced on every store change
	conns      map[*conn]struct{}
	closed     bool

	wg sync.WaitGroup
}

// waiter is one pending WAIT.
type waiter struct {
	c         *conn
	remaining int
}

// Listen starts a server bound to exactly addr ("127.0.0.1:0", "10.0.0.5:29500",
// "[::1]:0"). An address without a host is refused: binding every interface
// must be asked for explicitly ("0.0.0.0:port"). When ctx is done the server
// shuts down as if Close had been called; Close must still be called.
func Listen(ctx context.Context, addr string, opts Options) (*Server, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("tcpstore: listen address %q: %w", addr, err)
	}
	if host == "" {
		return nil, fmt.Errorf("tcpstore: listen address %q has no host; give the address to bind (0.0.0.0 for all interfaces)", addr)
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcpstore: listen: %w", err)
	}
	s := &Server{
		opts:    opts.withDefaults(),
		ln:      ln,
		store:   map[string][]byte{},
		waiters: map[string][]*waiter{},
		changed: make(chan struct{}),
		conns:   map[*conn]struct{}{},
	}
	s.stop = context.AfterFunc(ctx, s.shutdown)
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

// Addr is the bound address (with the actual port for ":0").
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Close stops listening, closes every connection and waits for all of the
// server's goroutines to exit.
func (s *Server) Close() error {
	s.stop()
	err := s.closeServer()
	s.wg.Wait()
	return err
}

func (s *Server) shutdown() { _ = s.closeServer() }

func (s *Server) closeServer() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	conns := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	close(s.changed) // wake WaitForAdds
	s.changed = make(chan struct{})
	s.mu.Unlock()
	err := s.ln.Close()
	for _, c := range conns {
		c.kill()
	}
	if err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("tcpstore: close listener: %w", err)
	}
	return nil
}

// Set stores value under the wire key (e.g. "/broadcast_from/0/0") and
// wakes the waits it completes. It is not subject to the client limits.
func (s *Server) Set(key string, value []byte) {
	v := append([]byte(nil), value...)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.put(key, v)
}

// Get returns a copy of the value under the wire key.
func (s *Server) Get(key string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.store[key]
	return append([]byte(nil), v...), ok
}

// WaitForAdds waits until the counter under the wire key (maintained by
// ADD, e.g. "init/", to which every torch worker adds 1 on connecting)
// reaches at least n. It fails when ctx is done or the server closes.
func (s *Server) WaitForAdds(ctx context.Context, key string, n int64) error {
	for {
		s.mu.Lock()
		v, ok := s.store[key]
		closed, ch := s.closed, s.changed
		s.mu.Unlock()
		var cur int64
		if ok {
			var err error
			cur, err = strconv.ParseInt(string(v), 10, 64)
			if err != nil {
				return fmt.Errorf("tcpstore: wait for %q to reach %d: value %q is not a counter", key, n, v)
			}
			if cur >= n {
				return nil
			}
		}
		if closed {
			return fmt.Errorf("tcpstore: wait for %q to reach %d (now %d): server closed", key, n, cur)
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("tcpstore: wait for %q to reach %d (now %d): %w", key, n, cur, context.Cause(ctx))
		}
	}
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	var backoff time.Duration
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient (EMFILE, ECONNABORTED...): back off like net/http.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		c := newConn(s, nc)
		s.mu.Lock()
		if s.closed || len(s.conns) >= s.opts.MaxConns {
			s.mu.Unlock()
			nc.Close()
			continue
		}
		s.conns[c] = struct{}{}
		s.wg.Add(2)
		s.mu.Unlock()
		go c.readLoop()
		go c.writeLoop()
	}
}

// Store operations; s.mu held.

func (s *Server) notify() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// put stores v and wakes the waits for key.
func (s *Server) put(key string, v []byte) {
	if old, ok := s.store[key]; ok {
		s.storeBytes -= int64(len(old))
	} else {
		s.storeBytes += int64(len(key))
	}
	s.store[key] = v
	s.storeBytes += int64(len(v))
	s.wake(key)
	s.notify()
}

// fits reports whether storing a value of n bytes under key stays within
// the store limits.
func (s *Server) fits(key string, n int) bool {
	old, ok := s.store[key]
	if !ok && len(s.store) >= s.opts.MaxKeys {
		return false
	}
	grow := int64(n) - int64(len(old))
	if !ok {
		grow += int64(len(key))
	}
	return s.storeBytes+grow <= s.opts.MaxStoreBytes
}

func (s *Server) wake(key string) {
	ws := s.waiters[key]
	if len(ws) == 0 {
		return
	}
	delete(s.waiters, key)
	for _, w := range ws {
		w.remaining--
		if w.remaining == 0 {
			delete(w.c.waits, w)
			w.c.send([]byte{waitStop})
		}
	}
}

// dropWaits forgets every pending wait of c.
func (s *Server) dropWaits(c *conn) {
	for w := range c.waits {
		w.remaining = -1 // never fires again
		delete(c.waits, w)
	}
	for key, ws := range s.waiters {
		kept := ws[:0]
		for _, w := range ws {
			if w.c != c {
				kept = append(kept, w)
			}
		}
		if len(kept) == 0 {
			delete(s.waiters, key)
		} else {
			s.waiters[key] = kept
		}
	}
}

func (s *Server) allExist(keys []string) bool {
	for _, k := range keys {
		if _, ok := s.store[k]; !ok {
			return false
		}
	}
	return true
}

// handle executes one request from c; s.mu held. An error closes c.
func (s *Server) handle(c *conn, r *request) error {
	if !c.validated {
		if r.q != qValidate {
			return protoErr("first request is %s, want VALIDATE", queryName(r.q))
		}
	}
	switch r.q {
	case qValidate:
		if r.u32 != ValidationMagic {
			return protoErr("VALIDATE magic %#x, want %#x", r.u32, ValidationMagic)
		}
		c.validated = true
	case qPing:
		c.send(binary.LittleEndian.AppendUint32(nil, r.u32))
	case qSet:
		if !s.fits(r.keys[0], len(r.values[0])) {
			return protoErr("SET %q: store limits reached", r.keys[0])
		}
		s.put(r.keys[0], r.values[0])
	case qCompareSet:
		key, expected, desired := r.keys[0], r.values[0], r.values[1]
		cur, ok := s.store[key]
		switch {
		case !ok && len(expected) == 0, ok && string(cur) == string(expected):
			if !s.fits(key, len(desired)) {
				return protoErr("COMPARE_SET %q: store limits reached", key)
			}
			s.put(key, desired)
			c.send(appendBytes(nil, desired))
		case !ok:
			// PyTorch answers the expected value for a missing key.
			c.send(appendBytes(nil, expected))
		default:
			c.send(appendBytes(nil, cur))
		}
	case qGet:
		c.send(appendBytes(nil, s.store[r.keys[0]]))
	case qAdd:
		key := r.keys[0]
		n := r.delta
		if cur, ok := s.store[key]; ok {
			old, err := strconv.ParseInt(string(cur), 10, 64)
			if err != nil {
				return protoErr("ADD %q: stored value %.32q is not an integer", key, cur)
			}
			n += old // wraps like the C++ server's int64
		}
		v := []byte(strconv.FormatInt(n, 10))
		if !s.fits(key, len(v)) {
			return protoErr("ADD %q: store limits reached", key)
		}
		s.put(key, v)
		c.send(binary.LittleEndian.AppendUint64(nil, uint64(n)))
	case qCheck:
		if s.allExist(r.keys) {
			c.send([]byte{checkReady})
		} else {
			c.send([]byte{checkNotReady})
		}
	case qWait:
		if s.allExist(r.keys) {
			c.send([]byte{waitStop})
			break
		}
		if len(c.waits) >= s.opts.MaxWaitsPerConn {
			return protoErr("more than %d pending WAITs", s.opts.MaxWaitsPerConn)
		}
		w := &waiter{c: c}
		for _, k := range r.keys {
			if _, ok := s.store[k]; !ok {
				s.waiters[k] = append(s.waiters[k], w)
				w.remaining++
			}
		}
		c.waits[w] = struct{}{}
	case qGetNumKeys:
		c.send(binary.LittleEndian.AppendUint64(nil, uint64(len(s.store))))
	case qDeleteKey:
		var n uint64
		if v, ok := s.store[r.keys[0]]; ok {
			s.storeBytes -= int64(len(r.keys[0]) + len(v))
			delete(s.store, r.keys[0])
			s.notify()
			n = 1
		}
		c.send(binary.LittleEndian.AppendUint64(nil, n))
	case qAppend:
		key := r.keys[0]
		cur := s.store[key]
		if len(cur)+len(r.values[0]) > s.opts.MaxValueBytes {
			return protoErr("APPEND %q: value would exceed the %d byte limit", key, s.opts.MaxValueBytes)
		}
		if !s.fits(key, len(cur)+len(r.values[0])) {
			return protoErr("APPEND %q: store limits reached", key)
		}
		// A fresh slice: queued GET replies may still alias the old one.
		v := make([]byte, 0, len(cur)+len(r.values[0]))
		s.put(key, append(append(v, cur...), r.values[0]...))
	case qMultiGet:
		var b []byte
		for _, k := range r.keys {
			b = appendBytes(b, s.store[k])
		}
		c.send(b)
	case qMultiSet:
		for i, k := range r.keys {
			if !s.fits(k, len(r.values[i])) {
				return protoErr("MULTI_SET %q: store limits reached", k)
			}
			s.put(k, r.values[i])
		}
	case qCancelWait:
		s.dropWaits(c)
		c.send([]byte{waitCanceled})
	default:
		return protoErr("unknown query %d", r.q)
	}
	return nil
}
