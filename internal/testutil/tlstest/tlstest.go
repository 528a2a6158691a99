// Package tlstest is test support for secure Temporal connections: a
// certificate authority made in the test (server and client certificates
// written as PEM files, as an operator would hand them out) and a
// TLS-terminating proxy that stands in front of a plaintext dev server the
// way a TLS-only cluster's frontend does, optionally requiring a client
// certificate of its CA and recording the authorization header each
// connection's first request carried. It is imported by _test.go files only
// and is not part of rlflow's API.
package tlstest

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// CA is a certificate authority made for one test. Its files live in the
// test's temp dir.
type CA struct {
	t    testing.TB
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// CertPath is the CA certificate as PEM: what a client trusts
	// (TEMPORAL_TLS_SERVER_CA_CERT_PATH) or a server verifies clients with.
	CertPath string
	pool     *x509.CertPool
	serial   int64
}

// NewCA makes a self-signed CA called name.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("making CA %s: %v", name, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{t: t, dir: filepath.Join(t.TempDir(), name), cert: cert, key: key, pool: x509.NewCertPool(), serial: 1}
	if err := os.MkdirAll(ca.dir, 0o700); err != nil {
		t.Fatal(err)
	}
	ca.pool.AddCert(cert)
	ca.CertPath = ca.write("ca.pem", "CERTIFICATE", der)
	return ca
}

// Pair is a certificate and its key, as PEM files.
type Pair struct {
	CertPath, KeyPath string
	tls               tls.Certificate
}

// Server issues a server certificate for 127.0.0.1, ::1 and localhost.
func (ca *CA) Server() Pair {
	return ca.issue("server", x509.ExtKeyUsageServerAuth, func(c *x509.Certificate) {
		c.DNSNames = []string{"localhost"}
		c.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	})
}

// Client issues a client certificate with common name name.
func (ca *CA) Client(name string) Pair {
	return ca.issue(name, x509.ExtKeyUsageClientAuth, func(c *x509.Certificate) { c.Subject.CommonName = name })
}

func (ca *CA) issue(name string, usage x509.ExtKeyUsage, fill func(*x509.Certificate)) Pair {
	ca.t.Helper()
	ca.serial++
	key := newKey(ca.t)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.serial),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
	fill(tmpl)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		ca.t.Fatalf("issuing %s: %v", name, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		ca.t.Fatal(err)
	}
	p := Pair{CertPath: ca.write(name+".pem", "CERTIFICATE", der), KeyPath: ca.write(name+"-key.pem", "PRIVATE KEY", keyDER)}
	if p.tls, err = tls.LoadX509KeyPair(p.CertPath, p.KeyPath); err != nil {
		ca.t.Fatal(err)
	}
	return p
}

func (ca *CA) write(name, typ string, der []byte) string {
	ca.t.Helper()
	p := filepath.Join(ca.dir, name)
	if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		ca.t.Fatal(err)
	}
	return p
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// ProxyOptions configure Proxy.
type ProxyOptions struct {
	// Cert is the proxy's server certificate.
	Cert Pair
	// ClientCA, when set, makes the proxy require a client certificate
	// issued by it (mTLS); a connection without one fails its handshake.
	ClientCA *CA
}

// Proxy terminates TLS on a loopback port and forwards the plaintext
// bytes to a backend: a TLS-only frontend in front of a dev server.
type Proxy struct {
	// Address is the proxy's host:port.
	Address string

	backend string
	ln      net.Listener
	wg      sync.WaitGroup

	mu      sync.Mutex
	auth    []string
	served  int
	refused []error
}

// NewProxy starts a proxy to backend for the test; it stops at cleanup.
func NewProxy(t testing.TB, backend string, o ProxyOptions) *Proxy {
	t.Helper()
	conf := &tls.Config{
		Certificates: []tls.Certificate{o.Cert.tls},
		NextProtos:   []string{http2.NextProtoTLS},
		MinVersion:   tls.VersionTLS12,
	}
	if o.ClientCA != nil {
		conf.ClientAuth = tls.RequireAndVerifyClientCert
		conf.ClientCAs = o.ClientCA.pool
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", conf)
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Address: ln.Addr().String(), backend: backend, ln: ln}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.wg.Wait()
	})
	return p
}

// Authorizations are the authorization headers of the first request of
// every connection served so far ("" for a request without one).
func (p *Proxy) Authorizations() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.auth...)
}

// Served is how many connections completed their handshake.
func (p *Proxy) Served() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.served
}

// Refused are the handshake errors of the connections the proxy refused.
func (p *Proxy) Refused() []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]error(nil), p.refused...)
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.serve(c.(*tls.Conn))
		}()
	}
}

// serve forwards one connection both ways until either side closes, and
// records the authorization header of its first request.
func (p *Proxy) serve(c *tls.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := c.Handshake(); err != nil {
		p.mu.Lock()
		p.refused = append(p.refused, err)
		p.mu.Unlock()
		return
	}
	_ = c.SetDeadline(time.Time{})
	p.mu.Lock()
	p.served++
	p.mu.Unlock()
	b, err := net.Dial("tcp", p.backend)
	if err != nil {
		return
	}
	defer b.Close()

	pr, pw := io.Pipe()
	sniffed := make(chan struct{})
	go func() {
		defer close(sniffed)
		auth, ok := firstAuthorization(pr)
		pr.Close() // later writes fail, which ends the tee
		if ok {
			p.mu.Lock()
			p.auth = append(p.auth, auth)
			p.mu.Unlock()
		}
	}()
	done := make(chan struct{}, 2)
	go func() {
		_, _ = io.Copy(&tee{w: b, sniff: pw}, c)
		pw.Close()
		_ = b.(*net.TCPConn).CloseWrite()
		done <- struct{}{}
	}()
	go func() {
		_, _ = io.Copy(c, b)
		_ = c.CloseWrite()
		done <- struct{}{}
	}()
	<-done
	c.Close()
	b.Close()
	<-done
	<-sniffed
}

// tee writes to w and, until that first fails, to sniff.
type tee struct {
	w     io.Writer
	sniff io.Writer
}

func (t *tee) Write(b []byte) (int, error) {
	n, err := t.w.Write(b)
	if t.sniff != nil {
		if _, serr := t.sniff.Write(b[:n]); serr != nil {
			t.sniff = nil
		}
	}
	return n, err
}

// firstAuthorization reads an HTTP/2 client stream up to its first HEADERS
// frame and returns that request's authorization header; ok is false when
// the stream ends before one.
func firstAuthorization(r io.Reader) (auth string, ok bool) {
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(r, preface); err != nil || !bytes.Equal(preface, []byte(http2.ClientPreface)) {
		return "", false
	}
	fr := http2.NewFramer(io.Discard, r)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return "", false
		}
		if h, isHeaders := f.(*http2.MetaHeadersFrame); isHeaders {
			for _, hf := range h.RegularFields() {
				if hf.Name == "authorization" {
					return hf.Value, true
				}
			}
			return "", true
		}
	}
}
