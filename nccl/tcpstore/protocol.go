package tcpstore

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Query codes of the torch 2.x protocol.
const (
	qValidate   byte = 0
	qSet        byte = 1
	qCompareSet byte = 2
	qGet        byte = 3
	qAdd        byte = 4
	qCheck      byte = 5
	qWait       byte = 6
	qGetNumKeys byte = 7
	qDeleteKey  byte = 8
	qAppend     byte = 9
	qMultiGet   byte = 10
	qMultiSet   byte = 11
	qCancelWait byte = 12
	qPing       byte = 13
	numQueries       = 14
)

// ValidationMagic is the u32 a torch 2.x client sends with VALIDATE.
const ValidationMagic uint32 = 0x3C85F7CE

// Reply bytes.
const (
	checkReady    byte = 0
	checkNotReady byte = 1
	waitStop      byte = 0
	waitCanceled  byte = 1
)

var queryNames = [numQueries]string{
	"VALIDATE", "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT", "GETNUMKEYS",
	"DELETE_KEY", "APPEND", "MULTI_GET", "MULTI_SET", "CANCEL_WAIT", "PING",
}

func queryName(q byte) string {
	if int(q) < numQueries {
		return queryNames[q]
	}
	return fmt.Sprintf("query %d", q)
}

// request is one parsed frame.
type request struct {
	q      byte
	keys   []string // the key(s) of the query, in wire order
	values [][]byte // SET/APPEND value; COMPARE_SET expected, desired; MULTI_SET values
	delta  int64    // ADD
	u32    uint32   // VALIDATE magic, PING nonce
}

// limits bound what a single frame may carry.
type limits struct {
	maxKey, maxValue int
	maxCount         uint64
	maxFrame         int
}

// errProtocol marks a frame the server refuses (as opposed to I/O errors).
var errProtocol = errors.New("tcpstore: protocol error")

func protoErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errProtocol, fmt.Sprintf(format, args...))
}

// parser decodes frames incrementally. Bytes are appended with feed; next
// returns a complete request, or nil when more input is needed. Completed
// fields are copied out and dropped from the buffer at once, so the buffer
// never holds more than one incomplete field plus the last read.
type parser struct {
	lim limits
	buf []byte

	// Progress within the current frame.
	inFrame    bool
	step       int    // fields completed so far
	count      uint64 // list length (CHECK, WAIT, MULTI_GET, MULTI_SET)
	frameBytes int    // bytes of the frame consumed so far
	req        request
}

func (p *parser) feed(b []byte) { p.buf = append(p.buf, b...) }

// partial reports whether a frame has begun but not completed.
func (p *parser) partial() bool { return p.inFrame || len(p.buf) > 0 }

func (p *parser) consume(n int) {
	p.buf = p.buf[n:]
	p.frameBytes += n
	if len(p.buf) == 0 {
		p.buf = p.buf[:0:0] // let a large buffer go once drained
	}
}

// fixed reads an n-byte integer field.
func (p *parser) fixed(n int) ([]byte, bool) {
	if len(p.buf) < n {
		return nil, false
	}
	return p.buf[:n], true
}

// bytesField reads a u64-length-prefixed field of at most limit bytes.
func (p *parser) bytesField(limit int, what string) ([]byte, bool, error) {
	if len(p.buf) < 8 {
		return nil, false, nil
	}
	n := binary.LittleEndian.Uint64(p.buf)
	if n > uint64(limit) {
		return nil, false, protoErr("%s %s of %d bytes exceeds the %d byte limit", queryName(p.req.q), what, n, limit)
	}
	if p.frameBytes+8+int(n) > p.lim.maxFrame {
		return nil, false, protoErr("%s frame exceeds the %d byte limit", queryName(p.req.q), p.lim.maxFrame)
	}
	if uint64(len(p.buf)-8) < n {
		return nil, false, nil
	}
	out := make([]byte, n)
	copy(out, p.buf[8:])
	p.consume(8 + int(n))
	return out, true, nil
}

func (p *parser) key() (bool, error) {
	b, ok, err := p.bytesField(p.lim.maxKey, "key")
	if ok {
		p.req.keys = append(p.req.keys, string(b))
	}
	return ok, err
}

func (p *parser) value() (bool, error) {
	b, ok, err := p.bytesField(p.lim.maxValue, "value")
	if ok {
		p.req.values = append(p.req.values, b)
	}
	return ok, err
}

func (p *parser) countField() (bool, error) {
	b, ok := p.fixed(8)
	if !ok {
		return false, nil
	}
	n := binary.LittleEndian.Uint64(b)
	if n > p.lim.maxCount {
		return false, protoErr("%s of %d keys exceeds the %d key limit", queryName(p.req.q), n, p.lim.maxCount)
	}
	p.count = n
	p.consume(8)
	return true, nil
}

// next returns the next complete request, nil if more input is needed, or a
// protocol error (after which the parser must not be used).
func (p *parser) next() (*request, error) {
	for {
		done, err := p.advance()
		if err != nil || !done {
			return nil, err
		}
		if p.step < 0 { // frame complete
			r := p.req
			p.inFrame, p.step, p.count, p.frameBytes, p.req = false, 0, 0, 0, request{}
			return &r, nil
		}
	}
}

// advance parses one more field; done=false means more input is needed.
// It sets step to -1 when the frame is complete.
func (p *parser) advance() (done bool, err error) {
	if !p.inFrame {
		if len(p.buf) == 0 {
			return false, nil
		}
		q := p.buf[0]
		if q >= numQueries {
			return false, protoErr("unknown query %d", q)
		}
		p.req.q = q
		p.inFrame = true
		p.consume(1)
		if q == qGetNumKeys || q == qCancelWait {
			p.step = -1
		}
		return true, nil
	}
	finish := func(ok bool, err error, last bool) (bool, error) {
		if err != nil || !ok {
			return false, err
		}
		if last {
			p.step = -1
		} else {
			p.step++
		}
		return true, nil
	}
	switch p.req.q {
	case qValidate, qPing:
		b, ok := p.fixed(4)
		if ok {
			p.req.u32 = binary.LittleEndian.Uint32(b)
			p.consume(4)
		}
		return finish(ok, nil, true)
	case qGet, qDeleteKey:
		ok, err := p.key()
		return finish(ok, err, true)
	case qSet, qAppend:
		if p.step == 0 {
			ok, err := p.key()
			return finish(ok, err, false)
		}
		ok, err := p.value()
		return finish(ok, err, true)
	case qCompareSet:
		if p.step == 0 {
			ok, err := p.key()
			return finish(ok, err, false)
		}
		ok, err := p.value()
		return finish(ok, err, p.step == 2)
	case qAdd:
		if p.step == 0 {
			ok, err := p.key()
			return finish(ok, err, false)
		}
		b, ok := p.fixed(8)
		if ok {
			p.req.delta = int64(binary.LittleEndian.Uint64(b))
			p.consume(8)
		}
		return finish(ok, nil, true)
	case qCheck, qWait, qMultiGet:
		if p.step == 0 {
			ok, err := p.countField()
			return finish(ok, err, ok && p.count == 0)
		}
		ok, err := p.key()
		return finish(ok, err, uint64(p.step) == p.count)
	case qMultiSet:
		if p.step == 0 {
			ok, err := p.countField()
			return finish(ok, err, ok && p.count == 0)
		}
		var ok bool
		if p.step%2 == 1 {
			ok, err = p.key()
		} else {
			ok, err = p.value()
		}
		return finish(ok, err, uint64(p.step) == 2*p.count)
	}
	return false, protoErr("unknown query %d", p.req.q) // unreachable: checked above
}

// Encoding, shared by the client and the tests.

func appendBytes(b []byte, s []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

func appendString(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

// encode writes r as a wire frame.
func (r *request) encode(b []byte) []byte {
	b = append(b, r.q)
	switch r.q {
	case qValidate, qPing:
		b = binary.LittleEndian.AppendUint32(b, r.u32)
	case qGet, qDeleteKey:
		b = appendString(b, r.keys[0])
	case qSet, qAppend:
		b = appendString(b, r.keys[0])
		b = appendBytes(b, r.values[0])
	case qCompareSet:
		b = appendString(b, r.keys[0])
		b = appendBytes(b, r.values[0])
		b = appendBytes(b, r.values[1])
	case qAdd:
		b = appendString(b, r.keys[0])
		b = binary.LittleEndian.AppendUint64(b, uint64(r.delta))
	case qCheck, qWait, qMultiGet:
		b = binary.LittleEndian.AppendUint64(b, uint64(len(r.keys)))
		for _, k := range r.keys {
			b = appendString(b, k)
		}
	case qMultiSet:
		b = binary.LittleEndian.AppendUint64(b, uint64(len(r.keys)))
		for i, k := range r.keys {
			b = appendString(b, k)
			b = appendBytes(b, r.values[i])
		}
	}
	return b
}
