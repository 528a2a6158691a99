package trainer

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"unicode/utf8"
)

// ProtocolVersion is the protocol this package speaks (PROTOCOL.md).
const ProtocolVersion = 1

// MaxFrameBytes bounds one frame's JSON (the newline not counted).
const MaxFrameBytes = 16 << 20

// maxRefusalText bounds how much of a trainer's error text a Refused error
// carries.
const maxRefusalText = 2000

// maxKeyText bounds a map key (a metric's name) quoted in a field path.
const maxKeyText = 64

var errFrameTooLong = fmt.Errorf("longer than %d MiB", MaxFrameBytes>>20)

// readFrame reads one frame: the bytes before the next newline, at most
// max of them. A frame cut short by end of file is io.ErrUnexpectedEOF.
func readFrame(br *bufio.Reader, max int) ([]byte, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		if len(line)+len(chunk) > max+1 || (err != nil && len(line)+len(chunk) > max) {
			return nil, errFrameTooLong
		}
		line = append(line, chunk...)
		switch {
		case err == nil:
			return line[:len(line)-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF) && len(line) > 0:
			return nil, io.ErrUnexpectedEOF
		default:
			return nil, err
		}
	}
}

// encodeRequest is one request frame, newline included.
func encodeRequest(id int64, op string, fields map[string]any) ([]byte, error) {
	m := make(map[string]any, len(fields)+2)
	for k, v := range fields {
		m[k] = v
	}
	m["id"], m["op"] = id, op
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxFrameBytes {
		return nil, errFrameTooLong
	}
	return append(b, '\n'), nil
}

// frameRef names the reply to one request in messages; what is the call
// it belongs to ("train of iteration 3"), the messages' context.
type frameRef struct {
	op   string
	id   int64
	what string
}

func (f frameRef) String() string { return fmt.Sprintf("reply to %s (id %d)", f.op, f.id) }

// prefix is the context of f's messages.
func (f frameRef) prefix() string {
	if f.what == "" {
		return ""
	}
	return f.what + ": "
}

// protocolError is a Protocol error about the frame f.
func (f frameRef) protocolError(format string, args ...any) *Error {
	return &Error{Kind: Protocol, Msg: f.prefix() + "trainer protocol: " + f.String() + ": " + fmt.Sprintf(format, args...)}
}

// reply is one decoded reply frame whose id matched and whose ok was true;
// its fields are read, checked, through the typed getters.
type reply struct {
	ref    frameRef
	fields map[string]json.RawMessage
}

// decodeReply parses a reply line to ref's request: a JSON object with the
// request's id and ok. An ok:false reply is a Refused error carrying the
// trainer's text.
func decodeReply(ref frameRef, line []byte) (*reply, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(line, &fields); err != nil || fields == nil {
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			return nil, ref.protocolError("not a JSON object (syntax error at byte %d)", syn.Offset)
		}
		return nil, ref.protocolError("not a JSON object")
	}
	r := &reply{ref: ref, fields: fields}
	id, err := r.int("id")
	if err != nil {
		return nil, err
	}
	if id != ref.id {
		return nil, ref.protocolError("id %d, want %d", id, ref.id)
	}
	ok, err := r.bool("ok")
	if err != nil {
		return nil, err
	}
	if !ok {
		text, err := r.str("error")
		if err != nil {
			return nil, err
		}
		return nil, &Error{Kind: Refused, Msg: ref.prefix() + "refused by the trainer: " + truncate(text, maxRefusalText)}
	}
	return r, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

// jsonType names a JSON value's type for messages.
func jsonType(raw []byte) string {
	raw = bytes.TrimLeft(raw, " \t\r\n")
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '"':
		return "string"
	case '{':
		return "object"
	case '[':
		return "array"
	case 't', 'f':
		return "bool"
	case 'n':
		return "null"
	}
	return "number"
}

func (r *reply) raw(name string) (json.RawMessage, error) {
	v, ok := r.fields[name]
	if !ok {
		return nil, r.ref.protocolError("field %q missing", name)
	}
	return v, nil
}

func (r *reply) int(name string) (int64, error) {
	v, err := r.raw(name)
	if err != nil {
		return 0, err
	}
	return parseInt(r.ref, name, v)
}

func (r *reply) num(name string) (float64, error) {
	v, err := r.raw(name)
	if err != nil {
		return 0, err
	}
	return parseNum(r.ref, name, v)
}

// seconds is a duration field: a number >= 0.
func (r *reply) seconds(name string) (float64, error) {
	f, err := r.num(name)
	if err == nil && f < 0 {
		return 0, r.ref.protocolError("field %q: negative", name)
	}
	return f, err
}

func (r *reply) str(name string) (string, error) {
	v, err := r.raw(name)
	if err != nil {
		return "", err
	}
	return parseStr(r.ref, name, v)
}

// optStr is a string field that may be missing or null ("").
func (r *reply) optStr(name string) (string, error) {
	v, ok := r.fields[name]
	if !ok || jsonType(v) == "null" {
		return "", nil
	}
	return parseStr(r.ref, name, v)
}

func (r *reply) bool(name string) (bool, error) {
	v, err := r.raw(name)
	if err != nil {
		return false, err
	}
	var b bool
	if jsonType(v) != "bool" || json.Unmarshal(v, &b) != nil {
		return false, r.ref.protocolError("field %q: want a bool, got %s", name, jsonType(v))
	}
	return b, nil
}

func parseInt(ref frameRef, name string, v json.RawMessage) (int64, error) {
	if jsonType(v) != "number" {
		return 0, ref.protocolError("field %q: want an integer, got %s", name, jsonType(v))
	}
	n, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
	if err != nil {
		return 0, ref.protocolError("field %q: want an integer, got another number", name)
	}
	return n, nil
}

func parseNum(ref frameRef, name string, v json.RawMessage) (float64, error) {
	var f float64
	if jsonType(v) != "number" || json.Unmarshal(v, &f) != nil {
		return 0, ref.protocolError("field %q: want a number, got %s", name, jsonType(v))
	}
	return f, nil
}

func parseStr(ref frameRef, name string, v json.RawMessage) (string, error) {
	var s string
	if jsonType(v) != "string" || json.Unmarshal(v, &s) != nil {
		return "", ref.protocolError("field %q: want a string, got %s", name, jsonType(v))
	}
	return s, nil
}

func parseObject(ref frameRef, name string, v json.RawMessage) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	if jsonType(v) != "object" || json.Unmarshal(v, &m) != nil {
		return nil, ref.protocolError("field %q: want an object, got %s", name, jsonType(v))
	}
	return m, nil
}

func parseArray(ref frameRef, name string, v json.RawMessage) ([]json.RawMessage, error) {
	var a []json.RawMessage
	if jsonType(v) != "array" || json.Unmarshal(v, &a) != nil {
		return nil, ref.protocolError("field %q: want an array, got %s", name, jsonType(v))
	}
	return a, nil
}

// nonNegative checks an integer field that counts something.
func (r *reply) nonNegative(name string) (int64, error) {
	n, err := r.int(name)
	if err == nil && n < 0 {
		return 0, r.ref.protocolError("field %q: %d, want >= 0", name, n)
	}
	return n, err
}

// helloReply is hello's answer.
type helloReply struct {
	Protocol, PID, Device, Iteration int64
	Framework                        string
}

func decodeHello(r *reply) (h helloReply, err error) {
	if h.Protocol, err = r.int("protocol"); err != nil {
		return h, err
	}
	if h.Protocol != ProtocolVersion {
		return h, r.ref.protocolError("field \"protocol\": %d, want %d", h.Protocol, ProtocolVersion)
	}
	if h.PID, err = r.int("pid"); err != nil {
		return h, err
	}
	if h.PID <= 0 {
		return h, r.ref.protocolError("field \"pid\": %d, want > 0", h.PID)
	}
	if h.Device, err = r.nonNegative("device"); err != nil {
		return h, err
	}
	if h.Framework, err = r.str("framework"); err != nil {
		return h, err
	}
	h.Iteration, err = r.nonNegative("iteration")
	return h, err
}

// loadReply is load's answer.
type loadReply struct {
	Iteration int64
	Seconds   float64
}

func decodeLoad(r *reply) (l loadReply, err error) {
	if l.Iteration, err = r.nonNegative("iteration"); err != nil {
		return l, err
	}
	l.Seconds, err = r.seconds("seconds")
	return l, err
}

// trainReply is train's answer.
type trainReply struct {
	Iteration             int64
	Metrics               map[string]float64
	Seconds, StepDoneUnix float64
}

func decodeTrain(r *reply) (t trainReply, err error) {
	if t.Iteration, err = r.nonNegative("iteration"); err != nil {
		return t, err
	}
	v, err := r.raw("metrics")
	if err != nil {
		return t, err
	}
	m, err := parseObject(r.ref, "metrics", v)
	if err != nil {
		return t, err
	}
	t.Metrics = make(map[string]float64, len(m))
	for k, v := range m {
		if t.Metrics[k], err = parseNum(r.ref, "metrics."+truncate(k, maxKeyText), v); err != nil {
			return t, err
		}
	}
	if t.Seconds, err = r.seconds("seconds"); err != nil {
		return t, err
	}
	t.StepDoneUnix, err = r.num("step_done_unix")
	return t, err
}

// saveReply is save's answer.
type saveReply struct {
	Path    string
	Bytes   int64
	Seconds float64
}

func decodeSave(r *reply) (s saveReply, err error) {
	if s.Path, err = r.str("path"); err != nil {
		return s, err
	}
	if s.Bytes, err = r.nonNegative("bytes"); err != nil {
		return s, err
	}
	s.Seconds, err = r.seconds("seconds")
	return s, err
}

// decodePublish reads publish's answer into a Snapshot and validates it in
// full (Snapshot.Validate); Owner is the caller's to fill. wantRefs says
// whether the request asked for ipc_refs: the reply must then carry them,
// and must not otherwise.
func decodePublish(r *reply, wantRefs bool) (*Snapshot, error) {
	s := &Snapshot{}
	var err error
	if s.Version, err = r.str("version"); err != nil {
		return nil, err
	}
	if s.IPC, err = r.str("ipc"); err != nil {
		return nil, err
	}
	switch s.IPC {
	case IPCCUDA:
		h, err := r.str("handle")
		if err != nil {
			return nil, err
		}
		if s.Handle, err = base64.StdEncoding.DecodeString(h); err != nil {
			return nil, r.ref.protocolError("field \"handle\": not standard base64")
		}
	case IPCFakeShm:
		if s.Path, err = r.str("path"); err != nil {
			return nil, err
		}
	default:
		return nil, r.ref.protocolError("field \"ipc\": want %q or %q", IPCCUDA, IPCFakeShm)
	}
	if s.StorageBytes, err = r.int("storage_bytes"); err != nil {
		return nil, err
	}
	if s.StorageOffset, err = r.int("storage_offset"); err != nil {
		return nil, err
	}
	device, err := r.int("device")
	if err != nil {
		return nil, err
	}
	if device < 0 || device > 1<<20 {
		return nil, r.ref.protocolError("field \"device\": %d, want a CUDA ordinal", device)
	}
	s.Device = int(device)
	if s.GPUUUID, err = r.optStr("gpu_uuid"); err != nil {
		return nil, err
	}
	if s.SnapshotSeconds, err = r.seconds("snapshot_seconds"); err != nil {
		return nil, err
	}
	v, err := r.raw("tensors")
	if err != nil {
		return nil, err
	}
	list, err := parseArray(r.ref, "tensors", v)
	if err != nil {
		return nil, err
	}
	s.Tensors = make([]Tensor, len(list))
	for i, raw := range list {
		if s.Tensors[i], err = decodeTensor(r.ref, fmt.Sprintf("tensors[%d]", i), raw); err != nil {
			return nil, err
		}
	}
	if s.Refs, err = decodeRefs(r, wantRefs); err != nil {
		return nil, err
	}
	if err := s.Validate(); err != nil {
		return nil, r.ref.protocolError("%v", err)
	}
	return s, nil
}

// decodeRefs reads the reply's ipc_refs: nil when not asked (and then
// absent), a non-nil slice when asked; their count and bounds are
// Snapshot.Validate's to check.
func decodeRefs(r *reply, want bool) ([]IPCRef, error) {
	v, present := r.fields["ipc_refs"]
	switch {
	case !want && present:
		return nil, r.ref.protocolError("field \"ipc_refs\": present, but the publish did not ask for it")
	case !want:
		return nil, nil
	case !present:
		return nil, r.ref.protocolError("field \"ipc_refs\" missing (the publish asked for it)")
	}
	list, err := parseArray(r.ref, "ipc_refs", v)
	if err != nil {
		return nil, err
	}
	refs := make([]IPCRef, len(list))
	for i, raw := range list {
		if refs[i], err = decodeRef(r.ref, fmt.Sprintf("ipc_refs[%d]", i), raw); err != nil {
			return nil, err
		}
	}
	return refs, nil
}

// member is obj's field name, or the protocol error that field.name is
// missing.
func member(ref frameRef, obj map[string]json.RawMessage, field, name string) (json.RawMessage, error) {
	v, ok := obj[name]
	if !ok {
		return nil, ref.protocolError("field %q missing", field+"."+name)
	}
	return v, nil
}

func decodeRef(ref frameRef, field string, raw json.RawMessage) (out IPCRef, err error) {
	obj, err := parseObject(ref, field, raw)
	if err != nil {
		return out, err
	}
	get := func(name string) (json.RawMessage, error) { return member(ref, obj, field, name) }
	// b64 decodes a base64 field; null is nil when nullable.
	b64 := func(name string, nullable bool) ([]byte, error) {
		v, err := get(name)
		if err != nil || (nullable && jsonType(v) == "null") {
			return nil, err
		}
		text, err := parseStr(ref, field+"."+name, v)
		if err != nil {
			return nil, err
		}
		b, err := base64.StdEncoding.DecodeString(text)
		if err != nil {
			return nil, ref.protocolError("field %q: not standard base64", field+"."+name)
		}
		return b, nil
	}
	if out.CounterHandle, err = b64("ref_counter_handle", false); err != nil {
		return out, err
	}
	v, err := get("ref_counter_offset")
	if err == nil {
		out.CounterOffset, err = parseInt(ref, field+".ref_counter_offset", v)
	}
	if err != nil {
		return out, err
	}
	if out.EventHandle, err = b64("event_handle", true); err != nil {
		return out, err
	}
	if v, err = get("event_sync_required"); err != nil {
		return out, err
	}
	if jsonType(v) != "bool" || json.Unmarshal(v, &out.EventSyncRequired) != nil {
		return out, ref.protocolError("field %q: want a bool, got %s", field+".event_sync_required", jsonType(v))
	}
	return out, nil
}

func decodeTensor(ref frameRef, field string, raw json.RawMessage) (t Tensor, err error) {
	obj, err := parseObject(ref, field, raw)
	if err != nil {
		return t, err
	}
	get := func(name string) (json.RawMessage, error) { return member(ref, obj, field, name) }
	v, err := get("name")
	if err == nil {
		t.Name, err = parseStr(ref, field+".name", v)
	}
	if err != nil {
		return t, err
	}
	if v, err = get("dtype"); err == nil {
		t.DType, err = parseStr(ref, field+".dtype", v)
	}
	if err != nil {
		return t, err
	}
	if v, err = get("shape"); err != nil {
		return t, err
	}
	dims, err := parseArray(ref, field+".shape", v)
	if err != nil {
		return t, err
	}
	t.Shape = make([]int64, len(dims))
	for k, d := range dims {
		if t.Shape[k], err = parseInt(ref, fmt.Sprintf("%s.shape[%d]", field, k), d); err != nil {
			return t, err
		}
	}
	if v, err = get("offset"); err == nil {
		t.Offset, err = parseInt(ref, field+".offset", v)
	}
	if err != nil {
		return t, err
	}
	if v, err = get("bytes"); err == nil {
		t.Bytes, err = parseInt(ref, field+".bytes", v)
	}
	return t, err
}
