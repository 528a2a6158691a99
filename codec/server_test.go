package codec

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

const uiOrigin = "http://127.0.0.1:8233"

func codecServer(t *testing.T, c *Codec, o ServerOptions) *httptest.Server {
	t.Helper()
	h, err := NewHTTPHandler(c, o)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// post sends body to the server's path with headers and returns the status,
// the headers and the body.
func post(t *testing.T, srv *httptest.Server, method, path, body string, headers map[string]string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, resp.Header, string(b)
}

func payloadsJSON(t *testing.T, ps ...*commonpb.Payload) string {
	t.Helper()
	b, err := protojson.Marshal(&commonpb.Payloads{Payloads: ps})
	require.NoError(t, err)
	return string(b)
}

func parsePayloads(t *testing.T, body string) []*commonpb.Payload {
	t.Helper()
	var ps commonpb.Payloads
	require.NoError(t, protojson.Unmarshal([]byte(body), &ps), "body %s", body)
	return ps.Payloads
}

func TestServerDecodesWithTheKey(t *testing.T) {
	c := mustCodec(t, map[string][]byte{"k1": testKey(1)}, "k1")
	orig := secretPayload(t)
	enc, err := c.Encode([]*commonpb.Payload{orig})
	require.NoError(t, err)
	srv := codecServer(t, c, ServerOptions{UIOrigins: []string{uiOrigin}})

	// The UI mounts the codec at any depth and names the namespace.
	for _, path := range []string{"/decode", "/default/decode"} {
		code, h, body := post(t, srv, http.MethodPost, path, payloadsJSON(t, enc...), map[string]string{"X-Namespace": "default"})
		require.Equal(t, http.StatusOK, code, body)
		assert.Equal(t, "application/json", h.Get("Content-Type"))
		got := parsePayloads(t, body)
		require.Len(t, got, 1)
		assert.True(t, proto.Equal(orig, got[0]), "%s: decoded %v, want %v", path, got[0], orig)
	}

	// /encode seals what the UI sends (a signal's input), which /decode opens.
	code, _, body := post(t, srv, http.MethodPost, "/encode", payloadsJSON(t, orig), nil)
	require.Equal(t, http.StatusOK, code, body)
	sealed := parsePayloads(t, body)
	require.Len(t, sealed, 1)
	assert.Equal(t, Encoding, string(sealed[0].Metadata["encoding"]))
	assert.NotContains(t, body, "secret-prompts")
	code, _, body = post(t, srv, http.MethodPost, "/decode", payloadsJSON(t, sealed...), nil)
	require.Equal(t, http.StatusOK, code, body)
	assert.True(t, proto.Equal(orig, parsePayloads(t, body)[0]))

	// A server without the key cannot decode, and says which key it lacks.
	other := codecServer(t, mustCodec(t, map[string][]byte{"k2": testKey(2)}, "k2"), ServerOptions{})
	code, _, body = post(t, other, http.MethodPost, "/decode", payloadsJSON(t, enc...), nil)
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, body, `it was encrypted with key id "k1", which this codec does not hold (ids: k2)`)
}

func TestServerCORSOnlyForTheUIOrigin(t *testing.T) {
	c := mustCodec(t, map[string][]byte{"k1": testKey(1)}, "k1")
	srv := codecServer(t, c, ServerOptions{UIOrigins: []string{uiOrigin}})
	ok := payloadsJSON(t)

	// The browser's preflight from the UI.
	code, h, _ := post(t, srv, http.MethodOptions, "/decode", "", map[string]string{
		"Origin": uiOrigin, "Access-Control-Request-Method": "POST",
		"Access-Control-Request-Headers":         "content-type,x-namespace,authorization",
		"Access-Control-Request-Private-Network": "true",
	})
	assert.Equal(t, http.StatusNoContent, code)
	assert.Equal(t, uiOrigin, h.Get("Access-Control-Allow-Origin"))
	assert.Equal(t, "true", h.Get("Access-Control-Allow-Credentials"))
	assert.Equal(t, "POST", h.Get("Access-Control-Allow-Methods"))
	assert.Equal(t, "Authorization, Content-Type, X-Namespace", h.Get("Access-Control-Allow-Headers"))
	assert.Equal(t, "true", h.Get("Access-Control-Allow-Private-Network"))

	code, h, body := post(t, srv, http.MethodPost, "/decode", ok, map[string]string{"Origin": uiOrigin})
	assert.Equal(t, http.StatusOK, code, body)
	assert.Equal(t, uiOrigin, h.Get("Access-Control-Allow-Origin"))
	assert.Contains(t, h.Values("Vary"), "Origin")

	for _, origin := range []string{"http://evil.example", "http://127.0.0.1:8234", "http://localhost:8233", "null"} {
		for _, method := range []string{http.MethodOptions, http.MethodPost} {
			code, h, body := post(t, srv, method, "/decode", ok, map[string]string{"Origin": origin})
			assert.Equal(t, http.StatusForbidden, code, "%s from %s", method, origin)
			assert.Empty(t, h.Get("Access-Control-Allow-Origin"), "%s from %s", method, origin)
			assert.Contains(t, body, `is not allowed: this codec server answers only the Temporal UI at http://127.0.0.1:8233 (--ui-origin)`)
		}
	}

	// Not a browser (the temporal CLI, curl): no Origin, no CORS headers.
	code, h, body = post(t, srv, http.MethodPost, "/decode", ok, nil)
	assert.Equal(t, http.StatusOK, code, body)
	assert.Empty(t, h.Get("Access-Control-Allow-Origin"))

	// Without --ui-origin no browser is answered.
	closed := codecServer(t, c, ServerOptions{})
	code, _, body = post(t, closed, http.MethodPost, "/decode", ok, map[string]string{"Origin": uiOrigin})
	assert.Equal(t, http.StatusForbidden, code)
	assert.Contains(t, body, "takes no browser requests (no --ui-origin)")
}

func TestServerBearerToken(t *testing.T) {
	const token = "s3cret-token-value"
	c := mustCodec(t, map[string][]byte{"k1": testKey(1)}, "k1")
	srv := codecServer(t, c, ServerOptions{UIOrigins: []string{uiOrigin}, Token: token})
	ok := payloadsJSON(t)
	for _, auth := range []string{"", "Bearer", "Bearer wrong", "bearer " + token, token, "Bearer " + token + "x", "Basic " + token} {
		code, h, body := post(t, srv, http.MethodPost, "/decode", ok, map[string]string{"Authorization": auth})
		assert.Equal(t, http.StatusUnauthorized, code, "Authorization %q", auth)
		assert.Equal(t, `Bearer realm="rlflow codec server"`, h.Get("WWW-Authenticate"))
		assert.Equal(t, "POST /decode: missing or wrong bearer token: send Authorization: Bearer <the codec server's token>\n", body)
	}
	code, _, body := post(t, srv, http.MethodPost, "/decode", ok, map[string]string{"Authorization": "Bearer " + token})
	assert.Equal(t, http.StatusOK, code, body)
	// The browser's preflight carries no credentials; it must still pass.
	code, h, _ := post(t, srv, http.MethodOptions, "/decode", "", map[string]string{"Origin": uiOrigin})
	assert.Equal(t, http.StatusNoContent, code)
	assert.Equal(t, uiOrigin, h.Get("Access-Control-Allow-Origin"))
}

func TestServerRejectsBadRequests(t *testing.T) {
	c := mustCodec(t, map[string][]byte{"k1": testKey(1)}, "k1")
	srv := codecServer(t, c, ServerOptions{UIOrigins: []string{uiOrigin}})
	for _, tc := range []struct {
		name, method, path, body string
		code                     int
		want                     string
	}{
		{"not JSON to decode", "POST", "/decode", "payloads please", 400, `POST /decode: the body is not Temporal payloads JSON, {"payloads": [{"metadata": {...}, "data": "<base64>"}]}: proto:`},
		{"not JSON to encode", "POST", "/encode", "payloads please", 400, `POST /encode: the body is not Temporal payloads JSON`},
		{"empty body", "POST", "/decode", "", 400, `POST /decode: the body is not Temporal payloads JSON`},
		{"payloads not a list", "POST", "/decode", `{"payloads": 3}`, 400, `POST /decode: the body is not Temporal payloads JSON`},
		{"data not base64", "POST", "/decode", `{"payloads": [{"data": "%%%"}]}`, 400, `POST /decode: the body is not Temporal payloads JSON`},
		{"unknown field", "POST", "/encode", `{"payload": []}`, 400, `POST /encode: the body is not Temporal payloads JSON`},
		{"tampered payload", "POST", "/decode", `{"payloads": [{"metadata": {"encoding": "YmluYXJ5L2VuY3J5cHRlZA==", "encryption-key-id": "azE="}, "data": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}]}`, 400,
			`decrypting payload 0: key id "k1": authentication failed: the payload was altered, or sealed by another key under that id`},
		{"GET", "GET", "/decode", "", 405, `GET /decode: the codec server takes POST .../encode and POST .../decode`},
		{"other route", "POST", "/transcode", "{}", 404, `POST /transcode: no such route: the codec server takes POST .../encode and POST .../decode`},
		{"too big", "POST", "/decode", `{"payloads": [{"data": "` + strings.Repeat("A", MaxRequestBytes) + `"}]}`, 413, `POST /decode: body over 33554432 bytes`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, body := post(t, srv, tc.method, tc.path, tc.body, nil)
			assert.Equal(t, tc.code, code, body)
			assert.Contains(t, body, tc.want)
		})
	}
}

func TestCheckOrigin(t *testing.T) {
	for _, tc := range []struct{ origin, want string }{
		{"http://127.0.0.1:8233", ""},
		{"https://temporal.example.com", ""},
		{"http://127.0.0.1:8233/", `origin "http://127.0.0.1:8233/": want only scheme://HOST[:PORT], as the browser sends it (no path, not even a trailing /)`},
		{"127.0.0.1:8233", `origin "127.0.0.1:8233": want http://HOST[:PORT] or https://HOST[:PORT]`},
		{"ftp://x", `origin "ftp://x": want http://HOST[:PORT] or https://HOST[:PORT]`},
		{"http://", `origin "http://": want only scheme://HOST[:PORT], as the browser sends it (no path, not even a trailing /)`},
		{"http://u@host", `origin "http://u@host": want only scheme://HOST[:PORT], as the browser sends it (no path, not even a trailing /)`},
	} {
		err := CheckOrigin(tc.origin)
		if tc.want == "" {
			assert.NoError(t, err, tc.origin)
		} else {
			assert.EqualError(t, err, tc.want)
		}
	}
}
