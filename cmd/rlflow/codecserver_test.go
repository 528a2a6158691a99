package main

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/codec"
	"github.com/rlflow/rlflow/internal/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testCodecKey = base64.StdEncoding.EncodeToString([]byte(strings.Repeat("k", codec.KeyBytes)))

// runCodecServer runs the command with args until ctx ends and returns its error.
func runCodecServer(ctx context.Context, args ...string) error {
	cmd := newCodecServerCmd()
	cmd.SetArgs(args)
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	return cmd.ExecuteContext(ctx)
}

func TestCodecServerRefusesBadSetup(t *testing.T) {
	for _, tc := range []struct {
		name     string
		keys, id string
		args     []string
		want     string
	}{
		{name: "codec off", want: "no keys: set RLFLOW_CODEC_KEYS and RLFLOW_CODEC_KEY_ID as the workers have them"},
		{name: "malformed keys", keys: "k1=" + testCodecKey, id: "k1", want: "RLFLOW_CODEC_KEYS entry 1 of 1 has no ':': want ID:BASE64KEY"},
		{name: "token env empty", keys: "k1:" + testCodecKey, id: "k1", args: []string{"--token-env", "RLFLOW_TEST_CODEC_TOKEN"},
			want: "--token-env: $RLFLOW_TEST_CODEC_TOKEN is empty or unset"},
		{name: "origin with a path", keys: "k1:" + testCodecKey, id: "k1", args: []string{"--ui-origin", "http://127.0.0.1:8233/ui"},
			want: `--ui-origin: origin "http://127.0.0.1:8233/ui": want only scheme://HOST[:PORT], as the browser sends it (no path, not even a trailing /)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(codec.EnvKeys, tc.keys)
			t.Setenv(codec.EnvKeyID, tc.id)
			t.Setenv("RLFLOW_TEST_CODEC_TOKEN", "")
			err := runCodecServer(context.Background(), tc.args...)
			var ee *exitError
			require.True(t, errors.As(err, &ee), "error %v", err)
			assert.Equal(t, 2, ee.code)
			assert.EqualError(t, ee.err, tc.want)
			assert.NotContains(t, err.Error(), testCodecKey)
		})
	}
}

// The command serves the codec with its defaults (the dev UI's origins) and
// the token check, and stops cleanly when its context ends.
func TestCodecServerServesUntilStopped(t *testing.T) {
	t.Setenv(codec.EnvKeys, "k1:"+testCodecKey)
	t.Setenv(codec.EnvKeyID, "k1")
	t.Setenv("RLFLOW_TEST_CODEC_TOKEN", "tok")
	addr := fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runCodecServer(ctx, "--listen", addr, "--token-env", "RLFLOW_TEST_CODEC_TOKEN") }()
	t.Cleanup(func() {
		cancel()
		<-done
	})

	decode := func(origin, auth string) (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/decode", strings.NewReader(`{"payloads": []}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Origin", origin)
		req.Header.Set("Authorization", auth)
		return http.DefaultClient.Do(req)
	}
	testutil.Eventually(t, 10*time.Second, "the codec server to answer", func() bool {
		resp, err := decode("http://localhost:8233", "Bearer tok")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return true
	})
	for _, tc := range []struct {
		origin, auth string
		code         int
	}{
		{"http://localhost:8233", "Bearer tok", http.StatusOK},
		{"http://127.0.0.1:8233", "Bearer tok", http.StatusOK},
		{"http://127.0.0.1:9999", "Bearer tok", http.StatusForbidden},
		{"http://localhost:8233", "Bearer nope", http.StatusUnauthorized},
	} {
		resp, err := decode(tc.origin, tc.auth)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, tc.code, resp.StatusCode, "origin %s, %s", tc.origin, tc.auth)
		if tc.code == http.StatusOK {
			assert.Equal(t, tc.origin, resp.Header.Get("Access-Control-Allow-Origin"))
		}
	}
	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
		done <- nil // for the cleanup
	case <-time.After(10 * time.Second):
		t.Fatal("the codec server did not stop after its context ended")
	}
}
