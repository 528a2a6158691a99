package codec

import (
	"encoding/base64"
	"fmt"
	"maps"
	"slices"
	"strings"

	"go.temporal.io/sdk/converter"
)

// The environment that turns the codec on. Workers, the CLI and the codec
// server read the same two variables, so they agree on the keys.
const (
	// EnvKeys holds every key still needed to read history: "id:base64key"
	// entries separated by commas, each key 32 bytes (openssl rand -base64 32).
	EnvKeys = "RLFLOW_CODEC_KEYS"
	// EnvKeyID names the entry of EnvKeys that encrypts new payloads.
	EnvKeyID = "RLFLOW_CODEC_KEY_ID"
)

// LoadEnv returns the codec the environment configures, or nil when neither
// variable is set (the codec is off). A half or malformed configuration is
// an error naming the variable and the entry, never quoting key material.
func LoadEnv(getenv func(string) string) (*Codec, error) {
	keysVar, keyID := strings.TrimSpace(getenv(EnvKeys)), strings.TrimSpace(getenv(EnvKeyID))
	switch {
	case keysVar == "" && keyID == "":
		return nil, nil
	case keysVar == "":
		return nil, fmt.Errorf("%s is %q but %s is empty: set both to encrypt payloads, or neither", EnvKeyID, keyID, EnvKeys)
	}
	keys, err := parseKeys(keysVar)
	if err != nil {
		return nil, err
	}
	if keyID == "" {
		return nil, fmt.Errorf("%s is empty: name the key of %s that encrypts new payloads (one of: %s)", EnvKeyID, EnvKeys, strings.Join(sortedIDs(keys), ", "))
	}
	if _, ok := keys[keyID]; !ok {
		return nil, fmt.Errorf("%s is %q, which %s does not hold (ids: %s)", EnvKeyID, keyID, EnvKeys, strings.Join(sortedIDs(keys), ", "))
	}
	c, err := New(keys, keyID)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvKeys, err)
	}
	return c, nil
}

// FromEnv returns the data converter for a Temporal client (worker or CLI):
// the SDK's default converter with the codec of LoadEnv, or nil when the
// codec is off (the client then uses the SDK's default).
func FromEnv(getenv func(string) string) (converter.DataConverter, error) {
	c, err := LoadEnv(getenv)
	if err != nil || c == nil {
		return nil, err
	}
	return converter.NewCodecDataConverter(converter.GetDefaultDataConverter(), c), nil
}

// parseKeys reads "id:base64key,id:base64key". Errors name entries by
// position or id: an entry may be key material.
func parseKeys(s string) (map[string][]byte, error) {
	entries := strings.Split(s, ",")
	keys := make(map[string][]byte, len(entries))
	for i, e := range entries {
		where := fmt.Sprintf("%s entry %d of %d", EnvKeys, i+1, len(entries))
		e = strings.TrimSpace(e)
		if e == "" {
			return nil, fmt.Errorf("%s is empty: want ID:BASE64KEY", where)
		}
		id, b64, ok := strings.Cut(e, ":")
		if !ok {
			return nil, fmt.Errorf("%s has no ':': want ID:BASE64KEY", where)
		}
		id = strings.TrimSpace(id)
		if err := checkKeyID(id); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if _, dup := keys[id]; dup {
			return nil, fmt.Errorf("%s: key id %q appears twice", where, id)
		}
		key, err := decodeKey(strings.TrimSpace(b64))
		if err != nil {
			return nil, fmt.Errorf("%s: key %q: %w", where, id, err)
		}
		keys[id] = key
	}
	return keys, nil
}

// decodeKey accepts standard base64, padded or not (openssl and base64(1)
// pad; some tools strip it). The decoder's error is left out: it quotes
// positions in key material.
func decodeKey(b64 string) ([]byte, error) {
	key, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		if key, err = base64.RawStdEncoding.DecodeString(b64); err != nil {
			return nil, fmt.Errorf("not standard base64 (generate a key with: openssl rand -base64 %d)", KeyBytes)
		}
	}
	if len(key) != KeyBytes {
		return nil, fmt.Errorf("decodes to %d bytes; AES-256 takes %d (generate one with: openssl rand -base64 %d)", len(key), KeyBytes, KeyBytes)
	}
	return key, nil
}

func sortedIDs(keys map[string][]byte) []string { return slices.Sorted(maps.Keys(keys)) }
