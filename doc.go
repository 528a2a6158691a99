// Package rlflow runs RLHF iterations as durable Temporal workflows; see
// README.md. This root package only holds repository-level tests.
package rlflow
