package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Flags that cannot make a report are refused before anything connects,
// with status 2 and a message naming the flag.
func TestReportRefusesBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run-1", "--format", "pdf"}, `--format "pdf": want html, svg or png`},
		{[]string{"run-1", "--format", "png"}, "--format png writes one chart: name it with --metric (a metric such as eval.score, or step-durations)"},
		{[]string{"run-1", "--metric", "eval.score"}, "--metric eval.score needs --format svg or png: the HTML report has every chart"},
	} {
		root := newRoot()
		root.SetArgs(append([]string{"report", "--address", "127.0.0.1:1"}, tc.args...))
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		err := root.ExecuteContext(context.Background())
		require.Error(t, err, tc.args)
		var ee *exitError
		require.ErrorAs(t, err, &ee)
		assert.Equal(t, 2, ee.code, tc.args)
		assert.Equal(t, tc.want, err.Error())
	}
}

func TestDefaultReportPath(t *testing.T) {
	for _, tc := range []struct{ id, metric, format, want string }{
		{"rlhf-demo-20260501-ab12", "", "html", "report-rlhf-demo-20260501-ab12.html"},
		{"rlhf-demo-1", "eval.score", "png", "report-rlhf-demo-1-eval.score.png"},
		{"../team a/run 1", "", "html", "report-.._team_a_run_1.html"},
	} {
		assert.Equal(t, tc.want, defaultReportPath(tc.id, tc.metric, tc.format), tc.id)
	}
}
