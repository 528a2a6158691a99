package activities

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/pipelines"
	"github.com/rlflow/rlflow/vllm"
	"github.com/rlflow/rlflow/vllm/double"
)

func paused(t *testing.T, d *testDouble) bool {
	t.Helper()
	c, err := vllm.New(d.URL, vllm.Options{})
	require.NoError(t, err)
	p, err := c.IsPaused(context.Background())
	require.NoError(t, err)
	return p
}

func TestPauseResumeReachEveryServer(t *testing.T) {
	ctx := context.Background()
	d1 := newDouble(t, double.Config{DevMode: true, WorldSize: 2, DataParallel: 3})
	d2 := newDouble(t, double.Config{DevMode: true, Generation: double.GenC})
	a := newActivities(t)
	sc := stepContext(t, "pause", d1, d2)

	for _, mode := range []string{"", vllm.PauseAbort, vllm.PauseWait, vllm.PauseKeep} {
		out, err := a.Pause(ctx, PauseInput{Context: sc, Mode: mode})
		require.NoError(t, err)
		assert.Equal(t, 2, out.Servers)
		assert.True(t, paused(t, d1))
		assert.True(t, paused(t, d2))

		ip, err := a.IsPaused(ctx, ControlInput{Context: sc})
		require.NoError(t, err)
		assert.Equal(t, &IsPausedOutput{Paused: true, PausedServers: 2, Attempt: 1}, ip)

		rs, err := a.Resume(ctx, ControlInput{Context: sc})
		require.NoError(t, err)
		assert.Equal(t, 2, rs.Servers)
		assert.False(t, paused(t, d1))
		assert.False(t, paused(t, d2))
	}
	assert.Equal(t, 4, d2.Stats().Requests["POST /pause"])
	assert.Equal(t, 4, d2.Stats().Requests["POST /resume"])

	// One paused server makes the fleet paused.
	c, err := vllm.New(d2.URL, vllm.Options{})
	require.NoError(t, err)
	require.NoError(t, c.Pause(ctx, vllm.PauseKeep))
	ip, err := a.IsPaused(ctx, ControlInput{Context: sc})
	require.NoError(t, err)
	assert.Equal(t, &IsPausedOutput{Paused: true, PausedServers: 1, Attempt: 1}, ip)

	ws, err := a.WorldSize(ctx, ControlInput{Context: sc})
	require.NoError(t, err)
	assert.Equal(t, 1+2*3+1, ws.WorldSize)
}

func TestControlErrors(t *testing.T) {
	ctx := context.Background()
	good := newDouble(t, double.Config{DevMode: true})
	pauseFails := newDouble(t, double.Config{DevMode: true, Faults: double.Faults{ErrorRate: map[string]float64{"/pause": 1}}})
	noDev := newDouble(t, double.Config{})
	conflict := statusServer(t, "/resume", 409, `{"detail": "engine busy"}`, good.Handler())

	// A pause that fails on one server is undone on the other, and the
	// error names the failed server, the call and the reason.
	a := newActivities(t)
	_, err := a.Pause(ctx, PauseInput{Context: stepContext(t, "pause", good, pauseFails), Mode: vllm.PauseKeep})
	assert.Equal(t, pipelines.ErrTypeServerError, errType(t, err))
	assert.ErrorContains(t, err, "pause (mode keep) (type: ServerError, retryable: true): vllm fleet: pause failed on 1 of 2 servers; vllm "+pauseFails.URL+": POST /pause: HTTP 500: double: injected fault")
	assert.ErrorContains(t, err, "resumed "+good.URL)
	assert.NotContains(t, err.Error(), "vllm "+good.URL+": POST /pause")
	assert.False(t, paused(t, good), "rolled back")

	cases := []struct {
		name string
		run  func() error
		typ  string
		want string
	}{
		{"pause 404 without dev mode", func() error {
			_, err := a.Pause(ctx, PauseInput{Context: stepContext(t, "p", noDev)})
			return err
		}, pipelines.ErrTypeServerRejected, "vllm " + noDev.URL + ": POST /pause: HTTP 404: Not Found"},
		{"bad mode", func() error {
			_, err := a.Pause(ctx, PauseInput{Context: stepContext(t, "p", good), Mode: "hold"})
			return err
		}, pipelines.ErrTypeBadInput, `pause: mode: "hold" is not one of abort, wait, keep`},
		{"resume 409 is retryable", func() error {
			_, err := a.Resume(ctx, ControlInput{Context: pipelines.StepContext{Servers: []pipelines.Server{{URL: conflict}}}})
			return err
		}, pipelines.ErrTypeServerError, "POST /resume: HTTP 409: engine busy"},
		{"is_paused 404", func() error {
			_, err := a.IsPaused(ctx, ControlInput{Context: stepContext(t, "p", good, noDev)})
			return err
		}, pipelines.ErrTypeServerRejected, "is_paused (type: ServerRejected, retryable: false): vllm fleet: is_paused failed on 1 of 2 servers; vllm " + noDev.URL + ": GET /is_paused: HTTP 404"},
		{"world_size 404", func() error {
			_, err := a.WorldSize(ctx, ControlInput{Context: stepContext(t, "p", noDev)})
			return err
		}, pipelines.ErrTypeServerRejected, "GET /get_world_size: HTTP 404"},
		{"no servers", func() error {
			_, err := a.Resume(ctx, ControlInput{})
			return err
		}, pipelines.ErrTypeBadInput, "resume: the pipeline has no servers"},
		{"unreachable", func() error {
			_, err := a.Resume(ctx, ControlInput{Context: pipelines.StepContext{Servers: []pipelines.Server{{URL: "http://127.0.0.1:1"}}}, Timeout: pipelines.Duration(1e9)})
			return err
		}, pipelines.ErrTypeServerError, "vllm http://127.0.0.1:1: POST /resume: "},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.run()
			assert.Equal(t, c.typ, errType(t, err))
			assert.ErrorContains(t, err, c.want)
		})
	}
}
