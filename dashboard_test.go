package rlflow_test

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/rlflow/rlflow/metrics"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// dashboard is the provisioned Grafana dashboard docker-compose.yml loads.
const dashboard = "deploy/grafana/dashboards/rlflow.json"

// TestDashboardQueriesNameExportedMetrics loads the dashboard and checks
// that every panel queries, and every query names only, metrics the
// workers export: rlflow's own as the metrics package registers them (a
// histogram's _bucket, _sum and _count series included).
func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	b, err := os.ReadFile(dashboard)
	require.NoError(t, err)
	var d struct {
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query struct {
					Query string `json:"query"`
				} `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(b, &d), dashboard)
	require.NotEmpty(t, d.UID)
	require.NotEmpty(t, d.Panels, "%s has no panels", dashboard)

	exported := map[string]bool{}
	for _, n := range metrics.New().Names() {
		for _, s := range []string{"", "_bucket", "_sum", "_count"} {
			exported[n+s] = true
		}
	}
	check := func(where, expr string) {
		names := promqlMetricNames(expr)
		assert.NotEmpty(t, names, "%s: %q names no metric", where, expr)
		for _, n := range names {
			assert.True(t, exported[n], "%s: %q: %s is not a metric rlflow exports (metrics.Metrics.Names)", where, expr, n)
		}
	}
	for _, p := range d.Panels {
		assert.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		for _, tg := range p.Targets {
			check("panel "+p.Title, tg.Expr)
		}
	}
	for _, v := range d.Templating.List {
		check("variable "+v.Name, v.Query.Query)
	}
}

var (
	promqlStrings   = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	promqlMatchers  = regexp.MustCompile(`\{[^}]*\}|\[[^\]]*\]`)
	promqlGrouping  = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promqlNumbers   = regexp.MustCompile(`\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|s|m|h|d|w|y)?\b`)
	promqlIdent     = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?`)
	promqlKeywords  = []string{"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
	labelValuesCall = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,`)
)

// promqlMetricNames are the metric names a PromQL expression (or a Grafana
// label_values(metric, label) query) selects: identifiers that are not
// functions, keywords, labels in matchers or groupings, or strings.
func promqlMetricNames(expr string) []string {
	if m := labelValuesCall.FindStringSubmatch(expr); m != nil {
		return []string{m[1]}
	}
	s := promqlStrings.ReplaceAllString(expr, `""`)
	s = promqlMatchers.ReplaceAllString(s, " ")
	s = promqlGrouping.ReplaceAllString(s, " ")
	s = promqlNumbers.ReplaceAllString(s, " ")
	var names []string
	for _, m := range promqlIdent.FindAllStringSubmatch(s, -1) {
		id := strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(m[0]), "("))
		if m[1] != "" || slices.Contains(promqlKeywords, id) {
			continue // a function call or a keyword
		}
		names = append(names, id)
	}
	return names
}

func TestPromqlMetricNames(t *testing.T) {
	for expr, want := range map[string][]string{
		`rlflow_step_output{run_id=~"$run", output="score"}`:                                              {"rlflow_step_output"},
		`histogram_quantile(0.5, sum by (le, step_type) (rate(rlflow_step_duration_seconds_bucket[5m])))`: {"rlflow_step_duration_seconds_bucket"},
		`count(max by (server) (rlflow_server_paused) == 1)`:                                              {"rlflow_server_paused"},
		`a / on (x) group_left b`:                   {"a", "b"},
		`label_values(rlflow_iteration, run_id)`:    {"rlflow_iteration"},
		`sum(rate(x{a="b}c"}[1m])) offset 5m / 1e9`: {"x"},
	} {
		assert.Equal(t, want, promqlMetricNames(expr), expr)
	}
}
