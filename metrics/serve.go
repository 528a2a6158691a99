package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Path is the route the metrics are served on.
const Path = "/metrics"

// Server serves a registry on one address.
type Server struct {
	// Addr is the address bound (the port chosen where addr's was 0).
	Addr string
	srv  *http.Server
	done chan struct{}
}

// Serve listens on addr (host:port) and serves m's registry on Path until
// Close. A listen failure is returned, naming the address; a later serve
// failure is logged to log.
func (m *Metrics) Serve(addr string, log *slog.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listening on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle(Path, promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{
		// A collector's error (the process collector on an unusual
		// kernel) drops that metric, not the whole page.
		ErrorHandling: promhttp.ContinueOnError,
	}))
	s := &Server{Addr: ln.Addr().String(), done: make(chan struct{}),
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) && log != nil {
			log.Error("metrics server stopped", "address", s.Addr, "err", err)
		}
	}()
	return s, nil
}

// URL is where the metrics are: http://Addr/metrics.
func (s *Server) URL() string { return "http://" + s.Addr + Path }

// Close stops serving, waiting up to a few seconds for scrapes in flight.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	<-s.done
	return err
}
