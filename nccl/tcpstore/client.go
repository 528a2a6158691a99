package tcpstore

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// Well-known wire keys of the vLLM rendezvous.
const (
	// InitKey is the worker counter every torch client with a world size
	// increments on connecting (no "/" prefix).
	InitKey = "init/"
	// UniqueIDKey is where rank 0 publishes the pickled ncclUniqueId
	// (StatelessProcessGroup.broadcast_obj from rank 0, first broadcast).
	UniqueIDKey = "/broadcast_from/0/0"
)

// maxReplyValue bounds a value the client accepts from a server.
const maxReplyValue = 1 << 30

// cancelGrace bounds the CANCEL_WAIT exchange after a Wait's context ends.
const cancelGrace = 10 * time.Second

// Client is a torch 2.x compatible TCPStore client. Keys are wire keys,
// sent verbatim (torch's store key k is the wire key "/" + k). Methods are safe for
// concurrent use (requests are serialised) and honour their context's
// deadline and cancellation. After a transport error or an interrupted
// request the client is unusable and every method returns that error.
type Client struct {
	mu     sync.Mutex
	nc     net.Conn
	br     *bufio.Reader
	broken error
	nonce  uint32
}

// Dial connects and, like a torch 2.x client, sends VALIDATE and PING (with
// the process id as nonce) before returning.
func Dial(ctx context.Context, addr string) (*Client, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcpstore: dial: %w", err)
	}
	c := &Client{nc: nc, br: bufio.NewReader(nc), nonce: uint32(os.Getpid())}
	r := request{q: qValidate, u32: ValidationMagic}
	err = c.do(ctx, "VALIDATE", r.encode(nil), nil)
	if err == nil {
		err = c.Ping(ctx)
	}
	if err != nil {
		nc.Close()
		return nil, err
	}
	return c, nil
}

// Close closes the connection.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken == nil {
		c.broken = errors.New("tcpstore: client closed")
	}
	if err := c.nc.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("tcpstore: close: %w", err)
	}
	return nil
}

// do sends frame and runs read (if any) for the reply, within ctx.
func (c *Client) do(ctx context.Context, op string, frame []byte, read func() error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return c.broken
	}
	release := c.arm(ctx)
	_, err := c.nc.Write(frame)
	if err == nil && read != nil {
		err = read()
	}
	release()
	if err != nil {
		return c.fail(ctx, op, err)
	}
	return nil
}

// arm applies ctx's deadline and cancellation to the connection; the
// returned function undoes it and returns only once the cancellation
// callback can no longer run.
func (c *Client) arm(ctx context.Context) func() {
	dl, _ := ctx.Deadline()
	c.nc.SetDeadline(dl)
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		c.nc.SetDeadline(time.Unix(1, 0))
	})
	return func() {
		if !stop() {
			<-fired
		}
		c.nc.SetDeadline(time.Time{})
	}
}

// ctxErr is the context's error if err was caused by the context ending:
// the connection deadline copied from ctx may expire just before ctx itself
// reports it.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	var ne net.Error
	if dl, ok := ctx.Deadline(); ok && errors.As(err, &ne) && ne.Timeout() && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

func (c *Client) fail(ctx context.Context, op string, err error) error {
	if cerr := ctxErr(ctx, err); cerr != nil {
		err = fmt.Errorf("tcpstore: %s: %w", op, cerr)
	} else {
		err = fmt.Errorf("tcpstore: %s: %w", op, err)
	}
	c.broken = fmt.Errorf("tcpstore: client unusable after failed %s: %w", op, err)
	c.nc.Close()
	return err
}

func (c *Client) readN(n int) ([]byte, error) {
	b := make([]byte, n)
	_, err := io.ReadFull(c.br, b)
	return b, err
}

func (c *Client) readU64() (uint64, error) {
	b, err := c.readN(8)
	if err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(b), nil
}

func (c *Client) readValue() ([]byte, error) {
	n, err := c.readU64()
	if err != nil {
		return nil, err
	}
	if n > maxReplyValue {
		return nil, fmt.Errorf("reply value of %d bytes exceeds %d", n, maxReplyValue)
	}
	return c.readN(int(n))
}

func (c *Client) readByte() (byte, error) { return c.br.ReadByte() }

// Ping round-trips a PING and checks the echoed nonce.
func (c *Client) Ping(ctx context.Context) error {
	c.mu.Lock()
	c.nonce++
	nonce := c.nonce
	c.mu.Unlock()
	r := request{q: qPing, u32: nonce}
	return c.do(ctx, "PING", r.encode(nil), func() error {
		b, err := c.readN(4)
		if err != nil {
			return err
		}
		if got := binary.LittleEndian.Uint32(b); got != nonce {
			return fmt.Errorf("echoed nonce %#x, sent %#x", got, nonce)
		}
		return nil
	})
}

// Set stores value under key (no reply on the wire).
func (c *Client) Set(ctx context.Context, key string, value []byte) error {
	r := request{q: qSet, keys: []string{key}, values: [][]byte{value}}
	return c.do(ctx, "SET", r.encode(nil), nil)
}

// Get returns the value under key; a missing key reads as empty on a
// libuv-style server (this package's) and closes the connection on
// PyTorch's legacy server: Wait first, as torch does.
func (c *Client) Get(ctx context.Context, key string) ([]byte, error) {
	r := request{q: qGet, keys: []string{key}}
	var v []byte
	err := c.do(ctx, "GET", r.encode(nil), func() (err error) {
		v, err = c.readValue()
		return err
	})
	return v, err
}

// Add adds delta to the integer counter under key and returns the new value.
func (c *Client) Add(ctx context.Context, key string, delta int64) (int64, error) {
	r := request{q: qAdd, keys: []string{key}, delta: delta}
	var v uint64
	err := c.do(ctx, "ADD", r.encode(nil), func() (err error) {
		v, err = c.readU64()
		return err
	})
	return int64(v), err
}

// Check reports whether all keys exist.
func (c *Client) Check(ctx context.Context, keys ...string) (bool, error) {
	r := request{q: qCheck, keys: keys}
	var ready bool
	err := c.do(ctx, "CHECK", r.encode(nil), func() error {
		b, err := c.readByte()
		if err != nil {
			return err
		}
		switch b {
		case checkReady:
			ready = true
		case checkNotReady:
		default:
			return fmt.Errorf("unexpected CHECK reply %d", b)
		}
		return nil
	})
	return ready, err
}

// Wait blocks until all keys exist. When ctx ends first it cancels the wait
// on the server (CANCEL_WAIT, as torch does on a timeout) and returns the
// context's error; the client stays usable.
func (c *Client) Wait(ctx context.Context, keys ...string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return c.broken
	}
	r := request{q: qWait, keys: keys}
	release := c.arm(ctx)
	_, err := c.nc.Write(r.encode(nil))
	if err != nil {
		release()
		return c.fail(ctx, "WAIT", err) // a partial frame may have gone out
	}
	b, err := c.readByte()
	release()
	if err == nil {
		if b != waitStop {
			return c.fail(ctx, "WAIT", fmt.Errorf("unexpected WAIT reply %d", b))
		}
		return nil
	}
	cerr := ctxErr(ctx, err)
	var ne net.Error
	if cerr == nil || !errors.As(err, &ne) || !ne.Timeout() || c.br.Buffered() > 0 {
		return c.fail(ctx, "WAIT", err)
	}
	// The request went out and no reply byte arrived: cancel it. A wake-up
	// (0) may race with the cancellation and precede the final 1.
	c.nc.SetDeadline(time.Now().Add(cancelGrace))
	defer c.nc.SetDeadline(time.Time{})
	if _, err := c.nc.Write([]byte{qCancelWait}); err != nil {
		return c.fail(context.Background(), "CANCEL_WAIT", err)
	}
	for range 2 {
		b, err := c.readByte()
		if err != nil {
			return c.fail(context.Background(), "CANCEL_WAIT", err)
		}
		switch b {
		case waitCanceled:
			return fmt.Errorf("tcpstore: WAIT %q: %w", keys, cerr)
		case waitStop:
			continue
		default:
			return c.fail(context.Background(), "CANCEL_WAIT", fmt.Errorf("unexpected reply %d", b))
		}
	}
	return c.fail(context.Background(), "CANCEL_WAIT", errors.New("two wake-ups before the cancellation reply"))
}

// CompareSet sets key to desired if its value is expected (or if it is
// missing and expected is empty) and returns the resulting value; for a
// missing key with non-empty expected it returns expected, as PyTorch does.
func (c *Client) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	r := request{q: qCompareSet, keys: []string{key}, values: [][]byte{expected, desired}}
	var v []byte
	err := c.do(ctx, "COMPARE_SET", r.encode(nil), func() (err error) {
		v, err = c.readValue()
		return err
	})
	return v, err
}

// DeleteKey deletes key and reports whether it existed.
func (c *Client) DeleteKey(ctx context.Context, key string) (bool, error) {
	r := request{q: qDeleteKey, keys: []string{key}}
	var n uint64
	err := c.do(ctx, "DELETE_KEY", r.encode(nil), func() (err error) {
		n, err = c.readU64()
		return err
	})
	return n == 1, err
}

// NumKeys is the number of keys in the store (including "init/").
func (c *Client) NumKeys(ctx context.Context) (int64, error) {
	var n uint64
	err := c.do(ctx, "GETNUMKEYS", []byte{qGetNumKeys}, func() (err error) {
		n, err = c.readU64()
		return err
	})
	return int64(n), err
}

// Append appends value to the value under key (creating it).
func (c *Client) Append(ctx context.Context, key string, value []byte) error {
	r := request{q: qAppend, keys: []string{key}, values: [][]byte{value}}
	return c.do(ctx, "APPEND", r.encode(nil), nil)
}

// MultiGet returns the values of keys, in order.
func (c *Client) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	r := request{q: qMultiGet, keys: keys}
	vs := make([][]byte, 0, len(keys))
	err := c.do(ctx, "MULTI_GET", r.encode(nil), func() error {
		for range keys {
			v, err := c.readValue()
			if err != nil {
				return err
			}
			vs = append(vs, v)
		}
		return nil
	})
	return vs, err
}

// MultiSet sets keys[i] to values[i].
func (c *Client) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	if len(keys) != len(values) {
		return fmt.Errorf("tcpstore: MULTI_SET: %d keys but %d values", len(keys), len(values))
	}
	r := request{q: qMultiSet, keys: keys, values: values}
	return c.do(ctx, "MULTI_SET", r.encode(nil), nil)
}

// JoinAsWorker performs the rest of a vLLM worker's rendezvous after Dial,
// with the same bytes on the wire as torch 2.x: ADD "init/" 1, WAIT and GET
// of UniqueIDKey. It returns the published value (the pickled ncclUniqueId).
func (c *Client) JoinAsWorker(ctx context.Context) ([]byte, error) {
	if _, err := c.Add(ctx, InitKey, 1); err != nil {
		return nil, err
	}
	if err := c.Wait(ctx, UniqueIDKey); err != nil {
		return nil, err
	}
	return c.Get(ctx, UniqueIDKey)
}
