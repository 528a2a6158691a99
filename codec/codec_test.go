package codec

import (
	"bytes"
	"encoding/base64"
	"flag"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/proto"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// testKey is a deterministic 32-byte key for tests: seed repeated.
func testKey(seed byte) []byte { return bytes.Repeat([]byte{seed}, KeyBytes) }

func b64(k []byte) string { return base64.StdEncoding.EncodeToString(k) }

// env builds a getenv over a map.
func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func mustCodec(t *testing.T, keys map[string][]byte, id string) *Codec {
	t.Helper()
	c, err := New(keys, id)
	require.NoError(t, err)
	return c
}

// secretPayload is what the SDK's JSON converter makes of a step's outputs.
func secretPayload(t *testing.T) *commonpb.Payload {
	t.Helper()
	p, err := converter.GetDefaultDataConverter().ToPayload(map[string]string{"path": "/data/secret-prompts.jsonl"})
	require.NoError(t, err)
	return p
}

func TestRoundTripHidesDataAndMetadata(t *testing.T) {
	c := mustCodec(t, map[string][]byte{"k1": testKey(1)}, "k1")
	orig := secretPayload(t)
	enc, err := c.Encode([]*commonpb.Payload{orig, nil})
	require.NoError(t, err)
	require.Len(t, enc, 2)
	assert.Nil(t, enc[1], "a nil payload stays nil")

	wire, err := proto.Marshal(enc[0])
	require.NoError(t, err)
	for _, plain := range []string{"secret-prompts", "json/plain", "/data/"} {
		assert.NotContains(t, string(wire), plain, "the encrypted payload's wire bytes")
	}
	assert.Equal(t, Encoding, string(enc[0].Metadata[converter.MetadataEncoding]))
	assert.Equal(t, "k1", string(enc[0].Metadata[MetadataKeyID]))

	dec, err := c.Decode(enc)
	require.NoError(t, err)
	assert.True(t, proto.Equal(orig, dec[0]), "decoded %v, want %v", dec[0], orig)
	assert.Nil(t, dec[1])

	// Two encryptions of one payload differ (a fresh nonce each time).
	again, err := c.Encode([]*commonpb.Payload{orig})
	require.NoError(t, err)
	assert.NotEqual(t, enc[0].Data, again[0].Data)
}

// The SDK's data converter with the codec: what workers and the CLI use.
func TestFromEnvDataConverterRoundTrip(t *testing.T) {
	dc, err := FromEnv(env(map[string]string{EnvKeys: "k1:" + b64(testKey(1)), EnvKeyID: "k1"}))
	require.NoError(t, err)
	require.NotNil(t, dc)
	in := map[string]any{"prompt": "the secret prompt", "n": 4.0}
	p, err := dc.ToPayload(in)
	require.NoError(t, err)
	assert.Equal(t, Encoding, string(p.Metadata[converter.MetadataEncoding]))
	assert.NotContains(t, string(p.Data), "secret prompt")
	var out map[string]any
	require.NoError(t, dc.FromPayload(p, &out))
	assert.Equal(t, in, out)
}

func TestFromEnvOff(t *testing.T) {
	dc, err := FromEnv(env(nil))
	assert.NoError(t, err)
	assert.Nil(t, dc, "no keys: the codec is off and the client keeps the SDK's default")
	c, err := LoadEnv(env(map[string]string{EnvKeys: "  ", EnvKeyID: ""}))
	assert.NoError(t, err)
	assert.Nil(t, c)
}

// Payloads that were never encrypted (older histories, runs started from the
// UI without a codec) decode as they are.
func TestDecodePassesPlainPayloadsThrough(t *testing.T) {
	c := mustCodec(t, map[string][]byte{"k1": testKey(1)}, "k1")
	plain := secretPayload(t)
	dec, err := c.Decode([]*commonpb.Payload{plain})
	require.NoError(t, err)
	assert.Same(t, plain, dec[0])
}

func TestRotation(t *testing.T) {
	k1, k2 := testKey(1), testKey(2)
	before, err := LoadEnv(env(map[string]string{EnvKeys: "id1:" + b64(k1), EnvKeyID: "id1"}))
	require.NoError(t, err)
	orig := secretPayload(t)
	old, err := before.Encode([]*commonpb.Payload{orig})
	require.NoError(t, err)

	// Rotated: id2 encrypts, id1 is kept for the history written under it.
	after, err := LoadEnv(env(map[string]string{EnvKeys: "id1:" + b64(k1) + ", id2:" + b64(k2), EnvKeyID: "id2"}))
	require.NoError(t, err)
	dec, err := after.Decode(old)
	require.NoError(t, err)
	assert.True(t, proto.Equal(orig, dec[0]), "a payload of id1 decodes after the switch to id2")
	fresh, err := after.Encode([]*commonpb.Payload{orig})
	require.NoError(t, err)
	assert.Equal(t, "id2", string(fresh[0].Metadata[MetadataKeyID]))

	// Dropping id1 too early: the old payload fails, naming the id it needs.
	dropped := mustCodec(t, map[string][]byte{"id2": k2}, "id2")
	_, err = dropped.Decode(old)
	require.Error(t, err)
	assert.Equal(t, `decrypting payload 0: it was encrypted with key id "id1", which this codec does not hold (ids: id2): add that key to RLFLOW_CODEC_KEYS`, err.Error())
	assert.NotContains(t, err.Error(), b64(k2))
}

func TestDecodeRejects(t *testing.T) {
	c := mustCodec(t, map[string][]byte{"k1": testKey(1), "k2": testKey(2)}, "k1")
	enc, err := c.Encode([]*commonpb.Payload{secretPayload(t)})
	require.NoError(t, err)
	good := enc[0]
	with := func(edit func(p *commonpb.Payload)) *commonpb.Payload {
		p := proto.Clone(good).(*commonpb.Payload)
		edit(p)
		return p
	}
	for _, tc := range []struct {
		name string
		p    *commonpb.Payload
	}{
		{"flipped ciphertext bit", with(func(p *commonpb.Payload) { p.Data[len(p.Data)/2] ^= 1 })},
		{"flipped nonce bit", with(func(p *commonpb.Payload) { p.Data[0] ^= 1 })},
		{"truncated", with(func(p *commonpb.Payload) { p.Data = p.Data[:20] })},
		{"cut tag", with(func(p *commonpb.Payload) { p.Data = p.Data[:len(p.Data)-1] })},
		{"relabelled to another held key", with(func(p *commonpb.Payload) { p.Metadata[MetadataKeyID] = []byte("k2") })},
		{"unknown key id", with(func(p *commonpb.Payload) { p.Metadata[MetadataKeyID] = []byte("gone") })},
		{"no key id", with(func(p *commonpb.Payload) { delete(p.Metadata, MetadataKeyID) })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Decode([]*commonpb.Payload{tc.p})
			require.Error(t, err)
			checkGolden(t, "decode", tc.name, err.Error())
		})
	}
}

func TestNewRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		keys map[string][]byte
		id   string
		want string
	}{
		{"short key", map[string][]byte{"a": testKey(1)[:16]}, "a", `key "a" is 16 bytes; AES-256 takes 32`},
		{"bad id", map[string][]byte{"a b": testKey(1)}, "a b", `key id "a b": want letters, digits, '-', '_' or '.'`},
		{"encrypting id missing", map[string][]byte{"a": testKey(1)}, "b", `the encrypting key id "b" is not among the keys (ids: a)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.keys, tc.id)
			assert.EqualError(t, err, tc.want)
		})
	}
}

// A malformed environment is an error naming the variable and the entry,
// and never quoting key material.
func TestLoadEnvRejects(t *testing.T) {
	good := b64(testKey(7))
	secretish := "c2VjcmV0LWtleS1tYXRlcmlhbC1zaG9ydA==" // decodes to 25 bytes
	for _, tc := range []struct {
		name, keys, id string
	}{
		{"key id without keys", "", "k1"},
		{"keys without key id", "k1:" + good + ",k2:" + good, ""},
		{"key id not held", "k1:" + good, "k9"},
		{"entry without colon", good, "k1"},
		{"empty entry", "k1:" + good + ",", "k1"},
		{"empty id", ":" + good, "k1"},
		{"duplicate id", "k1:" + good + ",k1:" + good, "k1"},
		{"not base64", "k1:" + "!!!" + good[3:], "k1"},
		{"wrong length", "k1:" + secretish, "k1"},
		{"bad id characters", "k/1:" + good, "k/1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadEnv(env(map[string]string{EnvKeys: tc.keys, EnvKeyID: tc.id}))
			require.Error(t, err)
			msg := err.Error()
			for _, secret := range []string{good, good[:12], secretish, secretish[:12]} {
				assert.NotContains(t, msg, secret, "the error quotes key material")
			}
			checkGolden(t, "env", tc.name, msg)
		})
	}
	// Unpadded base64 is a valid spelling of a key.
	c, err := LoadEnv(env(map[string]string{EnvKeys: "k1:" + strings.TrimRight(good, "="), EnvKeyID: "k1"}))
	require.NoError(t, err)
	assert.Equal(t, []string{"k1"}, c.KeyIDs())
}

// golden holds the error messages of a test, one "name: message" line each,
// in testdata/<file>.golden; -update rewrites them.
var golden = map[string]map[string]string{}

func checkGolden(t *testing.T, file, name, got string) {
	t.Helper()
	if golden[file] == nil {
		golden[file] = map[string]string{}
	}
	golden[file][name] = got
	if *update {
		return
	}
	data, err := os.ReadFile("testdata/" + file + ".golden")
	require.NoError(t, err, "run go test ./codec -update to create it")
	prefix := name + ": "
	for _, line := range strings.Split(string(data), "\n") {
		if want, ok := strings.CutPrefix(line, prefix); ok {
			assert.Equal(t, want, got)
			return
		}
	}
	t.Errorf("testdata/%s.golden has no line for %q (got %q); run with -update", file, name, got)
}

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if *update && code == 0 {
		for file, lines := range golden {
			var b strings.Builder
			for _, name := range slices.Sorted(maps.Keys(lines)) {
				fmt.Fprintf(&b, "%s: %s\n", name, lines[name])
			}
			if err := os.WriteFile("testdata/"+file+".golden", []byte(b.String()), 0o644); err != nil {
				fmt.Fprintln(os.Stderr, err)
				code = 1
			}
		}
	}
	os.Exit(code)
}
