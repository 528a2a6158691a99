package main

import (
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rlflow/rlflow/vllm/double"
)

func TestDoubleAddrs(t *testing.T) {
	got, err := doubleAddrs([]string{"127.0.0.1:8000"}, 3)
	require.NoError(t, err)
	assert.Equal(t, []string{"127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002"}, got)
	got, err = doubleAddrs([]string{"127.0.0.1:1", "127.0.0.1:2"}, 1)
	require.NoError(t, err)
	assert.Equal(t, []string{"127.0.0.1:1", "127.0.0.1:2"}, got)
	for _, bad := range []struct {
		listen  []string
		servers int
		want    string
	}{
		{[]string{"127.0.0.1:8000"}, 0, "--servers 0"},
		{[]string{"a:1", "b:2"}, 2, "one --listen"},
		{[]string{"nohost"}, 2, "--listen \"nohost\""},
		{[]string{"127.0.0.1:65535"}, 2, "ports 1..65535"},
	} {
		_, err := doubleAddrs(bad.listen, bad.servers)
		assert.ErrorContains(t, err, bad.want)
	}
}

func TestParseRates(t *testing.T) {
	got, err := parseRates("--error-rate", []string{"/update_weights=1", "*=0.25"})
	require.NoError(t, err)
	assert.Equal(t, map[string]float64{"/update_weights": 1, "*": 0.25}, got)
	for _, bad := range []string{"update_weights=1", "/x", "/x=lots"} {
		_, err := parseRates("--error-rate", []string{bad})
		assert.ErrorContains(t, err, "--error-rate", bad)
	}
}

func TestEnvInt(t *testing.T) {
	for _, c := range []struct {
		env  string
		want int
		err  string
	}{
		{"", -1, ""},
		{"3", 3, ""},
		{" 2 ", 2, ""},
		{"3abc", -1, `RLFLOW_TEST_INT="3abc": not an integer`},
		{"gpu0", -1, `RLFLOW_TEST_INT="gpu0": not an integer`},
	} {
		t.Setenv("RLFLOW_TEST_INT", c.env)
		got, err := envInt("RLFLOW_TEST_INT", -1)
		if got != c.want || (err == nil) != (c.err == "") || (err != nil && err.Error() != c.err) {
			t.Errorf("envInt with %q = %d, %v; want %d, %q", c.env, got, err, c.want, c.err)
		}
	}
}

// doubleConfigFrom runs vllm-double with args and returns the Config its
// doubles would get (nothing is served).
func doubleConfigFrom(t *testing.T, args ...string) (double.Config, error) {
	t.Helper()
	var got double.Config
	cmd := doubleCmd(func(_ context.Context, cfg double.Config, _ []string) error {
		got = cfg
		return nil
	})
	cmd.SetArgs(args)
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	err := cmd.Execute()
	return got, err
}

func TestDoubleFlags(t *testing.T) {
	cfg, err := doubleConfigFrom(t)
	require.NoError(t, err)
	assert.Equal(t, double.GenD, cfg.Generation, "the default generation stays D")
	assert.Equal(t, double.BackendDisk, cfg.Backend, "the --backend default stays disk")
	assert.Equal(t, double.LoadFormatAuto, cfg.LoadFormat)
	assert.False(t, cfg.NoWeightChecker)
	assert.True(t, cfg.DevMode)

	cfg, err = doubleConfigFrom(t, "--generation", "e", "--backend", "nccl", "--load-format", "DUMMY", "--no-weight-checker")
	require.NoError(t, err)
	assert.Equal(t, double.GenE, cfg.Generation)
	assert.Equal(t, double.BackendNCCL, cfg.Backend)
	assert.Equal(t, double.LoadFormatDummy, cfg.LoadFormat)
	assert.True(t, cfg.NoWeightChecker)
	s, err := double.New(cfg)
	require.NoError(t, err, "the flags make a valid double")
	s.Close()

	// A and B have no disk backend: unset, --backend is nccl there; given,
	// it is the caller's choice and the double refuses disk.
	for _, c := range []struct {
		args    []string
		gen     double.Generation
		backend string
	}{
		{[]string{"--generation", "a"}, double.GenA, double.BackendNCCL},
		{[]string{"--generation", "B"}, double.GenB, double.BackendNCCL},
		{[]string{"--generation", "C"}, double.GenC, double.BackendDisk},
		{[]string{"--generation", "E"}, double.GenE, double.BackendDisk},
		{[]string{"--generation", "A", "--backend", "nccl"}, double.GenA, double.BackendNCCL},
	} {
		cfg, err := doubleConfigFrom(t, c.args...)
		require.NoError(t, err, "%v", c.args)
		assert.Equal(t, c.gen, cfg.Generation, "%v", c.args)
		assert.Equal(t, c.backend, cfg.Backend, "%v", c.args)
		s, err := double.New(cfg)
		require.NoError(t, err, "%v: the flags make a valid double", c.args)
		s.Close()
	}

	for _, bad := range [][]string{{"--load-format", "safetensors"}, {"--generation", "F"}, {"--generation", "A", "--backend", "disk"}} {
		cfg, err := doubleConfigFrom(t, bad...)
		require.NoError(t, err, "the double validates the value")
		_, err = double.New(cfg)
		assert.Error(t, err, "%v", bad)
	}
	_, err = doubleConfigFrom(t, "--error-rate", "nope")
	var ee *exitError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, 2, ee.code)
}

func TestDoubleHelpNamesTheDouble(t *testing.T) {
	long := newDoubleCmd().Long
	for _, want := range []string{"TEST AND DEMO DOUBLES", "NOT an", "#52152", "/collective_rpc", "--load-format dummy", "generation A, B, C, D or E"} {
		assert.Contains(t, long, want)
	}
}
