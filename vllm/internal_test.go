package vllm

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestErrorMessageShapes(t *testing.T) {
	for body, want := range map[string]string{
		`{"detail":"Missing 'init_info' in request body"}`:                                  "Missing 'init_info' in request body",
		`{"detail":[{"loc":["query","mode"],"msg":"Input should be 'abort'"},{"msg":"b"}]}`: "Input should be 'abort'; b",
		`{"error":"Failed to pause generation: boom"}`:                                      "Failed to pause generation: boom",
		`{"error":{"message":"TypeError: x","type":"InternalServerError","code":500}}`:      "TypeError: x",
		`{"object":"error","message":"old style","type":"BadRequestError","code":400}`:      "old style",
		`{"message":"Weight transfer failed"}`:                                              "Weight transfer failed",
		`Internal Server Error`:                                                             "Internal Server Error",
		``:                                                                                  "Bad Gateway",
		`{"detail":{"message":"nested"}}`:                                                   "nested",
	} {
		status := http.StatusInternalServerError
		if body == "" {
			status = http.StatusBadGateway
		}
		assert.Equal(t, want, errorMessage(status, []byte(body)), body)
	}
	long := strings.Repeat("x", 5000)
	assert.Len(t, errorMessage(500, []byte(long)), maxErrorMessage+len("...(truncated)"))
}

func TestParseVersion(t *testing.T) {
	for v, want := range map[string][2]int{
		"0.28.0": {0, 28}, "0.27.1.dev45+g1234": {0, 27}, "0.28.0rc1": {0, 28}, "v1.2": {1, 2}, "0.30": {0, 30},
	} {
		major, minor, ok := parseVersion(v)
		assert.True(t, ok, v)
		assert.Equal(t, want, [2]int{major, minor}, v)
	}
	for _, v := range []string{"", "main", "1", "x.y", "-1.2"} {
		_, _, ok := parseVersion(v)
		assert.False(t, ok, v)
	}
}

func TestResponseBodiesAreBounded(t *testing.T) {
	big := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Write([]byte(`{"is_paused":true,"pad":"`))
		w.Write([]byte(strings.Repeat("x", maxControlResponse)))
		w.Write([]byte(`"}`))
	}))
	defer big.Close()
	c, err := New(big.URL, Options{Retry: RetryPolicy{Attempts: 1}})
	require.NoError(t, err)
	_, err = c.IsPaused(t.Context())
	assert.ErrorContains(t, err, "GET /is_paused: HTTP 200: read response: response body exceeds the size limit of 4194304 bytes")

	body := &limitedBody{rc: io.NopCloser(strings.NewReader("abcdef")), left: 4}
	b, err := io.ReadAll(body)
	assert.ErrorIs(t, err, errTooLarge)
	assert.Equal(t, "abcd", string(b))
	body = &limitedBody{rc: io.NopCloser(strings.NewReader("abcd")), left: 4}
	b, err = io.ReadAll(body)
	assert.NoError(t, err, "exactly the limit is fine")
	assert.Equal(t, "abcd", string(b))
}
