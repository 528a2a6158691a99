package pipelines

import (
	"strings"
	"testing"
)

func TestRedactedExcerpt(t *testing.T) {
	for _, tc := range []struct{ line, want string }{
		{"OPENAI_API_KEY=sk-12ab", "OPENAI_API_KEY=**-****"},
		{"export OPENAI_API_KEY=\"sk-12\"", "export OPENAI_API_KEY=\"**-**\""},
		{"  api_key: sk-12", "api_key: **-**"},
		{"sk-secret", "**-******"},
		{"root:$6$salt$hash:19000::", "root:$*$****$****:*****::"},
		{"version:1", "version:*"},
		{"clé: café", "***: ****"},
		{"key=\x00\tv", "key=***"},
		{strings.Repeat("a", 30) + "=" + strings.Repeat("b", 30), strings.Repeat("a", 30) + "=" + strings.Repeat("*", 9) + "..."},
		{"", ""},
	} {
		if got := redactedExcerpt(tc.line); got != tc.want {
			t.Errorf("redactedExcerpt(%q) = %q, want %q", tc.line, got, tc.want)
		}
	}
}

// TestNotAPipelineQuotesNoValue loads files that are not pipelines at all,
// as a worker told to load any file might: no error quotes a value.
func TestNotAPipelineQuotesNoValue(t *testing.T) {
	const secret = "sk-test-Zq81secret"
	for _, tc := range []struct{ name, data string }{
		{"dotenv", "OPENAI_API_KEY=" + secret + "\n"},
		{"dotenv after a comment", "# keys\nOPENAI_API_KEY=" + secret + "\nOTHER=1\n"},
		{"export", "export OPENAI_API_KEY=\"" + secret + "\"\n"},
		{"bare key", secret + "\n"},
		{"quoted", "\"" + secret + "\"\n"},
		{"number-like", "12345678901234567890" + secret + "\n"},
		{"yaml mapping", "OPENAI_API_KEY: " + secret + "\nregion: x\n"},
		{"flow mapping", "{OPENAI_API_KEY: " + secret + "}\n"},
		{"alias", "*" + secret + "\n"},
		{"tagged", "!vault " + secret + "\n"},
		{"list", "- " + secret + "\n- b\n"},
		{"passwd", "root:x:0:0:" + secret + ":/root:/bin/bash\ndaemon:x:1:1::/:/bin/sh\n"},
		{"shadow", "root:$6$" + secret + ":19000:0:99999:7:::\n"},
		{"ini", "[default]\naws_secret_access_key = " + secret + "\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Load("f", []byte(tc.data))
			if err == nil {
				t.Fatal("loaded")
			}
			if msg := err.Error(); strings.Contains(msg, secret) || strings.Contains(msg, "Zq81") {
				t.Errorf("the error quotes the file's value:\n%s", msg)
			}
		})
	}
}
