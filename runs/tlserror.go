package runs

import (
	"context"
	"crypto/tls"
	"net"
	"strings"
	"time"

	"go.temporal.io/api/serviceerror"
	"google.golang.org/grpc/codes"
)

// TLSError is a TLS handshake with a Temporal frontend that failed for a
// reason no retry can fix: the server's certificate is not trusted or not
// for this name, the server refused the client certificate or wants one,
// or one side speaks TLS and the other does not. It is never transient.
type TLSError struct {
	// Problem says what is wrong and what to set, in words.
	Problem string
	// Cause is the handshake's own words, e.g. "tls: failed to verify
	// certificate: x509: certificate signed by unknown authority".
	Cause string
	// Settings are the connection's TLS settings and where each came
	// from (Security.String): names and paths, never key material.
	Settings string
}

func (e *TLSError) Error() string {
	return "TLS handshake failed: " + e.Problem + ": " + e.Cause + "; settings: " + e.Settings
}

// The problems a TLSError names.
const (
	problemUntrusted = "rlflow does not trust the server's certificate " +
		"(TEMPORAL_TLS_SERVER_CA_CERT_PATH or the profile's tls.server_ca_cert_path must be the CA that signed it, or unset for a public CA; " +
		"the certificate must be valid for the address's host, or for TEMPORAL_TLS_SERVER_NAME or tls.server_name)"
	problemRefused = "the server refused rlflow's client certificate " +
		"(it must be signed by a CA the server trusts for clients, and match its key)"
	problemNoCert = "the server requires a client certificate (mTLS) and none is set " +
		"(set TEMPORAL_TLS_CLIENT_CERT_PATH and TEMPORAL_TLS_CLIENT_KEY_PATH, or the profile's tls.client_cert_path and tls.client_key_path)"
	problemNotTLS = "the server does not speak TLS " +
		"(unset TEMPORAL_TLS and the profile's tls settings, or set tls.disabled; an API key turns TLS on unless it is disabled)"
	problemWantsTLS = "the server speaks TLS and rlflow connects in plaintext " +
		"(set TEMPORAL_TLS=true, or a tls section in the profile; for a private CA also TEMPORAL_TLS_SERVER_CA_CERT_PATH)"
)

// diagnose returns a *TLSError when err, a failed dial of t, comes from a
// TLS handshake, and err otherwise. gRPC reports a handshake that failed
// as Unavailable, like a server that is down, so the message tells them
// apart; where the message does not (the server closed the connection
// after refusing the client's certificate, or a plaintext client met a
// TLS server), a handshake of its own to t asks the server.
func diagnose(ctx context.Context, t Target, err error) error {
	st := serviceerror.ToStatus(err)
	if st.Code() != codes.Unavailable {
		return err
	}
	if e := classify(st.Message(), t.Security); e != nil {
		return e
	}
	if e := probe(ctx, t); e != nil {
		return e
	}
	return err
}

// classify is the TLSError that msg, a gRPC connection error, reports;
// nil when it reports no handshake failure.
func classify(msg string, sec Security) *TLSError {
	cause := handshakeCause(msg)
	if cause == "" {
		return nil
	}
	e := &TLSError{Cause: cause, Settings: sec.String()}
	switch {
	case strings.Contains(cause, "first record does not look like a TLS handshake"):
		e.Problem = problemNotTLS
	case strings.HasPrefix(cause, "remote error:") && sec.clientCert:
		e.Problem = problemRefused
	case strings.HasPrefix(cause, "remote error:"):
		e.Problem = problemNoCert
	default:
		e.Problem = problemUntrusted
	}
	return e
}

// handshakeCause is the part of msg from the TLS layer's own words on: a
// certificate the client rejected (x509), an alert the server sent
// (remote error), or a TLS handshake the transport reports failed; empty
// when msg holds none of them.
func handshakeCause(msg string) string {
	start := -1
	for _, marker := range []string{"remote error: tls:", "tls: ", "x509: "} {
		if i := strings.Index(msg, marker); i >= 0 && (start < 0 || i < start) {
			start = i
		}
	}
	if start < 0 {
		if i := strings.Index(msg, "authentication handshake failed: "); i >= 0 {
			start = i + len("authentication handshake failed: ")
		} else {
			return ""
		}
	}
	return strings.TrimRight(msg[start:], `" `)
}

// probeTimeout bounds probe's handshake: the frontend answered the
// dial that failed a moment ago.
const probeTimeout = 2 * time.Second

// probe makes a TLS handshake of its own to t when its port accepts
// connections, and reads the server's first bytes: a server that refuses
// the client certificate says so in an alert (TLS 1.3 sends it after the
// client's handshake is done, so gRPC may see only a closed connection),
// and a plaintext client's dial cannot tell a TLS server from a broken
// one. nil when the server is down or the handshake is fine.
func probe(ctx context.Context, t Target) *TLSError {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", t.Address)
	if err != nil {
		return nil
	}
	defer raw.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = raw.SetDeadline(deadline)
	}
	host, _, err := net.SplitHostPort(t.Address)
	if err != nil {
		return nil
	}
	if t.Security.base.ConnectionOptions.TLS == nil {
		// Is the server speaking TLS? Only its answer matters here, so
		// its certificate is not checked; nothing is sent after the
		// handshake.
		conn := tls.Client(raw, &tls.Config{ServerName: host, NextProtos: []string{"h2"}, InsecureSkipVerify: true})
		err := conn.HandshakeContext(ctx)
		if err == nil || strings.Contains(err.Error(), "remote error: tls:") {
			return &TLSError{Problem: problemWantsTLS, Cause: "a TLS handshake with it succeeds", Settings: t.Security.String()}
		}
		return nil
	}
	conf := t.Security.base.ConnectionOptions.TLS.Clone()
	if conf.ServerName == "" {
		conf.ServerName = host
	}
	conf.NextProtos = []string{"h2"}
	conn := tls.Client(raw, conf)
	err = conn.HandshakeContext(ctx)
	if err == nil {
		// A server that refuses the client's certificate after the
		// handshake sends its alert first; one that accepts it sends
		// its HTTP/2 settings or waits for the client's.
		_, err = conn.Read(make([]byte, 1))
	}
	if err == nil {
		return nil
	}
	return classify(err.Error(), t.Security)
}
