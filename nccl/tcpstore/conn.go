package tcpstore

import (
	"net"
	"sync"
	"time"
)

// conn is one client connection: a reader goroutine parsing and executing
// requests, and a writer goroutine draining the reply queue.
type conn struct {
	s  *Server
	nc net.Conn

	// Guarded by s.mu.
	validated bool
	waits     map[*waiter]struct{}

	outMu    sync.Mutex
	out      [][]byte
	outBytes int
	dead     bool
	signal   chan struct{} // capacity 1: replies queued
	done     chan struct{} // closed by kill
	killOnce sync.Once
}

func newConn(s *Server, nc net.Conn) *conn {
	return &conn{
		s:      s,
		nc:     nc,
		waits:  map[*waiter]struct{}{},
		signal: make(chan struct{}, 1),
		done:   make(chan struct{}),
	}
}

// kill closes the connection; safe from any goroutine, never blocks on s.mu.
func (c *conn) kill() {
	c.killOnce.Do(func() {
		c.outMu.Lock()
		c.dead = true
		c.out = nil
		c.outMu.Unlock()
		close(c.done)
		c.nc.Close()
	})
}

// send queues a reply. It never blocks: a connection whose backlog passes
// MaxPendingBytes is killed instead.
func (c *conn) send(b []byte) {
	c.outMu.Lock()
	if c.dead {
		c.outMu.Unlock()
		return
	}
	// One reply always fits; a backlog beyond the limit means the peer is
	// not reading.
	if c.outBytes > 0 && c.outBytes+len(b) > c.s.opts.MaxPendingBytes {
		c.outMu.Unlock()
		c.kill()
		return
	}
	c.out = append(c.out, b)
	c.outBytes += len(b)
	c.outMu.Unlock()
	select {
	case c.signal <- struct{}{}:
	default:
	}
}

func (c *conn) writeLoop() {
	defer c.s.wg.Done()
	for {
		select {
		case <-c.done:
			return
		case <-c.signal:
		}
		c.outMu.Lock()
		bufs := net.Buffers(c.out)
		c.out, c.outBytes = nil, 0
		c.outMu.Unlock()
		if len(bufs) == 0 {
			continue
		}
		c.nc.SetWriteDeadline(time.Now().Add(c.s.opts.WriteTimeout))
		if _, err := bufs.WriteTo(c.nc); err != nil {
			c.kill()
			return
		}
	}
}

func (c *conn) readLoop() {
	defer c.s.wg.Done()
	defer func() {
		c.kill()
		c.s.mu.Lock()
		c.s.dropWaits(c)
		delete(c.s.conns, c)
		c.s.mu.Unlock()
	}()
	p := parser{lim: limits{
		maxKey:   c.s.opts.MaxKeyBytes,
		maxValue: c.s.opts.MaxValueBytes,
		maxCount: uint64(c.s.opts.MaxKeysPerRequest),
		maxFrame: c.s.opts.MaxRequestBytes,
	}}
	buf := make([]byte, 64<<10)
	var frameStart time.Time // zero while between frames
	for {
		if frameStart.IsZero() {
			c.nc.SetReadDeadline(time.Time{})
		} else {
			c.nc.SetReadDeadline(frameStart.Add(c.s.opts.ReadTimeout))
		}
		n, err := c.nc.Read(buf)
		now := time.Now()
		if n > 0 {
			p.feed(buf[:n])
			completed := false
			for {
				r, perr := p.next()
				if perr != nil {
					return
				}
				if r == nil {
					break
				}
				completed = true
				c.s.mu.Lock()
				herr := c.s.handle(c, r)
				c.s.mu.Unlock()
				if herr != nil {
					return
				}
			}
			switch {
			case !p.partial():
				frameStart = time.Time{}
			case completed || frameStart.IsZero():
				frameStart = now
			}
		}
		if err != nil {
			return // EOF, timeout in mid-frame, or closed by kill
		}
	}
}
