# rlflow: one static-ish binary (cgo for the NCCL dlopen bindings).
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN go build -trimpath -o /out/rlflow ./cmd/rlflow

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates python3 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/rlflow /usr/local/bin/rlflow
COPY pipelines /pipelines
ENTRYPOINT ["rlflow"]
CMD ["worker"]
