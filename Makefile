# The two commands a new user runs (see README):
#   make demo   run the example pipeline on a local Temporal dev server + UI
#   make test   run every test
GO        ?= go
TEMPORAL  := bin/temporal
RLFLOW    := bin/rlflow
TEMPORAL_CLI := github.com/temporalio/cli/cmd/temporal@v1.5.1

.PHONY: demo test build vet fuzz bench bench-generate compose-check clean

build: $(RLFLOW)

$(RLFLOW): FORCE
	$(GO) build -o $(RLFLOW) ./cmd/rlflow

# The Temporal CLI (dev server + web UI), built from the Go module proxy once.
$(TEMPORAL):
	@echo "building the Temporal CLI into ./bin (once, a few minutes)"
	GOBIN=$(CURDIR)/bin $(GO) install $(TEMPORAL_CLI)

demo: $(TEMPORAL) $(RLFLOW)
	$(RLFLOW) dev $(ARGS)

test: $(TEMPORAL)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -count=1 -timeout 30m ./...

vet:
	$(GO) vet ./...

# Two minutes per fuzz target (the acceptance run).
fuzz:
	$(GO) test -run XXX -fuzz FuzzLoad -fuzztime 2m ./pipelines/

# Orchestration overhead on the dev server, against in-process baselines.
bench: $(TEMPORAL)
	RLFLOW_TEMPORAL=$(CURDIR)/$(TEMPORAL) $(GO) test -run XXX -bench . -benchtime 1x -timeout 20m ./bench/

# The generate step against the vLLM double (50 ms per sequence, 256 slots):
# 2,000 prompts vs one-at-a-time calls and vs an ideal Go client. No Temporal.
bench-generate:
	$(GO) test -run XXX -bench Generate2000 -benchtime 1x -timeout 10m ./bench/

compose-check:
	docker-compose config -q

clean:
	rm -rf bin/rlflow .rlflow

FORCE:
