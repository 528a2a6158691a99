// Package codec is rlflow's optional payload encryption: a Temporal payload
// codec (AES-256-GCM) that the worker and the CLI put in their client's data
// converter, so that workflow inputs, step arguments and outputs (prompts,
// paths, metrics) are ciphertext in Temporal's history, and the HTTP handler
// of a codec server through which the Temporal UI and CLI decode them for
// people who hold the key.
//
// Invariants: an encrypted payload is the whole original Payload (metadata
// and data) sealed under one key, named in plaintext by its key id, so
// rotation needs no re-encryption: decryption picks the key by id. Payloads
// that are not encrypted pass Decode unchanged (histories from before the
// codec, workflows started from the UI without it). Key bytes never appear
// in an error or a log; key ids may.
package codec

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"fmt"
	"maps"
	"slices"
	"strings"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/proto"
)

const (
	// Encoding is the "encoding" metadata of an encrypted payload.
	Encoding = "binary/encrypted"
	// MetadataKeyID is the metadata key naming the key that sealed a payload.
	MetadataKeyID = "encryption-key-id"
	// KeyBytes is the key size: AES-256.
	KeyBytes = 32
)

// aadPrefix binds a ciphertext to this format and to its key id, so a payload
// relabelled with another id fails authentication instead of decrypting.
const aadPrefix = "rlflow/codec/v1 key-id="

// Codec encrypts payloads with one key and decrypts with any key it holds.
// It is safe for concurrent use: its AEADs hold no per-call state.
type Codec struct {
	encryptWith string
	aeads       map[string]cipher.AEAD
}

var _ converter.PayloadCodec = (*Codec)(nil)

// New returns a codec holding keys (id -> 32-byte key) that encrypts with
// the key named encryptWith.
func New(keys map[string][]byte, encryptWith string) (*Codec, error) {
	c := &Codec{encryptWith: encryptWith, aeads: make(map[string]cipher.AEAD, len(keys))}
	for id, key := range keys {
		if err := checkKeyID(id); err != nil {
			return nil, err
		}
		if len(key) != KeyBytes {
			return nil, fmt.Errorf("key %q is %d bytes; AES-256 takes %d", id, len(key), KeyBytes)
		}
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", id, err)
		}
		if c.aeads[id], err = cipher.NewGCM(block); err != nil {
			return nil, fmt.Errorf("key %q: %w", id, err)
		}
	}
	if _, ok := c.aeads[encryptWith]; !ok {
		return nil, fmt.Errorf("the encrypting key id %q is not among the keys (ids: %s)", encryptWith, strings.Join(c.KeyIDs(), ", "))
	}
	return c, nil
}

// checkKeyID accepts ids that read well in metadata, logs and errors.
func checkKeyID(id string) error {
	if id == "" || len(id) > 64 {
		return fmt.Errorf("key id %q: want 1 to 64 characters", id)
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("key id %q: want letters, digits, '-', '_' or '.'", id)
		}
	}
	return nil
}

// EncryptWith is the id of the key new payloads are sealed with.
func (c *Codec) EncryptWith() string { return c.encryptWith }

// KeyIDs are the ids of the keys held, sorted.
func (c *Codec) KeyIDs() []string {
	return slices.Sorted(maps.Keys(c.aeads))
}

// Encode seals each payload, metadata included, under the encrypting key.
// Nil payloads stay nil.
func (c *Codec) Encode(payloads []*commonpb.Payload) ([]*commonpb.Payload, error) {
	aead := c.aeads[c.encryptWith]
	out := make([]*commonpb.Payload, len(payloads))
	for i, p := range payloads {
		if p == nil {
			continue
		}
		plain, err := proto.Marshal(p)
		if err != nil {
			return nil, fmt.Errorf("encrypting payload %d: %w", i, err)
		}
		nonce := make([]byte, aead.NonceSize(), aead.NonceSize()+len(plain)+aead.Overhead())
		if _, err := rand.Read(nonce); err != nil {
			return nil, fmt.Errorf("encrypting payload %d: nonce: %w", i, err)
		}
		out[i] = &commonpb.Payload{
			Metadata: map[string][]byte{
				converter.MetadataEncoding: []byte(Encoding),
				MetadataKeyID:              []byte(c.encryptWith),
			},
			Data: aead.Seal(nonce, nonce, plain, aad(c.encryptWith)),
		}
	}
	return out, nil
}

// Decode opens each encrypted payload with the key its metadata names and
// passes the others through unchanged.
func (c *Codec) Decode(payloads []*commonpb.Payload) ([]*commonpb.Payload, error) {
	out := make([]*commonpb.Payload, len(payloads))
	for i, p := range payloads {
		if p == nil || string(p.GetMetadata()[converter.MetadataEncoding]) != Encoding {
			out[i] = p
			continue
		}
		var err error
		if out[i], err = c.open(p); err != nil {
			return nil, fmt.Errorf("decrypting payload %d: %w", i, err)
		}
	}
	return out, nil
}

func (c *Codec) open(p *commonpb.Payload) (*commonpb.Payload, error) {
	idBytes, ok := p.Metadata[MetadataKeyID]
	if !ok {
		return nil, fmt.Errorf("its metadata has no %q naming the key", MetadataKeyID)
	}
	id := string(idBytes)
	aead, ok := c.aeads[id]
	if !ok {
		return nil, fmt.Errorf("it was encrypted with key id %q, which this codec does not hold (ids: %s): add that key to %s",
			id, strings.Join(c.KeyIDs(), ", "), EnvKeys)
	}
	if len(p.Data) < aead.NonceSize()+aead.Overhead() {
		return nil, fmt.Errorf("key id %q: ciphertext of %d bytes is shorter than a nonce and tag: truncated", id, len(p.Data))
	}
	nonce, sealed := p.Data[:aead.NonceSize()], p.Data[aead.NonceSize():]
	plain, err := aead.Open(nil, nonce, sealed, aad(id))
	if err != nil {
		return nil, fmt.Errorf("key id %q: authentication failed: the payload was altered, or sealed by another key under that id", id)
	}
	var orig commonpb.Payload
	if err := proto.Unmarshal(plain, &orig); err != nil {
		return nil, fmt.Errorf("key id %q: the decrypted bytes are not a Temporal payload: %w", id, err)
	}
	return &orig, nil
}

func aad(keyID string) []byte { return []byte(aadPrefix + keyID) }
