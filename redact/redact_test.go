package redact

import (
	"encoding/base64"
	"encoding/json"
	"net/url"
	"strings"
	"sync"
	"testing"
)

func TestMask(t *testing.T) {
	const key = "sk-proj-Abc123/xyz+Q=="
	basicAuth := base64.StdEncoding.EncodeToString([]byte("user:" + key))
	jsonKey, _ := json.Marshal("a<b>&" + key)
	for _, tc := range []struct {
		name    string
		secrets []string
		in      string
		want    string
	}{
		{name: "no secrets", in: "plain text " + key, want: "plain text " + key},
		{name: "plain", secrets: []string{key}, in: "OPENAI_API_KEY=" + key + "\n", want: "OPENAI_API_KEY=***\n"},
		{name: "every occurrence", secrets: []string{key}, in: key + " and " + key + key, want: "*** and ***"},
		{name: "URL query escaped", secrets: []string{key}, in: "GET /v1?key=" + url.QueryEscape(key) + "&x=1", want: "GET /v1?key=***&x=1"},
		{name: "URL path escaped", secrets: []string{key}, in: "http://h/" + url.PathEscape(key) + "/models", want: "http://h/***/models"},
		{name: "in a URL's userinfo", secrets: []string{"hunter2hunter2"}, in: "https://bob:hunter2hunter2@example.com/x", want: "https://bob:***@example.com/x"},
		{name: "JSON escaped", secrets: []string{"a<b>&" + key}, in: `{"k":"` + string(jsonKey[1:len(jsonKey)-1]) + `"}`, want: `{"k":"***"}`},
		{name: "base64 at offset 0", secrets: []string{key}, in: "token " + base64.StdEncoding.EncodeToString([]byte(key)), want: "token ***"},
		// "user:" is 5 bytes: the key starts at alignment 2 of the encoding.
		{name: "base64 inside basic auth", secrets: []string{key}, in: "Authorization: Basic " + basicAuth, want: "Authorization: Basic " + basicAuth[:7] + "***"},
		{name: "base64 inside a longer text", secrets: []string{key}, in: base64.StdEncoding.EncodeToString([]byte("[" + key + "]")), want: "W3***1d"},
		{name: "base64 URL alphabet", secrets: []string{"\xfb\xff\xfe-secret-bytes"}, in: base64.RawURLEncoding.EncodeToString([]byte("\xfb\xff\xfe-secret-bytes")), want: "***"},
		{name: "overlapping secrets", secrets: []string{"abcdef123", "def123456"}, in: "x abcdef123456 y", want: "x *** y"},
		{name: "one inside another", secrets: []string{"password-long", "password"}, in: "password-long password", want: "*** ***"},
		{name: "adjacent occurrences", secrets: []string{"AAAABBBB", "CCCCDDDD"}, in: "AAAABBBBCCCCDDDD", want: "***"},
		{name: "self-overlapping", secrets: []string{"abababab"}, in: "ababababab!", want: "***!"},
		{name: "short secret refused", secrets: []string{"x"}, in: "x marks the spot", want: "x marks the spot"},
		{name: "short secret refused, long kept", secrets: []string{"1234567", "12345678"}, in: "1234567 12345678", want: "1234567 ***"},
		{name: "already masked", secrets: []string{key}, in: "a *** b", want: "a *** b"},
		{name: "multi-byte text around", secrets: []string{"söme-sécret"}, in: "«söme-sécret»", want: "«***»"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := New()
			for _, s := range tc.secrets {
				m.Add(s)
			}
			got := m.Mask(tc.in)
			if got != tc.want {
				t.Fatalf("Mask(%q)\n got %q\nwant %q", tc.in, got, tc.want)
			}
			if m.Mask(got) != got {
				t.Fatalf("Mask is not idempotent: %q -> %q", got, m.Mask(got))
			}
			for _, s := range tc.secrets {
				if len(s) >= MinLen && strings.Contains(got, s) {
					t.Fatalf("%q still holds %q", got, s)
				}
			}
			if m.Contains(got) {
				t.Fatalf("Contains(%q) after masking: true", got)
			}
		})
	}
}

func TestAddRefusesShortSecrets(t *testing.T) {
	m := New()
	if m.Add("1234567") {
		t.Fatal("Add took a 7-byte secret")
	}
	if !m.Add("12345678") {
		t.Fatal("Add refused an 8-byte secret")
	}
	if !m.Add("12345678") {
		t.Fatal("Add refused an 8-byte secret it already holds")
	}
	if m.Len() != 1 {
		t.Fatalf("Len = %d, want 1", m.Len())
	}
}

func TestNilMaskerMasksNothing(t *testing.T) {
	var m *Masker
	if m.Mask("abc") != "abc" || m.Contains("abc") || m.Len() != 0 {
		t.Fatal("a nil masker changed something")
	}
}

// Every base64 form of a secret found in an encoding of the secret at any
// offset and in either alphabet, with any bytes around it.
func TestBase64AtEveryAlignment(t *testing.T) {
	secret := "s3cr3t-t0ken-value"
	m := New()
	m.Add(secret)
	for pre := 0; pre < 6; pre++ {
		for post := 0; post < 4; post++ {
			raw := strings.Repeat("\x00", pre) + secret + strings.Repeat("\xff", post)
			for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding, base64.RawStdEncoding} {
				text := enc.EncodeToString([]byte(raw))
				if !m.Contains(text) {
					t.Errorf("pre %d post %d: %q not found in %q", pre, post, secret, text)
				}
			}
		}
	}
}

func TestConcurrentAddAndMask(t *testing.T) {
	m := New()
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			m.Add(strings.Repeat(string(rune('a'+i)), 10))
		}()
		go func() {
			defer wg.Done()
			_ = m.Mask(strings.Repeat("abcdefgh", 20))
		}()
	}
	wg.Wait()
	if got := m.Mask("aaaaaaaaaa hhhhhhhhhh"); got != "*** ***" {
		t.Fatalf("after concurrent adds: %q", got)
	}
}

// A tail that starts inside a secret keeps no fragment of it; one that
// starts after it keeps all its text.
func TestTail(t *testing.T) {
	const secret = "0123456789abcdef"
	m := New()
	m.Add(secret)
	text := "line one " + secret + "\nline two\n"
	for n := int64(1); n <= int64(len(text))+4; n++ {
		got, err := m.Tail(strings.NewReader(text), int64(len(text)), n)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(got)) > n {
			t.Fatalf("n %d: %d bytes", n, len(got))
		}
		for k := 4; k <= len(secret); k++ {
			for i := 0; i+k <= len(secret); i++ {
				if k >= 4 && strings.Contains(got, secret[i:i+k]) {
					t.Fatalf("n %d: tail %q holds %q of the secret", n, got, secret[i:i+k])
				}
			}
		}
		if n <= int64(len("\nline two\n")) && got != text[int64(len(text))-n:] {
			t.Fatalf("n %d: tail %q, want the text's last %d bytes", n, got, n)
		}
	}
	got, _ := m.Tail(strings.NewReader(text), int64(len(text)), 1000)
	if got != "line one ***\nline two\n" {
		t.Fatalf("whole text: %q", got)
	}
	none, _ := New().Tail(strings.NewReader(text), int64(len(text)), 9)
	if none != "line two\n" {
		t.Fatalf("no secrets: %q", none)
	}
}
