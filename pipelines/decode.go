package pipelines

import (
	"fmt"
	"net/url"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

var (
	nameRe    = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]*$`)
	stepIDRe  = regexp.MustCompile(`^[a-z][a-z0-9_-]*$`)
	identRe   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	envNameRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

var topKeys = []string{"version", "name", "description", "base_dir", "params", "servers", "weight_transfer", "loop", "max_parallel", "defaults", "steps"}

func (l *loader) pipeline(root *yaml.Node) *Pipeline {
	m := l.mapping(root, "", topKeys...)
	p := &Pipeline{}
	if n, ok := m["version"]; !ok {
		l.addf(root, "version", "required (set version: 1)")
	} else if v, ok := l.integer(n, "version"); ok && v != SchemaVersion {
		l.addf(n, "version", "unsupported version %d (this rlflow reads version %d)", v, SchemaVersion)
	} else {
		p.Version = v
	}
	if n, ok := m["name"]; !ok {
		l.addf(root, "name", "required")
	} else if s, ok := l.str(n, "name"); ok {
		if !nameRe.MatchString(s) || len(s) > 100 {
			l.addf(n, "name", "%q must match [a-z0-9][a-z0-9_.-]* and be at most 100 characters", s)
		}
		p.Name = s
	}
	if n, ok := m["description"]; ok {
		p.Description, _ = l.str(n, "description")
	}
	if n, ok := m["base_dir"]; ok {
		if s, ok := l.str(n, "base_dir"); ok {
			if !filepath.IsAbs(s) {
				l.addf(n, "base_dir", "%q must be an absolute path", s)
			}
			p.BaseDir = s
		}
	}
	if n, ok := m["params"]; ok {
		p.Params = l.params(n)
	}
	if n, ok := m["servers"]; ok {
		p.Servers = l.servers(n)
	}
	if n, ok := m["weight_transfer"]; ok {
		p.WeightTransfer = l.weightTransfer(n)
	}
	if n, ok := m["loop"]; ok {
		p.Loop = l.loop(n)
	} else {
		p.Loop.Iterations = 1
	}
	if n, ok := m["max_parallel"]; ok {
		if v, ok := l.integer(n, "max_parallel"); ok {
			if v < 0 {
				l.addf(n, "max_parallel", "must be >= 0 (0 = unbounded)")
			}
			p.MaxParallel = v
		}
	}
	if n, ok := m["defaults"]; ok {
		dm := l.mapping(n, "defaults", "timeout", "heartbeat", "retry", "task_queue")
		if v, ok := dm["timeout"]; ok {
			p.Defaults.Timeout, _ = l.duration(v, "defaults.timeout")
		}
		if v, ok := dm["heartbeat"]; ok {
			p.Defaults.Heartbeat, _ = l.duration(v, "defaults.heartbeat")
		}
		if v, ok := dm["retry"]; ok {
			p.Defaults.Retry = l.retry(v, "defaults.retry")
		}
		if v, ok := dm["task_queue"]; ok {
			p.Defaults.TaskQueue, _ = l.str(v, "defaults.task_queue")
		}
	}
	n, ok := m["steps"]
	if !ok {
		l.addf(root, "steps", "required: a non-empty list of steps")
		return p
	}
	if n.Kind != yaml.SequenceNode || len(n.Content) == 0 {
		l.addf(n, "steps", "want a non-empty list of steps, got %s", kindName(n))
		return p
	}
	for i, sn := range n.Content {
		p.Steps = append(p.Steps, l.step(sn, fmt.Sprintf("steps[%d]", i)))
	}
	return p
}

func (l *loader) params(n *yaml.Node) []Param {
	m := l.mapping(n, "params")
	if m == nil {
		return nil
	}
	var out []Param
	for i := 0; i+1 < len(n.Content); i += 2 {
		name := n.Content[i].Value
		v, ok := m[name]
		if !ok {
			continue
		}
		field := "params." + name
		if !identRe.MatchString(name) {
			l.addf(n.Content[i], field, "param name must match [A-Za-z_][A-Za-z0-9_]*")
		}
		pm := l.mapping(v, field, "type", "default", "required", "description")
		if pm == nil {
			continue
		}
		p := Param{Name: name}
		if t, ok := pm["type"]; !ok {
			l.addf(v, field+".type", "required: string, int, float, bool or duration")
		} else if s, ok := l.str(t, field+".type"); ok {
			switch ParamType(s) {
			case ParamString, ParamInt, ParamFloat, ParamBool, ParamDuration:
				p.Type = ParamType(s)
			default:
				l.addf(t, field+".type", "unknown type %q (want string, int, float, bool or duration)", s)
			}
		}
		if r, ok := pm["required"]; ok {
			p.Required, _ = l.boolean(r, field+".required")
		}
		if d, ok := pm["description"]; ok {
			p.Description, _ = l.str(d, field+".description")
		}
		if d, ok := pm["default"]; ok {
			if p.Required {
				l.addf(d, field+".default", "a required param cannot have a default")
			}
			if p.Type != "" {
				if d.Kind != yaml.ScalarNode {
					l.addf(d, field+".default", "want a %s, got %s", p.Type, kindName(d))
				} else if val, err := coerceParam(p.Type, d.Value, d.Tag); err != nil {
					l.addf(d, field+".default", "%v", err)
				} else {
					p.Default = val
				}
			}
		}
		out = append(out, p)
	}
	return out
}

// coerceParam converts a textual value to a param's type.
func coerceParam(t ParamType, s, tag string) (any, error) {
	switch t {
	case ParamString:
		if tag != "" && tag != "!!str" {
			return nil, fmt.Errorf("want a string, got %s (quote it)", s)
		}
		return s, nil
	case ParamInt:
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("want an int, got %q", s)
		}
		return v, nil
	case ParamFloat:
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return nil, fmt.Errorf("want a float, got %q", s)
		}
		return v, nil
	case ParamBool:
		v, err := strconv.ParseBool(s)
		if err != nil {
			return nil, fmt.Errorf("want true or false, got %q", s)
		}
		return v, nil
	case ParamDuration:
		if _, err := ParseDuration(s); err != nil {
			return nil, err
		}
		return s, nil
	}
	return nil, fmt.Errorf("unknown type %q", t)
}

func (l *loader) servers(n *yaml.Node) []Server {
	if n.Kind != yaml.SequenceNode {
		l.addf(n, "servers", "want a list, got %s", kindName(n))
		return nil
	}
	var out []Server
	for i, sn := range n.Content {
		field := fmt.Sprintf("servers[%d]", i)
		m := l.mapping(sn, field, "url", "api_key_env", "api")
		if m == nil {
			continue
		}
		var s Server
		if u, ok := m["url"]; !ok {
			l.addf(sn, field+".url", "required")
		} else if v, ok := l.str(u, field+".url"); ok {
			pu, err := url.Parse(v)
			if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
				l.addf(u, field+".url", "%q is not an http(s) URL", v)
			}
			s.URL = strings.TrimRight(v, "/")
		}
		if k, ok := m["api_key_env"]; ok {
			if v, ok := l.str(k, field+".api_key_env"); ok {
				if !envNameRe.MatchString(v) {
					l.addf(k, field+".api_key_env", "%q is not an environment variable name (name the variable, never the key itself)", v)
				}
				s.APIKeyEnv = v
			}
		}
		if a, ok := m["api"]; ok {
			if v, ok := l.str(a, field+".api"); ok {
				if !contains([]string{"A", "B", "C", "D"}, v) {
					l.addf(a, field+".api", "unknown API generation %q (want A, B, C or D)", v)
				}
				s.API = v
			}
		}
		out = append(out, s)
	}
	return out
}

var sizeRe = regexp.MustCompile(`^(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?$`)

func parseSize(s string) (int64, bool) {
	m := sizeRe.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil {
		return 0, false
	}
	mult := map[string]int64{"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}[m[2]]
	if v > (1<<62)/mult {
		return 0, false
	}
	return v * mult, true
}

func (l *loader) weightTransfer(n *yaml.Node) *WeightTransfer {
	m := l.mapping(n, "weight_transfer", "backend", "packed", "buffer_bytes", "num_buffers")
	if m == nil {
		return nil
	}
	wt := &WeightTransfer{}
	if b, ok := m["backend"]; !ok {
		l.addf(n, "weight_transfer.backend", "required: nccl or disk")
	} else if v, ok := l.str(b, "weight_transfer.backend"); ok {
		if v != "nccl" && v != "disk" {
			l.addf(b, "weight_transfer.backend", "unknown backend %q (want nccl or disk)", v)
		}
		wt.Backend = v
	}
	if v, ok := m["packed"]; ok {
		wt.Packed, _ = l.boolean(v, "weight_transfer.packed")
	}
	if v, ok := m["buffer_bytes"]; ok {
		if size, ok := parseSize(v.Value); ok && v.Kind == yaml.ScalarNode && size > 0 {
			wt.BufferBytes = size
		} else {
			l.addf(v, "weight_transfer.buffer_bytes", "want a positive size like 1GiB or 268435456, got %s", kindName(v))
		}
	}
	if v, ok := m["num_buffers"]; ok {
		if k, ok := l.integer(v, "weight_transfer.num_buffers"); ok {
			if k < 1 {
				l.addf(v, "weight_transfer.num_buffers", "must be >= 1")
			}
			wt.NumBuffers = k
		}
	}
	return wt
}

func (l *loader) loop(n *yaml.Node) Loop {
	m := l.mapping(n, "loop", "iterations", "until", "max_iterations", "continue_as_new_every")
	var lp Loop
	if m == nil {
		return lp
	}
	if v, ok := m["iterations"]; ok {
		if k, ok := l.integer(v, "loop.iterations"); ok {
			if k < 1 {
				l.addf(v, "loop.iterations", "must be >= 1")
			}
			lp.Iterations = k
		}
	}
	if v, ok := m["until"]; ok {
		lp.Until, _ = l.str(v, "loop.until")
		if _, both := m["iterations"]; both {
			l.addf(v, "loop.until", "give either iterations or until (with max_iterations), not both")
		}
		if _, ok := m["max_iterations"]; !ok {
			l.addf(v, "loop.max_iterations", "required with until, so a loop that never converges still ends")
		}
	}
	if v, ok := m["max_iterations"]; ok {
		if k, ok := l.integer(v, "loop.max_iterations"); ok {
			if k < 1 {
				l.addf(v, "loop.max_iterations", "must be >= 1")
			}
			lp.MaxIterations = k
		}
		if _, ok := m["until"]; !ok {
			l.addf(v, "loop.max_iterations", "only meaningful with until; use iterations for a fixed count")
		}
	}
	if v, ok := m["continue_as_new_every"]; ok {
		if k, ok := l.integer(v, "loop.continue_as_new_every"); ok {
			if k < 1 {
				l.addf(v, "loop.continue_as_new_every", "must be >= 1")
			}
			lp.ContinueAsNewEvery = k
		}
	}
	if lp.Iterations == 0 && lp.Until == "" {
		lp.Iterations = 1
	}
	return lp
}

func (l *loader) retry(n *yaml.Node, field string) *RetryPolicy {
	m := l.mapping(n, field, "max_attempts", "initial_interval", "backoff", "max_interval", "non_retryable")
	if m == nil {
		return nil
	}
	r := &RetryPolicy{}
	if v, ok := m["max_attempts"]; ok {
		if k, ok := l.integer(v, field+".max_attempts"); ok {
			if k < 0 {
				l.addf(v, field+".max_attempts", "must be >= 0 (0 = unlimited, 1 = no retry)")
			}
			r.MaxAttempts = k
		}
	}
	if v, ok := m["initial_interval"]; ok {
		r.InitialInterval, _ = l.duration(v, field+".initial_interval")
	}
	if v, ok := m["backoff"]; ok {
		if f, ok := l.float(v, field+".backoff"); ok {
			if f < 1 {
				l.addf(v, field+".backoff", "must be >= 1")
			}
			r.Backoff = f
		}
	}
	if v, ok := m["max_interval"]; ok {
		r.MaxInterval, _ = l.duration(v, field+".max_interval")
		if r.InitialInterval > 0 && r.MaxInterval > 0 && r.MaxInterval < r.InitialInterval {
			l.addf(v, field+".max_interval", "%s is shorter than initial_interval %s", r.MaxInterval, r.InitialInterval)
		}
	}
	if v, ok := m["non_retryable"]; ok {
		r.NonRetryable = l.strList(v, field+".non_retryable")
	}
	return r
}

var stepKeys = []string{"id", "uses", "needs", "with", "when", "always", "outputs", "retry", "timeout", "heartbeat", "task_queue"}

func (l *loader) step(n *yaml.Node, field string) Step {
	var s Step
	m := l.mapping(n, field, stepKeys...)
	if m == nil {
		return s
	}
	if v, ok := m["id"]; !ok {
		l.addf(n, field+".id", "required")
	} else if id, ok := l.str(v, field+".id"); ok {
		if !stepIDRe.MatchString(id) {
			l.addf(v, field+".id", "%q must match [a-z][a-z0-9_-]*", id)
		}
		s.ID = id
	}
	if v, ok := m["uses"]; !ok {
		l.addf(n, field+".uses", "required: one of %s", strings.Join(StepTypeNames(), ", "))
	} else if u, ok := l.str(v, field+".uses"); ok {
		s.Uses = u
		if _, ok := LookupStepType(u); !ok {
			l.addf(v, field+".uses", "unknown step type%s", suggest(u, StepTypeNames()))
		}
	}
	if v, ok := m["needs"]; ok {
		s.Needs = l.strList(v, field+".needs")
	}
	if v, ok := m["with"]; ok {
		if w, ok := l.value(v, field+".with").(map[string]any); ok {
			s.With = w
		} else {
			l.addf(v, field+".with", "want a mapping, got %s", kindName(v))
		}
	}
	if v, ok := m["when"]; ok {
		s.When, _ = l.str(v, field+".when")
	}
	if v, ok := m["always"]; ok {
		s.Always, _ = l.boolean(v, field+".always")
	}
	if v, ok := m["outputs"]; ok {
		s.Outputs = l.strList(v, field+".outputs")
	}
	if v, ok := m["retry"]; ok {
		s.Retry = l.retry(v, field+".retry")
	}
	if v, ok := m["timeout"]; ok {
		s.Timeout, _ = l.duration(v, field+".timeout")
	}
	if v, ok := m["heartbeat"]; ok {
		s.Heartbeat, _ = l.duration(v, field+".heartbeat")
	}
	if v, ok := m["task_queue"]; ok {
		s.TaskQueue, _ = l.str(v, field+".task_queue")
	}
	return s
}
