package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestEnvDuration(t *testing.T) {
	for _, tc := range []struct {
		name, value string
		want        time.Duration
		wantErr     string
	}{
		{"unset", "", 7 * time.Second, ""},
		{"a duration", "90s", 90 * time.Second, ""},
		{"spaces", " 5m ", 5 * time.Minute, ""},
		{"zero waits forever", "0", 0, ""},
		{"not a duration", "30", 7 * time.Second, `RLFLOW_CONNECT_TIMEOUT="30": not a duration such as 30s or 5m (0 waits forever)`},
		{"negative", "-1s", 7 * time.Second, `RLFLOW_CONNECT_TIMEOUT="-1s": must be 0 (wait forever) or more`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("RLFLOW_CONNECT_TIMEOUT", tc.value)
			got, err := envDuration("RLFLOW_CONNECT_TIMEOUT", 7*time.Second)
			assert.Equal(t, tc.want, got)
			if tc.wantErr == "" {
				assert.NoError(t, err)
			} else {
				assert.EqualError(t, err, tc.wantErr)
			}
		})
	}
}

func TestConnectFlagsCheck(t *testing.T) {
	assert.NoError(t, connectFlags{}.check())
	assert.NoError(t, connectFlags{timeout: time.Minute}.check())
	assert.EqualError(t, connectFlags{timeout: -time.Second}.check(), "--connect-timeout -1s: must be 0 (wait until Temporal answers) or more")
}
