package runs

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/internal/testutil/tlstest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
)

func TestClassify(t *testing.T) {
	mtls := Security{clientCert: true}
	for _, tc := range []struct {
		name, msg string
		sec       Security
		problem   string // "" = not a handshake failure
		cause     string
	}{
		{"unknown authority",
			`connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate signed by unknown authority"`,
			Security{}, problemUntrusted, "tls: failed to verify certificate: x509: certificate signed by unknown authority"},
		{"wrong name",
			`connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate is valid for localhost, not wrong.example"`,
			Security{}, problemUntrusted, "tls: failed to verify certificate: x509: certificate is valid for localhost, not wrong.example"},
		{"client certificate refused",
			`connection error: desc = "error reading server preface: remote error: tls: certificate required"`,
			mtls, problemRefused, "remote error: tls: certificate required"},
		{"no client certificate",
			`connection error: desc = "error reading server preface: remote error: tls: certificate required"`,
			Security{}, problemNoCert, "remote error: tls: certificate required"},
		{"plaintext server",
			`connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`,
			Security{}, problemNotTLS, "tls: first record does not look like a TLS handshake"},
		{"refused", `connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:7233: connect: connection refused"`, Security{}, "", ""},
		{"closed", `connection error: desc = "error reading server preface: EOF"`, Security{}, "", ""},
		{"broken pipe", `write tcp 127.0.0.1:53632->127.0.0.1:39947: write: broken pipe`, Security{}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := classify(tc.msg, tc.sec)
			if tc.problem == "" {
				assert.Nil(t, got)
				return
			}
			require.NotNil(t, got)
			assert.Equal(t, tc.problem, got.Problem)
			assert.Equal(t, tc.cause, got.Cause)
		})
	}
}

// deadAddress is a loopback address nothing listens on.
func deadAddress(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	l.Close()
	return addr
}

// plaintextHTTP2 is a server that answers every connection with an HTTP/2
// SETTINGS frame, as a plaintext gRPC server does, and closes it.
func plaintextHTTP2(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = http2.NewFramer(c, c).WriteSettings()
			time.Sleep(50 * time.Millisecond)
			c.Close()
		}
	}()
	return l.Addr().String()
}

// TestConnectTLSFailures dials TLS frontends (tlstest proxies whose
// backend is down) with settings that cannot work: each fails at once
// with a TLSError naming the problem and the settings, checked against
// testdata/tls_errors.golden, and never as a transient error.
func TestConnectTLSFailures(t *testing.T) {
	noUserConfig(t)
	ca := tlstest.NewCA(t, "ca")
	other := tlstest.NewCA(t, "other")
	good, stranger := ca.Client("worker"), other.Client("stranger")
	server := ca.Server()
	tlsOnly := tlstest.NewProxy(t, deadAddress(t), tlstest.ProxyOptions{Cert: server})
	mtls := tlstest.NewProxy(t, deadAddress(t), tlstest.ProxyOptions{Cert: server, ClientCA: ca})
	plain := plaintextHTTP2(t)
	trust := fakeEnv{"TEMPORAL_TLS_SERVER_CA_CERT_PATH": ca.CertPath}
	with := func(env fakeEnv, more fakeEnv) fakeEnv {
		out := fakeEnv{}
		for _, e := range []fakeEnv{env, more} {
			for k, v := range e {
				out[k] = v
			}
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		address string
		env     fakeEnv
		problem string
	}{
		{"server CA is another", tlsOnly.Address, fakeEnv{"TEMPORAL_TLS_SERVER_CA_CERT_PATH": other.CertPath}, problemUntrusted},
		{"system roots only", tlsOnly.Address, fakeEnv{"TEMPORAL_TLS": "true"}, problemUntrusted},
		{"server name mismatch", tlsOnly.Address, with(trust, fakeEnv{"TEMPORAL_TLS_SERVER_NAME": "wrong.example"}), problemUntrusted},
		{"client certificate of another CA", mtls.Address, with(trust, fakeEnv{
			"TEMPORAL_TLS_CLIENT_CERT_PATH": stranger.CertPath, "TEMPORAL_TLS_CLIENT_KEY_PATH": stranger.KeyPath}), problemRefused},
		{"no client certificate", mtls.Address, trust, problemNoCert},
		{"plaintext client", tlsOnly.Address, fakeEnv{}, problemWantsTLS},
		{"plaintext server", plain, trust, problemNotTLS},
	} {
		t.Run(tc.name, func(t *testing.T) {
			target, err := Resolve(Settings{Address: tc.address, Env: tc.env})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // a hang guard
			defer cancel()
			_, err = ConnectTarget(ctx, target)
			require.Error(t, err)
			var te *TLSError
			require.True(t, errors.As(err, &te), "%v", err)
			assert.Equal(t, tc.problem, te.Problem)
			assert.False(t, transient(ctx, err), "a TLS failure is not worth retrying")
			msg := strings.NewReplacer(tc.address, "$ADDR", filepath.Dir(ca.CertPath), "$CA", filepath.Dir(other.CertPath), "$OTHER").Replace(err.Error())
			checkGolden(t, "tls_errors", tc.name, msg)

			// The worker's dial fails as fast: an hour's backoff would
			// trip the hang guard.
			_, err = Dial(ctx, DialOptions{Address: target.Address, Namespace: target.Namespace, Security: target.Security,
				Backoff: Backoff{Min: time.Hour, Max: time.Hour}})
			require.True(t, errors.As(err, &te), "%v", err)
			assert.Equal(t, tc.problem, te.Problem)
		})
	}

	// A frontend that accepts the handshake but is down behind it is an
	// outage: transient, waited out by a worker.
	t.Run("handshake fine, server down", func(t *testing.T) {
		target, err := Resolve(Settings{Address: mtls.Address, Env: with(trust, fakeEnv{
			"TEMPORAL_TLS_CLIENT_CERT_PATH": good.CertPath, "TEMPORAL_TLS_CLIENT_KEY_PATH": good.KeyPath})})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_, err = ConnectTarget(ctx, target)
		require.Error(t, err)
		var te *TLSError
		assert.False(t, errors.As(err, &te), "%v", err)
		assert.True(t, transient(ctx, err), "%v", err)
	})
}
