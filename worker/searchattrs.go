package worker

import (
	"context"
	"fmt"
	"sort"

	"github.com/rlflow/rlflow/workflows"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
)

// searchAttributeCheck implements workflows.SearchAttributesActivity with
// the worker's own client: a workflow cannot ask the server, and upserting
// an attribute the namespace lacks would fail the run's workflow task.
type searchAttributeCheck struct{ c client.Client }

// Registered lists those of rlflow's search attributes that the run's
// namespace has registered with rlflow's type, sorted.
func (s searchAttributeCheck) Registered(ctx context.Context) ([]string, error) {
	ns := activity.GetInfo(ctx).Namespace
	resp, err := s.c.OperatorService().ListSearchAttributes(ctx, &operatorservice.ListSearchAttributesRequest{Namespace: ns})
	if err != nil {
		return nil, fmt.Errorf("listing the search attributes of namespace %q: %w", ns, err)
	}
	var names []string
	for name, typ := range workflows.SearchAttributeTypes {
		want, known := enumspb.IndexedValueType_shorthandValue[typ]
		if t, ok := resp.GetCustomAttributes()[name]; ok && known && int32(t) == want {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	return names, nil
}
