package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"
)

// MaxHeaderSize is the largest header length accepted, the reference
// implementation's limit (100 MB).
const MaxHeaderSize = 100_000_000

// metadataKey is the reserved header key holding free-form string metadata.
const metadataKey = "__metadata__"

// FormatError reports an invalid safetensors file.
type FormatError struct {
	File   string // path as given to Open (or the name given to the parser)
	Tensor string // tensor concerned, "" when the problem is file-wide
	Msg    string
}

func (e *FormatError) Error() string {
	if e.Tensor != "" {
		return fmt.Sprintf("safetensors: %s: tensor %q: %s", e.File, e.Tensor, e.Msg)
	}
	return fmt.Sprintf("safetensors: %s: %s", e.File, e.Msg)
}

// header is a parsed and validated header.
type header struct {
	size     int64 // header length n (bytes after the 8-byte prefix)
	tensors  []TensorInfo
	metadata map[string]string
}

type rawTensor struct {
	name       string
	dtype      DType
	shape      []int64
	begin, end uint64
	seen       uint8 // bit set of the fields seen
}

const (
	seenDType = 1 << iota
	seenShape
	seenOffsets
)

// parseHeader validates the complete file image data (header and data area).
func parseHeader(file string, data []byte) (*header, error) {
	ferr := func(tensor, format string, args ...any) error {
		return &FormatError{File: file, Tensor: tensor, Msg: fmt.Sprintf(format, args...)}
	}
	if len(data) < 8 {
		return nil, ferr("", "file is %d bytes, shorter than the 8-byte header length", len(data))
	}
	n := binary.LittleEndian.Uint64(data[:8])
	if n == 0 {
		return nil, ferr("", "header length is 0")
	}
	if n > MaxHeaderSize {
		return nil, ferr("", "header length %d exceeds the %d byte limit", n, MaxHeaderSize)
	}
	if n > uint64(len(data)-8) {
		return nil, ferr("", "header length %d runs past the end of the %d byte file", n, len(data))
	}
	hdr := data[8 : 8+n]
	if !utf8.Valid(hdr) {
		return nil, ferr("", "header is not valid UTF-8")
	}
	if hdr[0] != '{' {
		return nil, ferr("", "header does not start with '{'")
	}
	dataLen := uint64(len(data)) - 8 - n

	dec := json.NewDecoder(bytes.NewReader(hdr))
	dec.UseNumber()
	jerr := func(tensor string, err error) error {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return ferr(tensor, "header is not valid JSON at header byte %d: %v", se.Offset, se.Error())
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return ferr(tensor, "header JSON is truncated")
		}
		return ferr(tensor, "header is not valid JSON: %v", err)
	}
	if _, err := dec.Token(); err != nil { // the '{' checked above
		return nil, jerr("", err)
	}
	h := &header{size: int64(n), metadata: map[string]string{}}
	var raws []*rawTensor
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, jerr("", err)
		}
		key, ok := tok.(string)
		if !ok {
			return nil, ferr("", "header object key is not a string")
		}
		if seen[key] {
			if key == metadataKey {
				return nil, ferr("", "duplicate %s entry", metadataKey)
			}
			return nil, ferr(key, "duplicate tensor entry")
		}
		seen[key] = true
		if key == metadataKey {
			if err := parseMetadata(dec, h.metadata, ferr, jerr); err != nil {
				return nil, err
			}
			continue
		}
		rt, err := parseTensor(dec, key, ferr, jerr)
		if err != nil {
			return nil, err
		}
		raws = append(raws, rt)
	}
	if _, err := dec.Token(); err != nil { // closing '}'
		return nil, jerr("", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, ferr("", "unexpected data after the header JSON object (only space padding may follow)")
	}

	// Per-tensor checks.
	for _, rt := range raws {
		if rt.begin > rt.end {
			return nil, ferr(rt.name, "data_offsets [%d, %d] end before they begin", rt.begin, rt.end)
		}
		if rt.end > dataLen {
			return nil, ferr(rt.name, "data_offsets [%d, %d] run past the %d byte data area", rt.begin, rt.end, dataLen)
		}
		want, ok := byteSize(rt.shape, rt.dtype)
		if !ok {
			return nil, ferr(rt.name, "shape %v of %s overflows the byte size", rt.shape, rt.dtype)
		}
		if got := rt.end - rt.begin; got != want {
			return nil, ferr(rt.name, "shape %v of %s needs %d bytes but data_offsets [%d, %d] span %d", rt.shape, rt.dtype, want, rt.begin, rt.end, got)
		}
	}
	// The tensors must tile the data area: sorted by offsets, each one
	// begins where the previous one ended and the last one ends the file.
	sort.SliceStable(raws, func(i, j int) bool {
		a, b := raws[i], raws[j]
		if a.begin != b.begin {
			return a.begin < b.begin
		}
		if a.end != b.end {
			return a.end < b.end
		}
		return a.name < b.name
	})
	var pos uint64
	prev := ""
	for _, rt := range raws {
		switch {
		case rt.begin < pos:
			return nil, ferr(rt.name, "data_offsets [%d, %d] overlap tensor %q ending at %d", rt.begin, rt.end, prev, pos)
		case rt.begin > pos:
			return nil, ferr(rt.name, "data_offsets [%d, %d] leave a gap of %d bytes at data offset %d", rt.begin, rt.end, rt.begin-pos, pos)
		}
		pos = rt.end
		prev = rt.name
	}
	if pos != dataLen {
		return nil, ferr("", "data area is %d bytes but the tensors cover only %d (%d trailing bytes)", dataLen, pos, dataLen-pos)
	}
	base := int64(8 + n)
	h.tensors = make([]TensorInfo, len(raws))
	for i, rt := range raws {
		h.tensors[i] = TensorInfo{
			Name:   rt.name,
			DType:  rt.dtype,
			Shape:  rt.shape,
			File:   file,
			Offset: base + int64(rt.begin),
			Size:   int64(rt.end - rt.begin),
		}
	}
	return h, nil
}

type ferrFunc func(tensor, format string, args ...any) error
type jerrFunc func(tensor string, err error) error

func parseMetadata(dec *json.Decoder, into map[string]string, ferr ferrFunc, jerr jerrFunc) error {
	tok, err := dec.Token()
	if err != nil {
		return jerr("", err)
	}
	if tok == nil { // "__metadata__": null is accepted by the reference (an Option)
		return nil
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return ferr("", "%s is not an object", metadataKey)
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return jerr("", err)
		}
		k := tok.(string) // object keys are always strings
		tok, err = dec.Token()
		if err != nil {
			return jerr("", err)
		}
		v, ok := tok.(string)
		if !ok {
			return ferr("", "%s value of %q is not a string", metadataKey, k)
		}
		if _, dup := into[k]; dup {
			return ferr("", "duplicate %s key %q", metadataKey, k)
		}
		into[k] = v
	}
	if _, err := dec.Token(); err != nil {
		return jerr("", err)
	}
	return nil
}

func parseTensor(dec *json.Decoder, name string, ferr ferrFunc, jerr jerrFunc) (*rawTensor, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, jerr(name, err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, ferr(name, "entry is not an object")
	}
	rt := &rawTensor{name: name}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, jerr(name, err)
		}
		field := tok.(string)
		var bit uint8
		switch field {
		case "dtype":
			bit = seenDType
		case "shape":
			bit = seenShape
		case "data_offsets":
			bit = seenOffsets
		default:
			return nil, ferr(name, "unknown field %q", field)
		}
		if rt.seen&bit != 0 {
			return nil, ferr(name, "duplicate field %q", field)
		}
		rt.seen |= bit
		switch field {
		case "dtype":
			tok, err := dec.Token()
			if err != nil {
				return nil, jerr(name, err)
			}
			s, ok := tok.(string)
			if !ok {
				return nil, ferr(name, "dtype is not a string")
			}
			if !DType(s).Valid() {
				return nil, ferr(name, "unknown dtype %q", s)
			}
			rt.dtype = DType(s)
		case "shape":
			dims, err := parseUintArray(dec, name, "shape", -1, ferr, jerr)
			if err != nil {
				return nil, err
			}
			rt.shape = make([]int64, len(dims))
			for i, d := range dims {
				rt.shape[i] = int64(d)
			}
		case "data_offsets":
			offs, err := parseUintArray(dec, name, "data_offsets", 2, ferr, jerr)
			if err != nil {
				return nil, err
			}
			rt.begin, rt.end = offs[0], offs[1]
		}
	}
	if _, err := dec.Token(); err != nil {
		return nil, jerr(name, err)
	}
	switch {
	case rt.seen&seenDType == 0:
		return nil, ferr(name, "missing dtype")
	case rt.seen&seenShape == 0:
		return nil, ferr(name, "missing shape")
	case rt.seen&seenOffsets == 0:
		return nil, ferr(name, "missing data_offsets")
	}
	return rt, nil
}

// parseUintArray reads a JSON array of integers in [0, MaxInt64]; want >= 0
// demands exactly that many elements.
func parseUintArray(dec *json.Decoder, name, field string, want int, ferr ferrFunc, jerr jerrFunc) ([]uint64, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, jerr(name, err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return nil, ferr(name, "%s is not an array", field)
	}
	out := []uint64{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, jerr(name, err)
		}
		num, ok := tok.(json.Number)
		if !ok {
			return nil, ferr(name, "%s element %d is not a number", field, len(out))
		}
		s := num.String()
		if strings.HasPrefix(s, "-") {
			if field == "shape" {
				return nil, ferr(name, "shape dimension %d is negative (%s)", len(out), s)
			}
			return nil, ferr(name, "%s element %d is negative (%s)", field, len(out), s)
		}
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil || v > math.MaxInt64 {
			return nil, ferr(name, "%s element %d (%s) is not an integer in [0, 2^63)", field, len(out), s)
		}
		out = append(out, v)
	}
	if _, err := dec.Token(); err != nil {
		return nil, jerr(name, err)
	}
	if want >= 0 && len(out) != want {
		return nil, ferr(name, "%s has %d elements, want %d", field, len(out), want)
	}
	return out, nil
}

// byteSize is prod(shape)*itemsize, with ok=false when it does not fit in an
// int64. A zero dimension makes the product 0 whatever the other dimensions.
func byteSize(shape []int64, d DType) (uint64, bool) {
	for _, dim := range shape {
		if dim == 0 {
			return 0, true
		}
	}
	n := uint64(d.ItemSize())
	for _, dim := range shape {
		hi, lo := bits.Mul64(n, uint64(dim))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, false
		}
		n = lo
	}
	return n, true
}
