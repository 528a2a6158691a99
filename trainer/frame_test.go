package trainer

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/internal/goldenfile"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func golden(t *testing.T, name, got string) {
	t.Helper()
	goldenfile.Check(t, name, got, *update, "go test ./trainer -update")
}

// decodeAs decodes line as the reply to op (id 7) with op's decoder;
// "publish-refs" is a publish that asked for ipc_refs.
func decodeAs(op string, line string) error {
	r, err := decodeReply(frameRef{op: strings.TrimSuffix(op, "-refs"), id: 7}, []byte(line))
	if err != nil {
		return err
	}
	switch op {
	case "hello":
		_, err = decodeHello(r)
	case "load":
		_, err = decodeLoad(r)
	case "train":
		_, err = decodeTrain(r)
	case "save":
		_, err = decodeSave(r)
	case "publish":
		_, err = decodePublish(r, false)
	case "publish-refs":
		_, err = decodePublish(r, true)
	}
	return err
}

const okHello = `{"id":7,"ok":true,"protocol":1,"pid":42,"device":0,"framework":"torch 2.11.0","iteration":0}`

// publishWith is a valid publish reply with tensors replaced.
func publishWith(tensors string, extra ...string) string {
	fields := `"version":"v1","ipc":"fake_shm","path":"/dev/shm/s","storage_bytes":64,"storage_offset":0,"device":0,"snapshot_seconds":0.1`
	for _, e := range extra {
		fields = e
	}
	return `{"id":7,"ok":true,` + fields + `,"tensors":` + tensors + `}`
}

const twoTensors = `[{"name":"a","dtype":"float32","shape":[2,2],"offset":0,"bytes":16},{"name":"b","dtype":"bfloat16","shape":[3],"offset":16,"bytes":6}]`

// Two ipc_refs for twoTensors: "/torch_1_2_0" slots 0 and 1, the second
// with a 64-byte event handle of 0x07s.
var (
	eventB64 = base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, IPCEventHandleBytes))
	twoRefs  = `"ipc_refs":[{"ref_counter_handle":"L3RvcmNoXzFfMl8w","ref_counter_offset":0,"event_handle":null,"event_sync_required":false},` +
		`{"ref_counter_handle":"L3RvcmNoXzFfMl8w","ref_counter_offset":1,"event_handle":"` + eventB64 + `","event_sync_required":true}]`
)

// publishRefs is a valid publish reply with ipc_refs: twoRefs with old
// replaced by new (all of it when old is "").
func publishRefs(old, new string) string {
	refs := twoRefs
	if old == "" {
		refs = new
	} else {
		refs = strings.Replace(refs, old, new, 1)
	}
	return publishWith(twoTensors, `"version":"v1","ipc":"fake_shm","path":"/dev/shm/s","storage_bytes":64,"storage_offset":0,"device":0,"snapshot_seconds":0.1,`+refs)
}

func TestReplyErrorsGolden(t *testing.T) {
	base := `"version":"v1","ipc":"fake_shm","path":"/dev/shm/s","storage_bytes":64,"storage_offset":0,"device":0,"snapshot_seconds":0.1`
	cases := []struct{ name, op, line string }{
		{"wrong id", "hello", strings.Replace(okHello, `"id":7`, `"id":8`, 1)},
		{"bad json", "hello", `{"id":7,"ok":tru}`},
		{"not an object", "hello", `[1,2]`},
		{"null", "hello", `null`},
		{"empty line", "hello", ``},
		{"id missing", "hello", `{"ok":true}`},
		{"id a string", "hello", `{"id":"7","ok":true}`},
		{"id a fraction", "hello", `{"id":7.5,"ok":true}`},
		{"ok missing", "hello", `{"id":7}`},
		{"ok a string", "hello", `{"id":7,"ok":"yes"}`},
		{"refusal without text", "train", `{"id":7,"ok":false}`},
		{"refusal", "train", `{"id":7,"ok":false,"error":"CUDA out of memory"}`},
		{"hello protocol 2", "hello", strings.Replace(okHello, `"protocol":1`, `"protocol":2`, 1)},
		{"hello pid 0", "hello", strings.Replace(okHello, `"pid":42`, `"pid":0`, 1)},
		{"hello device missing", "hello", strings.Replace(okHello, `"device":0,`, ``, 1)},
		{"hello framework a number", "hello", strings.Replace(okHello, `"torch 2.11.0"`, `2`, 1)},
		{"hello iteration negative", "hello", strings.Replace(okHello, `"iteration":0`, `"iteration":-1`, 1)},
		{"load seconds missing", "load", `{"id":7,"ok":true,"iteration":2}`},
		{"train metrics an array", "train", `{"id":7,"ok":true,"iteration":3,"metrics":[],"seconds":1,"step_done_unix":1}`},
		{"train metric a string", "train", `{"id":7,"ok":true,"iteration":3,"metrics":{"loss":"low"},"seconds":1,"step_done_unix":1}`},
		{"train metric with a long name", "train", `{"id":7,"ok":true,"iteration":3,"metrics":{"` + strings.Repeat("m", 100) + `":null},"seconds":1,"step_done_unix":1}`},
		{"train seconds negative", "train", `{"id":7,"ok":true,"iteration":3,"metrics":{},"seconds":-1,"step_done_unix":1}`},
		{"train step_done_unix missing", "train", `{"id":7,"ok":true,"iteration":3,"metrics":{},"seconds":1}`},
		{"train iteration a fraction", "train", `{"id":7,"ok":true,"iteration":3.5,"metrics":{},"seconds":1,"step_done_unix":1}`},
		{"save path missing", "save", `{"id":7,"ok":true,"bytes":1,"seconds":1}`},
		{"save bytes negative", "save", `{"id":7,"ok":true,"path":"/c/ckpt-2","bytes":-1,"seconds":1}`},
		{"publish ipc unknown", "publish", publishWith(twoTensors, strings.Replace(base, "fake_shm", "tcp", 1))},
		{"publish handle not base64", "publish", publishWith(twoTensors, strings.Replace(base, `"ipc":"fake_shm","path":"/dev/shm/s"`, `"ipc":"cuda","handle":"%%%"`, 1))},
		{"publish handle empty", "publish", publishWith(twoTensors, strings.Replace(base, `"ipc":"fake_shm","path":"/dev/shm/s"`, `"ipc":"cuda","handle":""`, 1))},
		{"publish path relative", "publish", publishWith(twoTensors, strings.Replace(base, "/dev/shm/s", "s", 1))},
		{"publish version empty", "publish", publishWith(twoTensors, strings.Replace(base, `"v1"`, `""`, 1))},
		{"publish storage_bytes 0", "publish", publishWith(twoTensors, strings.Replace(base, `"storage_bytes":64`, `"storage_bytes":0`, 1))},
		{"publish storage_offset negative", "publish", publishWith(twoTensors, strings.Replace(base, `"storage_offset":0`, `"storage_offset":-8`, 1))},
		{"publish device negative", "publish", publishWith(twoTensors, strings.Replace(base, `"device":0`, `"device":-1`, 1))},
		{"publish gpu_uuid a number", "publish", publishWith(twoTensors, base+`,"gpu_uuid":5`)},
		{"publish snapshot_seconds missing", "publish", publishWith(twoTensors, strings.Replace(base, `,"snapshot_seconds":0.1`, ``, 1))},
		{"publish tensors missing", "publish", `{"id":7,"ok":true,` + base + `}`},
		{"publish tensors an object", "publish", publishWith(`{}`, base)},
		{"publish tensors empty", "publish", publishWith(`[]`, base)},
		{"publish tensor not an object", "publish", publishWith(`[1]`, base)},
		{"publish tensor name missing", "publish", publishWith(`[{"dtype":"float32","shape":[2],"offset":0,"bytes":8}]`, base)},
		{"publish tensor name empty", "publish", publishWith(`[{"name":"","dtype":"float32","shape":[2],"offset":0,"bytes":8}]`, base)},
		{"publish tensor names repeated", "publish", publishWith(strings.Replace(twoTensors, `"name":"b"`, `"name":"a"`, 1), base)},
		{"publish tensor dtype unknown", "publish", publishWith(strings.Replace(twoTensors, "bfloat16", "complex64", 1), base)},
		{"publish tensor shape not integers", "publish", publishWith(strings.Replace(twoTensors, `[3]`, `[3.5]`, 1), base)},
		{"publish tensor shape negative", "publish", publishWith(strings.Replace(twoTensors, `[3]`, `[-3]`, 1), base)},
		{"publish tensor shape overflowing", "publish", publishWith(strings.Replace(twoTensors, `[3]`, `[4294967296,4294967296]`, 1), base)},
		{"publish tensor bytes not shape x size", "publish", publishWith(strings.Replace(twoTensors, `"bytes":6`, `"bytes":12`, 1), base)},
		{"publish tensor offset negative", "publish", publishWith(strings.Replace(twoTensors, `"offset":0`, `"offset":-4`, 1), base)},
		{"publish tensor offset misaligned", "publish", publishWith(strings.Replace(twoTensors, `"offset":16`, `"offset":17`, 1), base)},
		{"publish tensors overlapping", "publish", publishWith(strings.Replace(twoTensors, `"offset":16`, `"offset":14`, 1), base)},
		{"publish tensors out of order", "publish", publishWith(`[{"name":"a","dtype":"float32","shape":[2],"offset":8,"bytes":8},{"name":"b","dtype":"float32","shape":[2],"offset":0,"bytes":8}]`, base)},
		{"publish tensor past storage_bytes", "publish", publishWith(strings.Replace(twoTensors, `"offset":16`, `"offset":60`, 1), base)},
		{"publish ipc_refs unasked", "publish", publishRefs("", twoRefs)},
		{"publish ipc_refs null unasked", "publish", publishRefs("", `"ipc_refs":null`)},
		{"publish ipc_refs missing", "publish-refs", publishWith(twoTensors)},
		{"publish ipc_refs null", "publish-refs", publishRefs("", `"ipc_refs":null`)},
		{"publish ipc_refs an object", "publish-refs", publishRefs("", `"ipc_refs":{}`)},
		{"publish ipc_refs empty", "publish-refs", publishRefs("", `"ipc_refs":[]`)},
		{"publish ipc_refs one short", "publish-refs", publishRefs("", twoRefs[:strings.Index(twoRefs, "},{")]+"}]")},
		{"publish ipc_ref not an object", "publish-refs", publishRefs("", `"ipc_refs":[1,2]`)},
		{"publish ipc_ref counter handle missing", "publish-refs", publishRefs(`"ref_counter_handle":"L3RvcmNoXzFfMl8w",`, ``)},
		{"publish ipc_ref counter handle not base64", "publish-refs", publishRefs(`"L3RvcmNoXzFfMl8w"`, `"/torch_1_2_0"`)},
		{"publish ipc_ref counter handle unpadded", "publish-refs", publishRefs(`"L3RvcmNoXzFfMl8w"`, `"L3RvcmNoXzFfMl8"`)},
		{"publish ipc_ref counter handle null", "publish-refs", publishRefs(`"L3RvcmNoXzFfMl8w"`, `null`)},
		{"publish ipc_ref counter handle empty", "publish-refs", publishRefs(`"L3RvcmNoXzFfMl8w"`, `""`)},
		{"publish ipc_ref counter handle too long", "publish-refs", publishRefs(`"L3RvcmNoXzFfMl8w"`, `"`+base64.StdEncoding.EncodeToString(make([]byte, MaxRefCounterHandleBytes+1))+`"`)},
		{"publish ipc_ref offset missing", "publish-refs", publishRefs(`"ref_counter_offset":0,`, ``)},
		{"publish ipc_ref offset negative", "publish-refs", publishRefs(`"ref_counter_offset":0`, `"ref_counter_offset":-1`)},
		{"publish ipc_ref offset a fraction", "publish-refs", publishRefs(`"ref_counter_offset":0`, `"ref_counter_offset":0.5`)},
		{"publish ipc_ref offset a string", "publish-refs", publishRefs(`"ref_counter_offset":0`, `"ref_counter_offset":"0"`)},
		{"publish ipc_ref event handle missing", "publish-refs", publishRefs(`"event_handle":null,`, ``)},
		{"publish ipc_ref event handle a number", "publish-refs", publishRefs(`"event_handle":null`, `"event_handle":0`)},
		{"publish ipc_ref event handle not base64", "publish-refs", publishRefs(`"event_handle":null`, `"event_handle":"%%"`)},
		{"publish ipc_ref event handle empty", "publish-refs", publishRefs(`"event_handle":null`, `"event_handle":""`)},
		{"publish ipc_ref event handle 63 bytes", "publish-refs", publishRefs(`"`+eventB64+`"`, `"`+base64.StdEncoding.EncodeToString(make([]byte, 63))+`"`)},
		{"publish ipc_ref event handle 66 bytes", "publish-refs", publishRefs(`"`+eventB64+`"`, `"`+base64.StdEncoding.EncodeToString(make([]byte, 66))+`"`)},
		{"publish ipc_ref event sync without an event handle", "publish-refs", publishRefs(`"event_handle":null,"event_sync_required":false`, `"event_handle":null,"event_sync_required":true`)},
		{"publish ipc_ref event_sync_required missing", "publish-refs", publishRefs(`,"event_sync_required":false`, ``)},
		{"publish ipc_ref event_sync_required a number", "publish-refs", publishRefs(`"event_sync_required":true`, `"event_sync_required":1`)},
	}
	var b strings.Builder
	for _, tc := range cases {
		err := decodeAs(tc.op, tc.line)
		var e *Error
		require.True(t, errors.As(err, &e), "%s: %v", tc.name, err)
		fmt.Fprintf(&b, "%s (%s)\n\t%s\n", tc.name, e.Kind, e.Msg)
	}
	golden(t, "reply_errors.golden", b.String())
}

func TestValidRepliesDecode(t *testing.T) {
	require.NoError(t, decodeAs("hello", okHello+"  "))
	require.NoError(t, decodeAs("train", `{"id":7,"ok":true,"iteration":3,"metrics":{"loss":0.5,"n":2},"seconds":1,"step_done_unix":1.5,"new_field":[1]}`),
		"an unknown key in a reply is ignored")
	r, err := decodeReply(frameRef{op: "publish", id: 7}, []byte(publishWith(twoTensors)))
	require.NoError(t, err)
	s, err := decodePublish(r, false)
	require.NoError(t, err)
	assert.Equal(t, &Snapshot{Version: "v1", IPC: IPCFakeShm, Path: "/dev/shm/s", StorageBytes: 64, Device: 0, SnapshotSeconds: 0.1,
		Tensors: []Tensor{{"a", "float32", []int64{2, 2}, 0, 16}, {"b", "bfloat16", []int64{3}, 16, 6}}}, s)
	assert.Equal(t, int64(22), s.Bytes())
	err = decodeAs("train", `{"id":7,"ok":false,"error":"`+strings.Repeat("é", 1500)+`"}`)
	require.Error(t, err)
	assert.Len(t, err.Error(), len("refused by the trainer: ")+maxRefusalText+len("..."), "a long refusal is cut at a rune's start")
	r, err = decodeReply(frameRef{op: "publish", id: 7}, []byte(publishRefs("", twoRefs+`,"new_field":1`)))
	require.NoError(t, err)
	s, err = decodePublish(r, true)
	require.NoError(t, err)
	assert.Equal(t, []IPCRef{{CounterHandle: []byte("/torch_1_2_0"), CounterOffset: 0},
		{CounterHandle: []byte("/torch_1_2_0"), CounterOffset: 1, EventHandle: bytes.Repeat([]byte{7}, IPCEventHandleBytes), EventSyncRequired: true}}, s.Refs)
	require.NoError(t, decodeAs("publish-refs", publishRefs(`,"event_sync_required":false}`, `,"event_sync_required":false,"extra":[]}`)),
		"an unknown key in an ipc_refs entry is ignored, as in the rest of a reply")
	// A zero-size tensor takes no room; the next may start at its offset.
	require.NoError(t, decodeAs("publish", publishWith(`[{"name":"a","dtype":"int64","shape":[0],"offset":0,"bytes":0},{"name":"b","dtype":"int64","shape":[],"offset":0,"bytes":8}]`)))
}

func TestReadFrame(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		max      int
		want     []string
		err      error
	}{
		{"lines", "a\nbb\n", 10, []string{"a", "bb"}, io.EOF},
		{"exactly max", "abcd\n", 4, []string{"abcd"}, io.EOF},
		{"one over max", "abcde\n", 4, nil, errFrameTooLong},
		{"over max without a newline", "abcde", 4, nil, errFrameTooLong},
		{"cut short", "a\nbb", 10, []string{"a"}, io.ErrUnexpectedEOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			br := bufio.NewReaderSize(strings.NewReader(tc.in), 16) // smaller than a frame: several reads
			var got []string
			for {
				line, err := readFrame(br, tc.max)
				if err != nil {
					assert.ErrorIs(t, err, tc.err)
					break
				}
				got = append(got, string(line))
			}
			assert.Equal(t, tc.want, got)
		})
	}
	big := strings.Repeat("x", MaxFrameBytes) + "\n"
	line, err := readFrame(bufio.NewReader(strings.NewReader(big+big[:MaxFrameBytes-1]+"yy\n")), MaxFrameBytes)
	require.NoError(t, err)
	assert.Len(t, line, MaxFrameBytes)
}

// FuzzDecodeReply: no reply line panics a decoder, every error is a
// Protocol or Refused *Error, and a Protocol message stays short (it names
// fields, never quotes the frame).
func FuzzDecodeReply(f *testing.F) {
	for _, s := range []string{okHello, publishWith(twoTensors), `{"id":7,"ok":false,"error":"x"}`,
		`{"id":7,"ok":true,"iteration":3,"metrics":{"loss":0.5},"seconds":1,"step_done_unix":1}`,
		`{"id":7,"ok":true,"path":"/c","bytes":1,"seconds":1}`, `{"id":7,"ok":true,"iteration":1,"seconds":0}`,
		publishRefs("", twoRefs), publishRefs(`"event_handle":null`, `"event_handle":""`), publishRefs("", `"ipc_refs":[]`)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		for _, op := range []string{"hello", "load", "train", "save", "publish", "publish-refs", "release"} {
			err := decodeAs(op, line)
			if err == nil {
				continue
			}
			var e *Error
			if !errors.As(err, &e) || (e.Kind != Protocol && e.Kind != Refused) {
				t.Fatalf("%s: %T %v", op, err, err)
			}
			if e.Kind == Protocol && len(e.Msg) > 300 {
				t.Fatalf("%s: a %d-byte protocol message: %s", op, len(e.Msg), e.Msg)
			}
		}
	})
}

func TestSpecValidate(t *testing.T) {
	good := Spec{Command: []string{"/bin/true"}, Dir: "/", CheckpointDir: "/c", CheckpointEvery: 1, StartTimeout: 1, KillGrace: 1, LogPath: "/l"}
	require.NoError(t, good.Validate())
	err := Spec{Command: []string{"python"}, Device: -1}.Validate()
	var e *Error
	require.ErrorAs(t, err, &e)
	assert.Equal(t, BadInput, e.Kind)
	assert.Equal(t, "invalid trainer spec: spec.command[0]: not an absolute path\nspec.dir: not an absolute path\n"+
		"spec.checkpoint_dir: not an absolute path\nspec.log_path: not an absolute path\nspec.device: -1, want a CUDA ordinal >= 0\n"+
		"spec.checkpoint_every: 0, want >= 1\nspec.start_timeout: 0s, want > 0\nspec.kill_grace: 0s, want > 0", err.Error())
}
