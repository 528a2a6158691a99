# The two commands a new user runs (see README):
#   make demo   run the example pipeline on a local Temporal dev server + UI
#   make test   run every test (the e2e suite on the dev server, then again on
#               a real Temporal cluster: make test-cluster)
GO        ?= go
TEMPORAL  := bin/temporal
RLFLOW    := bin/rlflow
TEMPORAL_CLI := github.com/temporalio/cli/cmd/temporal@v1.5.1
# The real Temporal server the cluster tests and `make bench` run, and the
# version docker-compose.yml's images must have (compose_test.go checks).
# Its module needs Go 1.26.10 or later: the go command fetches the
# toolchain below from the Go module proxy for this build only.
TEMPORAL_SERVER_VERSION   := v1.32.2
TEMPORAL_SERVER_TOOLCHAIN := go1.27.3
TEMPORAL_SERVER := bin/temporal-server
STATICCHECK   := bin/staticcheck
WORKFLOWCHECK := bin/workflowcheck

.PHONY: demo test test-cluster lint build vet fuzz bench bench-generate compose-check clean gpu-carry

build: $(RLFLOW)

$(RLFLOW): FORCE
	$(GO) build -o $(RLFLOW) ./cmd/rlflow

# The Temporal CLI (dev server + web UI), built from the Go module proxy once;
# -v lists each package as it is built, so the wait shows progress.
$(TEMPORAL):
	@echo "building the Temporal CLI ($(TEMPORAL_CLI)) into ./bin: once, a few minutes, one line per package built."
	@echo "(to skip it: make TEMPORAL=\$$(command -v temporal) demo, with a Temporal CLI 1.0.0 or later on PATH)"
	GOBIN=$(CURDIR)/bin $(GO) install -v $(TEMPORAL_CLI)

demo: $(TEMPORAL) $(RLFLOW)
	$(RLFLOW) dev $(ARGS)

test: $(TEMPORAL) $(TEMPORAL_SERVER)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -count=1 -timeout 30m ./...
	$(MAKE) --no-print-directory test-cluster

# The e2e suite on a real Temporal cluster (internal/testutil.StartCluster:
# the server built below, a private PostgreSQL from Debian's postgresql
# package, the shipped deploy/temporal/dynamicconfig.yaml): every test with
# all services in one process, then the kill and outage tests with
# frontend, history, matching and worker as four processes.
CLUSTER_SPLIT_TESTS := ^(TestWorkerSIGKILLDuringStep|TestExecWorkerSIGKILLKillsFirstAttempt|TestExecSurvivesTemporalOutage|TestCluster.*)$$
test-cluster: $(TEMPORAL) $(TEMPORAL_SERVER)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -count=1 -run '^(TestCluster|TestShippedDynamicConfigIsValid)$$' ./internal/testutil/
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) RLFLOW_TEST_TEMPORAL=cluster $(GO) test -count=1 -timeout 40m ./e2e/
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) RLFLOW_TEST_TEMPORAL=cluster-split $(GO) test -count=1 -timeout 20m -run '$(CLUSTER_SPLIT_TESTS)' ./e2e/

# The Temporal server and its SQL schema tool (go.temporal.io/server's
# cmd/server and cmd/tools/sql), built from the Go module proxy once and
# named as Temporal's images name them. Delete bin/temporal-server after
# changing TEMPORAL_SERVER_VERSION.
$(TEMPORAL_SERVER):
	@echo "building the Temporal server $(TEMPORAL_SERVER_VERSION) and its SQL schema tool into ./bin: once, several minutes."
	rm -rf bin/.temporal-server
	GOTOOLCHAIN=$(TEMPORAL_SERVER_TOOLCHAIN) GOBIN=$(CURDIR)/bin/.temporal-server $(GO) install \
		go.temporal.io/server/cmd/server@$(TEMPORAL_SERVER_VERSION) go.temporal.io/server/cmd/tools/sql@$(TEMPORAL_SERVER_VERSION)
	mv bin/.temporal-server/sql bin/temporal-sql-tool
	mv bin/.temporal-server/server $(TEMPORAL_SERVER)
	rmdir bin/.temporal-server

vet:
	$(GO) vet ./...

# The linters, pinned, built from the Go module proxy into ./bin once.
$(STATICCHECK):
	GOBIN=$(CURDIR)/bin $(GO) install honnef.co/go/tools/cmd/staticcheck@v0.8.2
$(WORKFLOWCHECK):
	GOBIN=$(CURDIR)/bin $(GO) install go.temporal.io/sdk/contrib/tools/workflowcheck@v0.6.0

# go vet, staticcheck, Temporal's determinism check of the interpreter, and
# the import rule (layers_test.go: imports point one way, and the control
# worker links nothing of NCCL).
lint: $(STATICCHECK) $(WORKFLOWCHECK)
	$(GO) vet ./...
	$(STATICCHECK) ./...
	$(WORKFLOWCHECK) -config workflows/workflowcheck.config.yaml ./workflows/...
	$(GO) test -count=1 -run '^(TestLayers|TestLayersTableIsCurrent|TestControlWorkerNeedsNoNCCL)$$' .

# Two minutes per fuzz target (the acceptance run).
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzLoad -fuzztime 2m ./pipelines/
	$(GO) test -run '^$$' -fuzz FuzzDecodeReply -fuzztime 2m ./trainer/
	$(GO) test -run '^$$' -fuzz FuzzReadIPCHandles -fuzztime 2m ./vllm/double/

# Orchestration overhead on the dev server and on a real cluster
# (PostgreSQL, the shipped dynamic config), each against in-process
# baselines of the same run; the table goes to bench/RESULTS.md's readers.
bench: $(TEMPORAL) $(TEMPORAL_SERVER)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -run '^$$' -bench . -benchtime 1x -timeout 60m ./bench/

# The generate step against the vLLM double (50 ms per sequence, 256 slots):
# 2,000 prompts vs one-at-a-time calls and vs an ideal Go client. No Temporal.
bench-generate:
	$(GO) test -run '^$$' -bench Generate2000 -benchtime 1x -timeout 10m ./bench/

compose-check:
	docker-compose config -q

# Everything one GPU-host run needs (tests/gpu/device-run.sh), stripped and
# xz-compressed into .carry/ (git-ignored): about 48 MB, under the 64 MiB a
# device run may carry. See nccl/GPU.md.
gpu-carry: $(TEMPORAL)
	mkdir -p .carry /tmp/rlflow-carry
	CGO_ENABLED=1 $(GO) test -c -ldflags='-s -w' -o /tmp/rlflow-carry/staging-gpu.test ./nccl/staging
	CGO_ENABLED=1 $(GO) test -c -ldflags='-s -w' -o /tmp/rlflow-carry/ncclengine.test ./transfer/ncclengine
	CGO_ENABLED=1 $(GO) test -c -ldflags='-s -w' -o /tmp/rlflow-carry/e2e.test ./e2e
	CGO_ENABLED=1 $(GO) build -ldflags='-s -w' -o /tmp/rlflow-carry/rlflow ./cmd/rlflow
	strip -o /tmp/rlflow-carry/temporal $(TEMPORAL)
	for b in staging-gpu.test ncclengine.test e2e.test rlflow temporal; do xz -T0 -6 -c /tmp/rlflow-carry/$$b > .carry/$$b.xz || exit 1; done
	du -cb .carry/*.xz

clean:
	rm -rf bin/rlflow .rlflow

FORCE:
