package cudaipc

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestParseTorchHandle(t *testing.T) {
	payload := bytes.Repeat([]byte{0xab, 0x01}, MemHandleBytes/2)
	framed := func(version, typ byte, p []byte) []byte { return append([]byte{version, typ}, p...) }
	cases := []struct {
		name    string
		in      []byte
		want    []byte // the MemHandle on success
		wantErr string
		is      error
	}{
		{name: "raw 64 bytes (torch before the framing)", in: payload, want: payload},
		{name: "version 2 cudaMalloc", in: framed(2, 'c', payload), want: payload},
		{name: "version 3 cudaMalloc (same payload)", in: framed(3, 'c', payload), want: payload},
		{name: "version 1 cudaMalloc", in: framed(1, 'c', payload), want: payload},
		{name: "expandable segment", in: framed(2, 'e', []byte{1, 2, 3}), is: ErrExpandableSegment, wantErr: "expandable_segments:False"},
		{name: "future version", in: framed(4, 'c', payload), wantErr: "version 4: only 1..3 are known"},
		{name: "version 0", in: framed(0, 'c', payload), wantErr: "version 0"},
		{name: "unknown type", in: framed(2, 'x', payload), wantErr: "type byte 0x78"},
		{name: "short payload", in: framed(2, 'c', payload[:63]), wantErr: "has 65 bytes: want 66"},
		{name: "long payload", in: framed(2, 'c', append(payload, 0)), wantErr: "has 67 bytes: want 66"},
		{name: "empty", in: nil, wantErr: "torch handle of 0 bytes"},
		{name: "one byte", in: []byte{2}, wantErr: "torch handle of 1 bytes"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h, err := ParseTorchHandle(c.in)
			if c.wantErr == "" {
				if err != nil || !bytes.Equal(h[:], c.want) {
					t.Fatalf("got %x, %v; want %x", h, err, c.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Fatalf("got %v, want an error containing %q", err, c.wantErr)
			}
			if c.is != nil && !errors.Is(err, c.is) {
				t.Fatalf("got %v, want errors.Is %v", err, c.is)
			}
			if strings.Contains(err.Error(), "ab01ab01") {
				t.Fatalf("error quotes the handle bytes: %q", err)
			}
		})
	}
}
