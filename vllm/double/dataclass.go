package double

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// kind is the JSON type a dataclass field must hold.
type kind int

const (
	kStr kind = iota
	kInt
	kBool
	kStrList
	kShapes // list of lists of non-negative ints
	kAny    // any non-null value (a field the handler refuses itself, with its own message)
)

func (k kind) String() string {
	return [...]string{"a string", "an integer", "a boolean", "a list of strings", "a list of lists of integers", "any value"}[k]
}

type field struct {
	name     string
	kind     kind
	required bool
}

// dataclass emulates vLLM's strict payload dataclasses: Cls(**info) raises
// TypeError on an unknown or missing key, which the server turns into a 500.
type dataclass struct {
	name   string
	fields []field
}

// decode checks raw like Cls(**raw) and then the field types (which Python
// would only trip over later, still inside the worker: also a 500). It
// returns the present, non-null fields.
func (d dataclass) decode(raw json.RawMessage) (map[string]json.RawMessage, error) {
	keys, obj, err := orderedObject(raw)
	if err != nil {
		return nil, workerError("TypeError: %s() argument after ** must be a mapping, not %s", d.name, pyType(raw))
	}
	for _, k := range keys { // Python reports the first unexpected keyword, in order
		if d.field(k) == nil {
			return nil, workerError("TypeError: %s.__init__() got an unexpected keyword argument '%s'", d.name, k)
		}
	}
	var missing []string
	for _, f := range d.fields {
		if _, ok := obj[f.name]; f.required && !ok {
			missing = append(missing, "'"+f.name+"'")
		}
	}
	if len(missing) > 0 {
		return nil, workerError("TypeError: %s.__init__() missing %d required positional argument%s: %s",
			d.name, len(missing), plural(len(missing)), pyJoin(missing))
	}
	out := map[string]json.RawMessage{}
	for _, f := range d.fields {
		v, ok := obj[f.name]
		if !ok || isNull(v) {
			if ok && f.required {
				return nil, workerError("ValueError: %s.%s must be %s, got None", d.name, f.name, f.kind)
			}
			continue
		}
		if !hasKind(v, f.kind) {
			return nil, workerError("ValueError: %s.%s must be %s, got %s", d.name, f.name, f.kind, clip(string(v)))
		}
		out[f.name] = v
	}
	return out, nil
}

func (d dataclass) field(name string) *field {
	for i := range d.fields {
		if d.fields[i].name == name {
			return &d.fields[i]
		}
	}
	return nil
}

// orderedObject parses a JSON object keeping its key order (later
// duplicates win, as in Python).
func orderedObject(raw json.RawMessage) ([]string, map[string]json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, nil, fmt.Errorf("not an object")
	}
	var keys []string
	obj := map[string]json.RawMessage{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		k, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, err
		}
		if _, dup := obj[k]; !dup {
			keys = append(keys, k)
		}
		obj[k] = v
	}
	return keys, obj, nil
}

func hasKind(v json.RawMessage, k kind) bool {
	switch k {
	case kStr:
		var s string
		return json.Unmarshal(v, &s) == nil
	case kInt:
		var n int64
		return json.Unmarshal(v, &n) == nil
	case kBool:
		var b bool
		return json.Unmarshal(v, &b) == nil
	case kStrList:
		var l []string
		return json.Unmarshal(v, &l) == nil && l != nil
	case kAny:
		return true
	case kShapes:
		var l [][]int64
		if json.Unmarshal(v, &l) != nil || l == nil {
			return false
		}
		for _, s := range l {
			if s == nil {
				return false
			}
			for _, d := range s {
				if d < 0 {
					return false
				}
			}
		}
		return true
	}
	return false
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// pyJoin joins like Python's TypeError text: 'a', 'a' and 'b', 'a', 'b', and 'c'.
func pyJoin(items []string) string {
	switch len(items) {
	case 1:
		return items[0]
	case 2:
		return items[0] + " and " + items[1]
	}
	return strings.Join(items[:len(items)-1], ", ") + ", and " + items[len(items)-1]
}

func clip(s string) string {
	if len(s) > 200 {
		return s[:200] + "..."
	}
	return s
}

// Payload classes per backend and generation (spec section 0 and 1).
var (
	diskInitInfo   = dataclass{"DiskWeightTransferInitInfo", nil}
	diskUpdateInfo = dataclass{"DiskWeightTransferUpdateInfo", []field{{"path", kStr, true}}}
)

// The ipc backend's classes (vLLM's ipc_engine.py): init takes nothing;
// ipc_handles is the Ray form, which the handler refuses over HTTP.
var (
	ipcInitInfo   = dataclass{"IPCWeightTransferInitInfo", nil}
	ipcUpdateInfo = dataclass{"IPCWeightTransferUpdateInfo", []field{
		{"names", kStrList, true},
		{"dtype_names", kStrList, true},
		{"shapes", kShapes, true},
		{"ipc_handles", kAny, false},
		{"ipc_handles_pickled", kStr, false},
	}}
)

func ncclInitInfo(g Generation) dataclass {
	d := dataclass{ncclClassPrefix(g) + "InitInfo", []field{
		{"master_address", kStr, true},
		{"master_port", kInt, true},
		{"rank_offset", kInt, true},
		{"world_size", kInt, true},
	}}
	if g.packedInInit() {
		// The id may replace the TCPStore address, so neither is required
		// by the class itself; the handler checks that one of them is there.
		d.fields[0].required, d.fields[1].required = false, false
		d.fields = append(d.fields, packedFields...)
		d.fields = append(d.fields, field{"nccl_unique_id_b64", kStr, false})
	}
	return d
}

func ncclUpdateInfo(g Generation) dataclass {
	d := dataclass{ncclClassPrefix(g) + "UpdateInfo", []field{
		{"names", kStrList, true},
		{"dtype_names", kStrList, true},
		{"shapes", kShapes, true},
	}}
	switch {
	case g.packedSizeFromGPU(): // A: packed only, the size is the worker's
		d.fields = append(d.fields, packedFields[0])
	case !g.packedInInit():
		d.fields = append(d.fields, packedFields...)
	}
	return d
}

// ncclClassPrefix names the NCCL payload classes as vLLM does: A's
// nccl_engine called them NCCLInitInfo and NCCLUpdateInfo.
func ncclClassPrefix(g Generation) string {
	if g == GenA {
		return "NCCL"
	}
	return "NCCLWeightTransfer"
}

// packedFields: packed first (A takes only that one).
var packedFields = []field{
	{"packed", kBool, false},
	{"packed_buffer_size_bytes", kInt, false},
	{"packed_num_buffers", kInt, false},
}

// get decodes a present field into v (its kind was checked by decode).
func get[T any](m map[string]json.RawMessage, name string) (T, bool) {
	var v T
	raw, ok := m[name]
	if !ok {
		return v, false
	}
	return v, json.Unmarshal(raw, &v) == nil
}
