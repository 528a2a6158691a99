package codec

import (
	"bytes"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/encoding/protojson"
)

// MaxRequestBytes bounds a codec request's body: a few of Temporal's 2 MB
// payloads, base64-encoded, with room to spare.
const MaxRequestBytes = 32 << 20

// ServerOptions configure the codec server's handler.
type ServerOptions struct {
	// UIOrigins are the browser origins (scheme://host[:port]) allowed to
	// call: the Temporal UI's, as its users' browsers spell it. Requests from
	// any other origin are refused; requests without an Origin (the temporal
	// CLI, curl) are not browsers and need no CORS.
	UIOrigins []string
	// Token, when set, must arrive as "Authorization: Bearer <Token>".
	Token string
}

// NewHTTPHandler serves the Temporal codec server protocol for c: POST
// .../encode and .../decode with {"payloads": [...]} (protobuf JSON), the
// protocol done by the SDK's handler, behind the origin, token and body
// checks.
func NewHTTPHandler(c *Codec, o ServerOptions) (http.Handler, error) {
	for _, origin := range o.UIOrigins {
		if err := CheckOrigin(origin); err != nil {
			return nil, err
		}
	}
	return &server{opts: o, codec: converter.NewPayloadCodecHTTPHandler(c)}, nil
}

// CheckOrigin accepts a browser origin as the Origin header spells it:
// http or https, a host, an optional port, nothing else.
func CheckOrigin(origin string) error {
	u, err := url.Parse(origin)
	switch {
	case err != nil || u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("origin %q: want http://HOST[:PORT] or https://HOST[:PORT]", origin)
	case u.Host == "" || u.User != nil || u.Path != "" || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "":
		return fmt.Errorf("origin %q: want only scheme://HOST[:PORT], as the browser sends it (no path, not even a trailing /)", origin)
	}
	return nil
}

type server struct {
	opts  ServerOptions
	codec http.Handler
}

// corsHeaders are the request headers the Temporal UI and CLI send.
const corsHeaders = "Authorization, Content-Type, X-Namespace"

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if origin := r.Header.Get("Origin"); origin != "" {
		if !slices.Contains(s.opts.UIOrigins, origin) {
			allowed := "takes no browser requests (no --ui-origin)"
			if len(s.opts.UIOrigins) > 0 {
				allowed = fmt.Sprintf("answers only the Temporal UI at %s (--ui-origin)", strings.Join(s.opts.UIOrigins, ", "))
			}
			http.Error(w, fmt.Sprintf("origin %q is not allowed: this codec server %s", origin, allowed), http.StatusForbidden)
			return
		}
		h := w.Header()
		h.Set("Access-Control-Allow-Origin", origin)
		h.Set("Access-Control-Allow-Credentials", "true")
		h.Add("Vary", "Origin")
		if r.Method == http.MethodOptions {
			h.Set("Access-Control-Allow-Methods", "POST")
			h.Set("Access-Control-Allow-Headers", corsHeaders)
			h.Set("Access-Control-Max-Age", "600")
			// Chrome asks before a public page calls a loopback address.
			if r.Header.Get("Access-Control-Request-Private-Network") == "true" {
				h.Set("Access-Control-Allow-Private-Network", "true")
			}
		}
	}
	route := r.Method + " " + r.URL.Path
	switch {
	case r.Method == http.MethodOptions:
		w.Header().Set("Allow", "POST, OPTIONS")
		w.WriteHeader(http.StatusNoContent)
		return
	case r.Method != http.MethodPost:
		w.Header().Set("Allow", "POST, OPTIONS")
		http.Error(w, fmt.Sprintf("%s: the codec server takes POST .../encode and POST .../decode", route), http.StatusMethodNotAllowed)
		return
	case !strings.HasSuffix(r.URL.Path, "/encode") && !strings.HasSuffix(r.URL.Path, "/decode"):
		http.Error(w, fmt.Sprintf("%s: no such route: the codec server takes POST .../encode and POST .../decode", route), http.StatusNotFound)
		return
	}
	if s.opts.Token != "" && !bearerMatches(r.Header.Get("Authorization"), s.opts.Token) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="rlflow codec server"`)
		http.Error(w, route+": missing or wrong bearer token: send Authorization: Bearer <the codec server's token>", http.StatusUnauthorized)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBytes))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		http.Error(w, fmt.Sprintf("%s: body over %d bytes", route, MaxRequestBytes), http.StatusRequestEntityTooLarge)
		return
	case err != nil:
		http.Error(w, fmt.Sprintf("%s: reading the body: %v", route, err), http.StatusBadRequest)
		return
	}
	// The SDK's handler answers a malformed body with the bare protobuf
	// error; checking first gives the caller the route and the shape wanted.
	if err := protojson.Unmarshal(body, &commonpb.Payloads{}); err != nil {
		http.Error(w, fmt.Sprintf(`%s: the body is not Temporal payloads JSON, {"payloads": [{"metadata": {...}, "data": "<base64>"}]}: %v`, route, err), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	s.codec.ServeHTTP(w, r)
}

// bearerMatches compares in constant time, so the answer's timing does not
// reveal how much of a guess was right.
func bearerMatches(header, token string) bool {
	got, ok := strings.CutPrefix(header, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(token)) == 1
}
