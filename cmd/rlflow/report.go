package main

import (
	"bytes"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/rlflow/rlflow/codec"
	"github.com/rlflow/rlflow/report"
	"github.com/spf13/cobra"
	"go.temporal.io/sdk/client"
)

func newReportCmd(g *globalFlags) *cobra.Command {
	var format, metric, out string
	cmd := &cobra.Command{
		Use:   "report RUN_ID",
		Short: "Write a run's report: an HTML page with a chart of every metric per iteration, step durations, failures and retries",
		Long: `Report reads a pipeline run's history from Temporal (every iteration, across
continue-as-new; no worker is needed, closed runs too) and writes one
self-contained HTML page: a chart of each numeric step output per iteration
(eval.score, train.loss, ...), the step durations of each iteration, failed
iterations and retried steps marked, and tables of the numbers.

With --format svg or png it writes one chart instead: --metric names it
(a metric such as eval.score, or ` + report.DurationsChart + `).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id := args[0]
			if format != "html" && !slices.Contains(report.Formats, format) {
				return &exitError{code: 2, err: fmt.Errorf("--format %q: want html, %s", format, strings.Join(report.Formats, " or "))}
			}
			if format != "html" && metric == "" {
				return &exitError{code: 2, err: fmt.Errorf("--format %s writes one chart: name it with --metric (a metric such as eval.score, or %s)", format, report.DurationsChart)}
			}
			if format == "html" && metric != "" {
				return &exitError{code: 2, err: fmt.Errorf("--metric %s needs --format svg or png: the HTML report has every chart", metric)}
			}
			dc, err := codec.FromEnv(os.Getenv)
			if err != nil {
				return &exitError{code: 1, err: err}
			}
			return g.withClient(cmd.Context(), func(c client.Client) error {
				run, err := report.Collect(cmd.Context(), c, id, dc)
				if err != nil {
					return &exitError{code: 1, err: err}
				}
				var b bytes.Buffer
				if format == "html" {
					err = run.WriteHTML(&b, time.Now())
				} else {
					err = run.WriteChart(&b, metric, format)
				}
				if err != nil {
					return &exitError{code: 1, err: err}
				}
				path := out
				if path == "" {
					path = defaultReportPath(id, metric, format)
				}
				if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
					return &exitError{code: 1, err: fmt.Errorf("writing the report: %w", err)}
				}
				fmt.Fprintf(cmd.OutOrStdout(), "wrote %s (%d iterations, %d runs)\n", path, len(run.Iterations), len(run.RunIDs))
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&format, "format", "html", "html (the whole report), svg or png (one chart, named by --metric)")
	f.StringVar(&metric, "metric", "", "the chart --format svg|png writes: a metric (eval.score) or "+report.DurationsChart)
	f.StringVar(&out, "out", "", "file to write (default: report-<run id>.html, or report-<run id>-<metric>.<format>)")
	return cmd
}

var unsafeFileChars = regexp.MustCompile(`[^A-Za-z0-9._-]+`)

// defaultReportPath names the report after the run (and chart), in the
// working directory; a workflow id may hold any character, a file name not.
func defaultReportPath(id, metric, format string) string {
	name := "report-" + id
	if metric != "" {
		name += "-" + metric
	}
	return unsafeFileChars.ReplaceAllString(name, "_") + "." + format
}
