package tcpstore

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"testing"
)

var fuzzLimits = limits{maxKey: 16, maxValue: 64, maxCount: 8, maxFrame: 512}

// parseAll feeds data in the given chunk sizes (cycled; 0 means 1) and
// returns the requests, the unconsumed byte count, and the first error.
func parseAll(lim limits, data []byte, chunks []byte) ([]request, int, error) {
	p := parser{lim: lim}
	var out []request
	i, ci := 0, 0
	for i < len(data) {
		n := 1
		if len(chunks) > 0 {
			n = int(chunks[ci%len(chunks)])
			ci++
			if n == 0 {
				n = 1
			}
		} else {
			n = len(data)
		}
		n = min(n, len(data)-i)
		p.feed(data[i : i+n])
		i += n
		for {
			r, err := p.next()
			if err != nil {
				return out, -1, err
			}
			if r == nil {
				break
			}
			out = append(out, *r)
		}
	}
	rest := len(p.buf)
	return out, rest, nil
}

func sampleRequests() []request {
	return []request{
		{q: qValidate, u32: ValidationMagic},
		{q: qPing, u32: 0xdeadbeef},
		{q: qSet, keys: []string{"/k"}, values: [][]byte{[]byte("value")}},
		{q: qSet, keys: []string{""}, values: [][]byte{{}}},
		{q: qCompareSet, keys: []string{"/c"}, values: [][]byte{{}, []byte("new")}},
		{q: qGet, keys: []string{"/g"}},
		{q: qAdd, keys: []string{"init/"}, delta: -3},
		{q: qCheck, keys: []string{"/a", "/b"}},
		{q: qCheck, keys: nil},
		{q: qWait, keys: []string{"/broadcast_from/0/0"}},
		{q: qGetNumKeys},
		{q: qDeleteKey, keys: []string{"/d"}},
		{q: qAppend, keys: []string{"/ap"}, values: [][]byte{[]byte("xyz")}},
		{q: qMultiGet, keys: []string{"/1", "/2", "/3"}},
		{q: qMultiSet, keys: []string{"/1", "/2"}, values: [][]byte{[]byte("a"), {}}},
		{q: qMultiSet},
		{q: qCancelWait},
	}
}

func encodeAll(rs []request) []byte {
	var b []byte
	for i := range rs {
		b = rs[i].encode(b)
	}
	return b
}

func normalize(rs []request) []request {
	out := make([]request, len(rs))
	for i, r := range rs {
		if len(r.keys) == 0 {
			r.keys = nil
		}
		if len(r.values) == 0 {
			r.values = nil
		}
		for j, v := range r.values {
			if len(v) == 0 {
				r.values[j] = []byte{}
			}
		}
		out[i] = r
	}
	return out
}

func TestParserEveryQueryAnyChunking(t *testing.T) {
	rs := sampleRequests()
	data := encodeAll(rs)
	for _, chunks := range [][]byte{nil, {1}, {2}, {3}, {7}, {1, 9, 2, 255}, {100}} {
		got, rest, err := parseAll(limits{maxKey: 64, maxValue: 64, maxCount: 8, maxFrame: 1024}, data, chunks)
		if err != nil || rest != 0 {
			t.Fatalf("chunks %v: err %v rest %d", chunks, err, rest)
		}
		if !reflect.DeepEqual(normalize(got), normalize(rs)) {
			t.Fatalf("chunks %v:\n got %+v\nwant %+v", chunks, got, rs)
		}
	}
	// Every strict prefix is incomplete, never an error, and yields exactly
	// the requests that fit.
	for cut := range len(data) {
		got, _, err := parseAll(limits{maxKey: 64, maxValue: 64, maxCount: 8, maxFrame: 1024}, data[:cut], nil)
		if err != nil {
			t.Fatalf("prefix %d: %v", cut, err)
		}
		if enc := encodeAll(got); !bytes.HasPrefix(data[:cut], enc) {
			t.Fatalf("prefix %d: requests do not re-encode to the input", cut)
		}
	}
}

func TestParserErrors(t *testing.T) {
	u64 := func(n uint64) string {
		b := make([]byte, 8)
		for i := range b {
			b[i] = byte(n >> (8 * i))
		}
		return fmt.Sprintf("%x", b)
	}
	tests := []struct {
		name, in, want string
	}{
		{"unknown-query", `0e`, "unknown query 14"},
		{"unknown-query-255", `ff`, "unknown query 255"},
		{"key-limit", `03 ` + u64(17), "GET key of 17 bytes exceeds the 16 byte limit"},
		{"value-limit", `01 0100000000000000 "k" ` + u64(65), "SET value of 65 bytes exceeds the 64 byte limit"},
		{"count-limit", `0a ` + u64(9), "MULTI_GET of 9 keys exceeds the 8 key limit"},
		{"count-huge", `0b ffffffffffffffff`, "MULTI_SET of 18446744073709551615 keys"},
		{"frame-limit", `0b 0800000000000000` + repeatStr(` 1000000000000000 "0123456789abcdef" 4000000000000000`, 1) + ` "` + string(bytes.Repeat([]byte("v"), 64)) + `"` +
			repeatStr(` 1000000000000000 "0123456789abcdef" 4000000000000000 "`+string(bytes.Repeat([]byte("v"), 64))+`"`, 6), "MULTI_SET frame exceeds the 512 byte limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := parseAll(fuzzLimits, hx(t, tc.in), []byte{1})
			if err == nil || !errors.Is(err, errProtocol) || !bytesContains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func repeatStr(s string, n int) string { return string(bytes.Repeat([]byte(s), n)) }

func bytesContains(s, sub string) bool { return bytes.Contains([]byte(s), []byte(sub)) }

func FuzzFrameParser(f *testing.F) {
	f.Add(encodeAll(sampleRequests()), []byte{1})
	f.Add(encodeAll(sampleRequests()), []byte{3, 1, 200})
	f.Add([]byte{0x06, 9, 0, 0, 0, 0, 0, 0, 0}, []byte{})
	f.Add([]byte{0x03, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, []byte{2})
	f.Add([]byte{0x0e}, []byte{})
	f.Fuzz(func(t *testing.T, data, chunks []byte) {
		whole, wrest, werr := parseAll(fuzzLimits, data, nil)
		split, srest, serr := parseAll(fuzzLimits, data, chunks)
		// Chunking never changes the outcome.
		if (werr == nil) != (serr == nil) || wrest != srest {
			t.Fatalf("whole: %v rest %d; chunked: %v rest %d", werr, wrest, serr, srest)
		}
		if werr != nil && werr.Error() != serr.Error() {
			t.Fatalf("errors differ: %v vs %v", werr, serr)
		}
		if !reflect.DeepEqual(normalize(whole), normalize(split)) {
			t.Fatalf("requests differ")
		}
		if werr != nil && !errors.Is(werr, errProtocol) {
			t.Fatalf("error is not a protocol error: %v", werr)
		}
		// Parsed requests re-encode to exactly the bytes they came from and
		// respect the limits.
		enc := encodeAll(whole)
		if !bytes.HasPrefix(data, enc) {
			t.Fatalf("re-encoding differs from the input")
		}
		// What stays buffered is part of one incomplete frame, after them.
		if werr == nil && len(enc)+wrest > len(data) {
			t.Fatalf("consumed %d + buffered %d > %d", len(enc), wrest, len(data))
		}
		for _, r := range whole {
			if int(r.q) >= numQueries {
				t.Fatalf("query %d", r.q)
			}
			if uint64(len(r.keys)) > fuzzLimits.maxCount && r.q != qMultiSet {
				t.Fatalf("%d keys", len(r.keys))
			}
			for _, k := range r.keys {
				if len(k) > fuzzLimits.maxKey {
					t.Fatalf("key of %d bytes", len(k))
				}
			}
			for _, v := range r.values {
				if len(v) > fuzzLimits.maxValue {
					t.Fatalf("value of %d bytes", len(v))
				}
			}
			if len(r.encode(nil)) > fuzzLimits.maxFrame {
				t.Fatalf("frame of %d bytes", len(r.encode(nil)))
			}
		}
	})
}
