package testutil

import (
	"context"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/rlflow/rlflow/workflows"
	enumspb "go.temporal.io/api/enums/v1"
	namespacepb "go.temporal.io/api/namespace/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
)

// The shipped dynamic config names only keys the server knows, with values
// of their types: the server itself merely warns about anything else and
// runs on its defaults.
func TestShippedDynamicConfigIsValid(t *testing.T) {
	server, _ := TemporalServerBinaries(t)
	file := RepoFile(t, ShippedDynamicConfig)
	out, err := exec.Command(server, "validate-dynamic-config", file).CombinedOutput()
	if err != nil {
		t.Fatalf("validate-dynamic-config: %v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != file {
		t.Errorf("validate-dynamic-config %s found problems:\n%s", ShippedDynamicConfig, out)
	}
}

// A cluster, in one process or four, serves the default namespace with
// rlflow's search attributes, goes away on Down (connections refused),
// comes back on Up at the same address, and rides out a PostgreSQL restart.
func TestCluster(t *testing.T) {
	for _, tc := range []struct {
		name  string
		split bool
	}{{"all-in-one", false}, {"split", true}} {
		t.Run(tc.name, func(t *testing.T) {
			c := StartCluster(t, ClusterOptions{Split: tc.split})
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cl, err := client.NewLazyClient(client.Options{HostPort: c.Address, Namespace: "default", Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			sa, err := cl.OperatorService().ListSearchAttributes(ctx, &operatorservice.ListSearchAttributesRequest{Namespace: "default"})
			if err != nil {
				t.Fatal(err)
			}
			for name, typ := range workflows.SearchAttributeTypes {
				if got := sa.GetCustomAttributes()[name]; int32(got) != enumspb.IndexedValueType_shorthandValue[typ] {
					t.Errorf("search attribute %s: %v, want %s", name, got, typ)
				}
			}

			c.Down()
			if conn, err := net.DialTimeout("tcp", c.Address, time.Second); err == nil {
				conn.Close()
				t.Fatalf("the frontend at %s accepts connections after Down", c.Address)
			}
			c.Up()
			// The client's connection backs off while it is refused;
			// it reconnects within its backoff.
			Eventually(t, 30*time.Second, "the old client to reach the cluster again", func() bool {
				return ready(ctx, cl, true) == nil
			})

			c.Postgres.Stop()
			c.Postgres.Start()
			// The server reconnects on its own; a namespace update
			// writes to the database.
			Eventually(t, time.Minute, "a namespace update after the PostgreSQL restart", func() bool {
				uctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				_, err := cl.WorkflowService().UpdateNamespace(uctx, &workflowservice.UpdateNamespaceRequest{
					Namespace: "default", UpdateInfo: &namespacepb.UpdateNamespaceInfo{Description: "after a PostgreSQL restart"}})
				return err == nil
			})
		})
	}
}
