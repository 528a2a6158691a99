package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/rlflow/rlflow/codec"
	"github.com/spf13/cobra"
)

func newCodecServerCmd() *cobra.Command {
	var listen, tokenEnv string
	var uiOrigins []string
	cmd := &cobra.Command{
		Use:   "codec-server",
		Short: "Serve the payload codec to the Temporal UI and CLI, to decrypt runs for key holders",
		Long: `codec-server is the Temporal codec server of rlflow's payload encryption
(README, "Encrypting payloads"): with ` + codec.EnvKeys + ` and ` + codec.EnvKeyID + ` set,
workers and the CLI encrypt every payload (inputs, step arguments, outputs,
failures), and this server decrypts them for the Temporal UI and the temporal
CLI of people who hold the keys. It serves POST /encode and POST /decode with
{"payloads": [...]} (the codec server protocol), at any path depth.

Point the UI at it (the UI's "Codec Server" setting, or the UI server's
codec endpoint) as http://LISTEN; the CLI takes
  temporal workflow show -w ID --codec-endpoint http://127.0.0.1:8081

Only the --ui-origin origins get CORS answers; other browser origins are
refused. It binds loopback by default: each key holder runs their own. With
--token-env NAME every request must carry "Authorization: Bearer $NAME"
(the temporal CLI's --codec-auth, or a proxy in front of the UI).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := codec.LoadEnv(os.Getenv)
			if err != nil {
				return &exitError{code: 2, err: err}
			}
			if c == nil {
				return &exitError{code: 2, err: fmt.Errorf("no keys: set %s and %s as the workers have them", codec.EnvKeys, codec.EnvKeyID)}
			}
			var token string
			if tokenEnv != "" {
				if token = os.Getenv(tokenEnv); token == "" {
					return &exitError{code: 2, err: fmt.Errorf("--token-env: $%s is empty or unset", tokenEnv)}
				}
			}
			h, err := codec.NewHTTPHandler(c, codec.ServerOptions{UIOrigins: uiOrigins, Token: token})
			if err != nil {
				return &exitError{code: 2, err: fmt.Errorf("--ui-origin: %w", err)}
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return &exitError{code: 1, err: fmt.Errorf("codec-server: %w", err)}
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, nil))
			log.Info("rlflow codec server", "url", "http://"+ln.Addr().String(), "ui_origins", strings.Join(uiOrigins, ","),
				"key_ids", strings.Join(c.KeyIDs(), ","), "encrypts_with", c.EncryptWith(), "bearer_token", tokenEnv != "")
			if ip := ln.Addr().(*net.TCPAddr).IP; !ip.IsLoopback() {
				log.Warn("the codec server listens beyond loopback: whoever reaches it can decrypt history; serve it behind TLS and set --token-env", "url", "http://"+ln.Addr().String())
			}
			return serveCodec(cmd.Context(), ln, h)
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8081", "host:port to serve on")
	f.StringArrayVar(&uiOrigins, "ui-origin", []string{"http://localhost:8233", "http://127.0.0.1:8233"},
		"browser origin of the Temporal UI, as its address bar shows it (repeatable; the default is the dev server's UI)")
	f.StringVar(&tokenEnv, "token-env", "", "environment variable holding the bearer token every request must carry (default: no token check)")
	return cmd
}

// serveCodec serves h on ln until ctx is done, then lets requests in flight
// finish for a few seconds.
func serveCodec(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute}
	errs := make(chan error, 1)
	go func() { errs <- srv.Serve(ln) }()
	select {
	case err := <-errs:
		return fmt.Errorf("codec-server: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("codec-server: stopping: %w", err)
	}
	return nil
}
