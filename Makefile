# The two commands a new user runs (see README):
#   make demo   run the example pipeline on a local Temporal dev server + UI
#   make test   run every test
GO        ?= go
TEMPORAL  := bin/temporal
RLFLOW    := bin/rlflow
TEMPORAL_CLI := github.com/temporalio/cli/cmd/temporal@v1.5.1
STATICCHECK   := bin/staticcheck
WORKFLOWCHECK := bin/workflowcheck

.PHONY: demo test lint build vet fuzz bench bench-generate compose-check clean gpu-carry

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

test: $(TEMPORAL)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -count=1 -timeout 30m ./...

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

# Orchestration overhead on the dev server, against in-process baselines.
bench: $(TEMPORAL)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -run '^$$' -bench . -benchtime 1x -timeout 20m ./bench/

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
