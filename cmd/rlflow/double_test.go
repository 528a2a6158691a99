package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
