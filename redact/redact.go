// Package redact masks secret values in text before it leaves the process
// that knows them: a worker's API keys and the secrets it hands to exec
// steps, in the log tails, errors and outputs it sends to Temporal.
//
// Invariants: a Masker replaces every occurrence of each secret it holds,
// and of the secret's common encodings (URL query and path escaping, JSON
// string escaping, and base64 in the standard and URL alphabets at each of
// the three byte alignments a secret can have inside a longer encoded
// text), with Mask. Overlapping and adjacent occurrences, of one secret or
// several, become a single Mask, so no fragment of one survives between
// the masks of two. A secret shorter than MinLen bytes is refused (Add
// reports it): masking a 1-byte secret would erase every such byte of every
// log, and one that short protects nothing anyway. Masking is idempotent. A
// nil *Masker masks nothing. The package never logs and imports nothing of
// the module.
package redact

import (
	"encoding/base64"
	"encoding/json"
	"io"
	"net/url"
	"sort"
	"strings"
	"sync"
)

// Mask is what each masked occurrence becomes.
const Mask = "***"

// MinLen is the shortest secret, in bytes, that a Masker accepts.
const MinLen = 8

// Masker holds secret values and masks them in text. It is safe for
// concurrent use; secrets are only ever added.
type Masker struct {
	mu      sync.RWMutex
	secrets map[string]bool
	// forms are every secret's forms, longest first, deduplicated; a new
	// slice replaces it on Add, so readers use a snapshot unlocked.
	forms []string
}

// New returns a Masker holding no secrets.
func New() *Masker { return &Masker{secrets: map[string]bool{}} }

// Add makes the masker mask secret from now on. It returns false, and
// masks nothing new, when secret is shorter than MinLen.
func (m *Masker) Add(secret string) bool {
	if len(secret) < MinLen {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.secrets[secret] {
		return true
	}
	m.secrets[secret] = true
	seen := make(map[string]bool, len(m.forms)+16)
	forms := make([]string, 0, len(m.forms)+16)
	for _, f := range append(append([]string(nil), m.forms...), Forms(secret)...) {
		if !seen[f] {
			seen[f] = true
			forms = append(forms, f)
		}
	}
	// Longest first: at one position the longest form wins, which matters
	// only for readability (the intervals are merged anyway).
	sort.SliceStable(forms, func(i, j int) bool { return len(forms[i]) > len(forms[j]) })
	m.forms = forms
	return true
}

// Len is the number of secrets held.
func (m *Masker) Len() int {
	if m == nil {
		return 0
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.secrets)
}

func (m *Masker) snapshot() []string {
	if m == nil {
		return nil
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.forms
}

// Contains reports whether s holds any secret in any of its forms.
func (m *Masker) Contains(s string) bool {
	for _, f := range m.snapshot() {
		if strings.Contains(s, f) {
			return true
		}
	}
	return false
}

// Mask returns s with every occurrence of every form of every secret
// replaced by Mask; overlapping or touching occurrences become one Mask.
func (m *Masker) Mask(s string) string { return m.maskFrom(s, 0) }

// maskFrom is Mask(s) without the text that stands for s[:from] (an
// occurrence that straddles from is kept as its Mask).
func (m *Masker) maskFrom(s string, from int) string {
	forms := m.snapshot()
	if len(forms) == 0 || s == "" {
		return s[from:]
	}
	var spans []span
	for _, f := range forms {
		for at := 0; at < len(s); {
			i := strings.Index(s[at:], f)
			if i < 0 {
				break
			}
			start := at + i
			spans = append(spans, span{start, start + len(f)})
			// Step one byte, not past the match: a secret may overlap its
			// own next occurrence ("abab" in "ababab").
			at = start + 1
		}
	}
	if len(spans) == 0 {
		return s[from:]
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].start < spans[j].start })
	var b strings.Builder
	b.Grow(len(s) - from)
	at := from
	for i := 0; i < len(spans); {
		cur := spans[i]
		for i++; i < len(spans) && spans[i].start <= cur.end; i++ {
			cur.end = max(cur.end, spans[i].end)
		}
		if cur.end <= from {
			continue
		}
		b.WriteString(s[at:max(cur.start, at)])
		b.WriteString(Mask)
		at = cur.end
	}
	b.WriteString(s[at:])
	return b.String()
}

type span struct{ start, end int }

// longest is the length of the longest form of any secret held.
func (m *Masker) longest() int {
	forms := m.snapshot()
	if len(forms) == 0 {
		return 0
	}
	return len(forms[0])
}

// Tail returns the last n bytes of the first size bytes of r, masked. A
// secret that began before the tail would leave a fragment at its start,
// unmatched; Tail reads further back by the longest secret's length, masks
// that, and drops the part read for the purpose, so no fragment is
// returned. The tail may then hold less than n bytes of the original text.
func (m *Masker) Tail(r io.ReaderAt, size, n int64) (string, error) {
	back := int64(m.longest())
	off := max(size-n-back, 0)
	b := make([]byte, size-off)
	if _, err := r.ReadAt(b, off); err != nil && err != io.EOF {
		return "", err
	}
	var text string
	if off > 0 {
		text = m.maskFrom(string(b), int(min(back, int64(len(b)))))
	} else {
		text = m.Mask(string(b))
	}
	if int64(len(text)) > n {
		text = text[int64(len(text))-n:]
	}
	return text, nil
}

// Forms returns the texts by which secret may appear: itself, its URL
// query and path escapes, its JSON string escape, and the stretches of its
// base64 encodings (standard and URL alphabets, padded or not) that depend
// on its bytes alone, at each alignment, with the tail of the encoding for
// a secret that ends the encoded text. Inside a longer encoded text the
// stretch leaves out the character at each end that mixes in the
// neighbouring bytes, so a masked base64 text may keep a few bits of the
// secret next to a Mask, never a byte's worth.
func Forms(secret string) []string {
	forms := []string{secret, url.QueryEscape(secret), url.PathEscape(secret)}
	if b, err := json.Marshal(secret); err == nil {
		forms = append(forms, string(b[1:len(b)-1]))
	}
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding} {
		for k := 0; k < 3; k++ {
			in := append(make([]byte, k), secret...)
			padded := enc.EncodeToString(in)
			// Character i carries bits [6i, 6i+6) of the input: keep the
			// ones entirely within the secret's bits [8k, 8(k+n)), and,
			// for a secret that ends the encoded text, all the rest.
			first, end := (8*k+5)/6, 8*(k+len(secret))/6
			forms = append(forms, padded[first:end], padded[first:], enc.WithPadding(base64.NoPadding).EncodeToString(in)[first:])
		}
	}
	out := forms[:0]
	for _, f := range forms {
		if len(f) >= MinLen && !contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
