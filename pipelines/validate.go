package pipelines

import (
	"fmt"
	"net/url"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// check runs the semantic checks that need more than one field at a time,
// after decoding. It reports at the recorded node of each path.
func (l *loader) check(path string) {
	p := l.p
	if _, ok := l.pos["version"]; ok && !l.bad["version"] && p.Version != SchemaVersion {
		l.errPath("version", "unsupported version %d (this build reads version %d)", p.Version, SchemaVersion)
	}
	if p.BaseDir == "" {
		p.BaseDir = defaultBaseDir(path)
	} else if !filepath.IsAbs(p.BaseDir) {
		l.errPath("base_dir", "must be an absolute path, got %q (a file's base_dir defaults to its directory)", clip(p.BaseDir))
	}
	for i, s := range p.Servers {
		l.checkServer(s, indexPath("servers", i))
	}
	l.checkLoop()
	l.checkRetry(p.Defaults.Retry, "defaults.retry", DefaultMaxAttempts)
	l.checkTimeouts(p.Defaults.Timeout, p.Defaults.Heartbeat, "defaults")
	if len(p.Steps) > MaxSteps {
		l.errPath("steps", "too many steps: %d, the limit is %d", len(p.Steps), MaxSteps)
		return
	}
	l.checkSteps()
	l.checkWeightTransfer()
	l.checkTrainer()
	l.checkCycles()
	l.checkExprs()
	l.checkMetrics()
}

// checkMetrics checks that metrics.headline names a declared step and an
// output that step produces, as a `${{ steps.X.outputs.Y }}` reference must.
func (l *loader) checkMetrics() {
	stepID, key, ok := l.p.HeadlineRef()
	if !ok || l.bad["metrics.headline"] {
		return
	}
	st, found := l.p.StepByID(stepID)
	if !found {
		ids := make([]string, 0, len(l.p.Steps))
		for _, s := range l.p.Steps {
			ids = append(ids, s.ID)
		}
		l.errPath("metrics.headline", "unknown step %q%s", clip(stepID), didYouMean(stepID, ids))
		return
	}
	t, known := LookupStepType(st.Uses)
	if !known {
		return // steps[].uses reports it
	}
	outs := t.OutputsOf(st)
	if contains(outs, key) {
		return
	}
	have := "it has no outputs"
	if len(outs) > 0 {
		have = "outputs: " + joinNames(outs)
	}
	if c := suggest(key, outs); c != "" {
		have = fmt.Sprintf("did you mean %q? %s", c, have)
	} else if t.DeclaredOutputs {
		have += "; declare it in the step's outputs"
	}
	l.errPath("metrics.headline", "step %q has no output %q (%s)", stepID, clip(key), have)
}

func (l *loader) checkServer(s Server, path string) {
	if s.URL == "" {
		return
	}
	if strings.Contains(s.URL, "${{") {
		// Checked once params are known (Pipeline.ServersFor), so that one
		// file serves any vLLM address given at launch.
		l.checkTemplate(s.URL, path+".url", exprScope{paramsOnly: true})
		return
	}
	if err := checkServerURL(s.URL); err != nil {
		l.errPath(path+".url", "%v", err)
	}
}

// checkServerURL accepts absolute http(s) URLs with a host.
func checkServerURL(s string) error {
	u, err := url.Parse(s)
	switch {
	case err != nil:
		return fmt.Errorf("invalid URL %q: %v", clip(s), unwrapURLError(err))
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("URL %q must start with http:// or https://", clip(s))
	case u.Host == "":
		return fmt.Errorf("URL %q has no host", clip(s))
	}
	return nil
}

// ServersFor returns the servers with their URLs rendered from the launch
// params (servers[].url may hold ${{ params.* }} expressions), each checked
// as Load checks a literal URL. It is pure, so workflow code may call it.
func (p *Pipeline) ServersFor(params map[string]any) ([]Server, error) {
	if len(p.Servers) == 0 {
		return nil, nil
	}
	out := make([]Server, len(p.Servers))
	for i, s := range p.Servers {
		v, err := RenderString(s.URL, Env{Params: params})
		if err != nil {
			return nil, fmt.Errorf("servers[%d].url: %w", i, err)
		}
		u, ok := v.(string)
		if !ok {
			return nil, fmt.Errorf("servers[%d].url: %q renders to %T, not a string", i, clip(s.URL), v)
		}
		if err := checkServerURL(u); err != nil {
			return nil, fmt.Errorf("servers[%d].url: %w", i, err)
		}
		s.URL = u
		out[i] = s
	}
	return out, nil
}

func unwrapURLError(err error) error {
	if ue, ok := err.(*url.Error); ok {
		return ue.Err
	}
	return err
}

// MinGPUStartTimeout bounds weight_transfer.gpu_start_timeout from below: a
// shorter wait would take a live but busy GPU worker for dead.
const MinGPUStartTimeout = Duration(time.Second)

// checkWeightTransfer checks the GPU routing settings: they only mean
// something for the backends that run on a GPU worker, and a GPU step's
// queue is chosen by the interpreter (the acquired worker's), never by the
// file. The ipc backend takes neither the NCCL settings nor checkpoints.
func (l *loader) checkWeightTransfer() {
	wt := l.p.WeightTransfer
	if wt == nil {
		return
	}
	if !wt.OnGPUWorker() {
		for _, f := range []string{"gpu_task_queue", "gpu_start_timeout"} {
			if _, ok := l.pos["weight_transfer."+f]; ok {
				l.errPath("weight_transfer."+f, "only applies to backends nccl and ipc, not %q", wt.Backend)
			}
		}
		return
	}
	if wt.Backend == BackendIPC {
		l.checkIPC()
	}
	if _, ok := l.pos["weight_transfer.gpu_start_timeout"]; ok && !l.bad["weight_transfer.gpu_start_timeout"] && wt.GPUStartTimeout < MinGPUStartTimeout {
		l.errPath("weight_transfer.gpu_start_timeout", "must be at least %s, got %s: a shorter wait takes a busy GPU worker for dead", MinGPUStartTimeout, wt.GPUStartTimeout)
	}
	for i, s := range l.p.Steps {
		if s.TaskQueue != "" && slices.Contains(GPUStepTypes, s.Uses) {
			l.errPath(indexPath("steps", i)+".task_queue", "%s steps run on the GPU worker acquired for them with backend %s; remove task_queue (set weight_transfer.gpu_task_queue to choose the GPU pool)", s.Uses, wt.Backend)
		}
	}
}

// checkTrainer checks what the schema cannot: the trainer runs on the GPU
// worker, which only nccl pipelines acquire, and its secrets are names of
// the worker's variables, listed once and not also set in env.
func (l *loader) checkTrainer() {
	tr := l.p.Trainer
	if tr == nil {
		return
	}
	if !l.p.WeightTransfer.OnGPUWorker() {
		l.errPath("trainer", "a resident trainer runs on the GPU worker, which only pipelines with weight_transfer: {backend: nccl} or {backend: ipc} use")
	}
	if !l.bad["trainer.secrets"] && len(tr.Secrets) > 0 {
		env := map[string]string{}
		for k := range tr.Env {
			env[k] = ""
		}
		if err := CheckExecSecrets(tr.Secrets, env); err != nil {
			l.errPath("trainer.secrets", "%v", err)
		}
	}
}

// checkIPC checks a pipeline of the ipc backend: vLLM opens CUDA IPC
// handles of the resident trainer's snapshot, one per tensor, so there is
// a trainer, nothing NCCL-specific is set, and no step sends a checkpoint.
func (l *loader) checkIPC() {
	if l.p.Trainer == nil && !l.bad["trainer"] {
		l.errPath("weight_transfer.backend", "ipc hands vLLM CUDA IPC handles of the resident trainer's GPU memory: it needs a trainer: section (trainer: {command: [...], checkpoint_dir: ...}) and publish steps")
	}
	for _, f := range []string{"packed", "buffer_bytes", "num_buffers", "rendezvous"} {
		if _, ok := l.pos["weight_transfer."+f]; ok {
			l.errPath("weight_transfer."+f, "applies to backend nccl only; vLLM's ipc backend takes one handle per tensor")
		}
	}
	for i, s := range l.p.Steps {
		if s.Uses == StepBroadcast {
			l.errPath(indexPath("steps", i)+".uses", "broadcast sends a checkpoint, which backend ipc cannot: it hands vLLM the resident trainer's GPU memory; use a publish step")
		}
	}
}

func (l *loader) checkLoop() {
	lp := &l.p.Loop
	_, hasIter := l.pos["loop.iterations"]
	_, hasMax := l.pos["loop.max_iterations"]
	switch {
	case lp.Until != "" && hasIter:
		l.errPath("loop.until", "until and iterations are mutually exclusive")
	case lp.Until != "" && !hasMax:
		l.errPath("loop.until", "until needs max_iterations, a bound on the iterations")
	case lp.Until == "" && hasMax:
		l.errPath("loop.max_iterations", "max_iterations only applies with until; use iterations for a fixed count")
	}
	if lp.Until == "" && lp.Iterations == 0 && !hasIter {
		lp.Iterations = 1
	}
}

// checkRetry checks a retry policy and fills in a max_attempts it leaves
// out with inherited: leaving the key out must not turn a step's retries
// unlimited, which an explicit 0 asks for (Temporal's meaning of 0).
func (l *loader) checkRetry(r *RetryPolicy, path string, inherited int) {
	if r == nil {
		return
	}
	if _, set := l.pos[path+".max_attempts"]; !set {
		r.MaxAttempts = inherited
	}
	if r.InitialInterval > 0 && r.MaxInterval > 0 && r.MaxInterval < r.InitialInterval {
		l.errPath(path+".max_interval", "max_interval %s is shorter than initial_interval %s", r.MaxInterval, r.InitialInterval)
	}
}

// checkTimeouts checks that a heartbeat timeout is shorter than the
// attempt timeout. path is the step's path, or "defaults"; a value the step
// does not set comes from the defaults.
func (l *loader) checkTimeouts(timeout, heartbeat Duration, path string) {
	if timeout == 0 || heartbeat == 0 || heartbeat < timeout {
		return
	}
	hbPath, toPath := path+".heartbeat", path+".timeout"
	if _, ok := l.pos[hbPath]; !ok {
		hbPath = "defaults.heartbeat"
	}
	if _, ok := l.pos[toPath]; !ok {
		toPath = "defaults.timeout"
	}
	at := hbPath
	if !strings.HasPrefix(at, path+".") {
		at = toPath
	}
	l.errPath(at, "heartbeat %s must be shorter than timeout %s", l.durationText(hbPath, path), l.durationText(toPath, path))
}

// durationText shows a duration as written, naming where it came from when
// that is not the step being checked.
func (l *loader) durationText(at, path string) string {
	text := ""
	if n := deref(l.pos[at]); n != nil {
		text = n.Value
	}
	if !strings.HasPrefix(at, path+".") {
		text += " (from " + at + ")"
	}
	return text
}

func (l *loader) checkSteps() {
	p := l.p
	first := map[string]int{}
	for i, s := range p.Steps {
		if s.ID == "" {
			continue
		}
		if j, dup := first[s.ID]; dup {
			line := 0
			if n := l.pos[indexPath("steps", j)+".id"]; n != nil {
				line = n.Line
			}
			l.errPath(indexPath("steps", i)+".id", "duplicate step id %q (first defined at line %d)", s.ID, line)
			continue
		}
		first[s.ID] = i
	}
	ids := make([]string, 0, len(first))
	for id := range first {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for i := range p.Steps {
		s := &p.Steps[i]
		path := indexPath("steps", i)
		t := l.checkUses(s, path)
		l.checkNeedsConfig(t, path)
		l.checkNeeds(s, path, first, ids)
		l.checkOutputs(s, t, path)
		if t != nil {
			l.checkWith(s, t, path)
		}
		inherited := DefaultMaxAttempts
		if p.Defaults.Retry != nil {
			inherited = p.Defaults.Retry.MaxAttempts
		}
		l.checkRetry(s.Retry, path+".retry", inherited)
		timeout, heartbeat := s.Timeout, s.Heartbeat
		if timeout == 0 {
			timeout = p.Defaults.Timeout
		}
		if heartbeat == 0 {
			heartbeat = p.Defaults.Heartbeat
		}
		if s.Timeout != 0 || s.Heartbeat != 0 {
			l.checkTimeouts(timeout, heartbeat, path)
		}
	}
}

func (l *loader) checkUses(s *Step, path string) *StepType {
	if s.Uses == "" {
		return nil
	}
	t, ok := LookupStepType(s.Uses)
	if !ok {
		names := StepTypeNames()
		hint := ""
		if c := suggest(s.Uses, names); c != "" {
			hint = fmt.Sprintf("did you mean %q? ", c)
		}
		l.errPath(path+".uses", "unknown step type %q (%sknown: %s)", clip(s.Uses), hint, joinNames(names))
		return nil
	}
	return t
}

// checkNeedsConfig reports a step whose type needs pipeline-level
// configuration (servers:, weight_transfer:) that the pipeline lacks.
func (l *loader) checkNeedsConfig(t *StepType, path string) {
	if t == nil {
		return
	}
	if t.NeedsServers && len(l.p.Servers) == 0 {
		l.errPath(path+".uses", "%s steps call the pipeline's vLLM servers, but it has no servers: (add servers: [{url: http://host:8000}])", t.Name)
	}
	if t.NeedsWeightTransfer && l.p.WeightTransfer == nil {
		l.errPath(path+".uses", "%s steps need the pipeline's weight_transfer: (add weight_transfer: {backend: nccl} or {backend: disk})", t.Name)
	}
	if t.NeedsTrainer && l.p.Trainer == nil {
		l.errPath(path+".uses", "%s steps call the pipeline's resident trainer, but it declares none (add trainer: {command: [...], checkpoint_dir: ...})", t.Name)
	}
}

func (l *loader) checkNeeds(s *Step, path string, first map[string]int, ids []string) {
	seen := map[string]bool{}
	for j, n := range s.Needs {
		p := indexPath(path+".needs", j)
		switch _, known := first[n]; {
		case n == "":
		case n == s.ID:
			l.errPath(p, "a step cannot need itself")
		case seen[n]:
			l.errPath(p, "%q is listed twice", clip(n))
		case !known:
			l.errPath(p, "unknown step %q%s", clip(n), didYouMean(n, ids))
		}
		seen[n] = true
	}
}

func (l *loader) checkOutputs(s *Step, t *StepType, path string) {
	if len(s.Outputs) == 0 || t == nil {
		return
	}
	if !t.DeclaredOutputs {
		var declaring []string
		for _, n := range StepTypeNames() {
			if st, _ := LookupStepType(n); st.DeclaredOutputs {
				declaring = append(declaring, n)
			}
		}
		fixed := "none"
		if len(t.Outputs) > 0 {
			fixed = joinNames(t.Outputs)
		}
		l.errPath(path+".outputs", "%s steps have fixed outputs (%s); outputs may only be declared for %s", t.Name, fixed, joinNames(declaring))
		return
	}
	l.uniqueStrings(s.Outputs, path+".outputs", "output")
	for j, o := range s.Outputs {
		if contains(t.Outputs, o) {
			l.errPath(indexPath(path+".outputs", j), "%q is already an output of every %s step", clip(o), t.Name)
		}
	}
}

func (t *StepType) argNames() []string {
	out := make([]string, len(t.Args))
	for i, a := range t.Args {
		out[i] = a.Name
	}
	return out
}

// checkWith validates a step's arguments against its type's ArgSpecs, then
// runs the type's own Validate hook if the kinds were right (hooks may
// assume them). Scalars given for string arguments are replaced by the
// text they were written as, so `env: {N: 4}` yields "4".
func (l *loader) checkWith(s *Step, t *StepType, path string) {
	wpath := path + ".with"
	before := len(l.errs)
	keys := make([]string, 0, len(s.With))
	for k := range s.With {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		p := joinPath(wpath, k)
		spec, ok := t.Arg(k)
		if !ok {
			hint := didYouMean(k, t.argNames())
			if hint == "" && len(t.Args) > 0 {
				hint = " (want " + joinNames(t.argNames()) + ")"
			} else if hint == "" {
				hint = " (it takes none)"
			}
			l.errNode(l.keys[p], p, "unknown argument %q for %s%s", clip(k), t.Name, hint)
			continue
		}
		if v, ok := l.checkArg(spec, s.With[k], p); ok {
			s.With[k] = v
		}
	}
	for _, a := range t.Args {
		if _, ok := s.With[a.Name]; a.Required && !ok {
			at := l.pos[wpath]
			if at == nil {
				at = l.pos[path]
			}
			l.errNode(at, joinPath(wpath, a.Name), "is required by %s", t.Name)
		}
	}
	if len(l.errs) != before || t.Validate == nil {
		return
	}
	for k, msg := range runValidate(t, s.With) {
		p := wpath
		if _, ok := s.With[k]; ok {
			p = joinPath(wpath, k)
		}
		l.errPath(p, "%s", msg)
	}
}

// runValidate calls a step type's hook, turning a panic (a bug in the hook
// met by unusual input) into a problem report.
func runValidate(t *StepType, with map[string]any) (problems map[string]string) {
	defer func() {
		if r := recover(); r != nil {
			problems = map[string]string{"": fmt.Sprintf("internal error validating %s arguments: %v", t.Name, r)}
		}
	}()
	if with == nil {
		with = map[string]any{}
	}
	return t.Validate(with)
}

// checkArg checks one argument against its spec and returns its value
// normalised (scalars of string kinds become their text, ints of float
// kinds floats). A value holding a ${{ }} expression is checked when it is
// rendered; literal values get the spec's full Check: range, enum, items.
func (l *loader) checkArg(a ArgSpec, v any, path string) (any, bool) {
	if l.bad[path] {
		return nil, false // its YAML was already reported
	}
	if s, ok := v.(string); ok && strings.Contains(s, "${{") {
		if isWholeExpr(s) {
			return v, true // typed when rendered; checked by the activity
		}
		switch a.Kind {
		case KindString, KindDuration:
			return v, true
		}
		l.errPath(path, "must be %s; text around ${{ }} makes it a string", kindWant(a.Kind))
		return nil, false
	}
	v, ok := l.argKind(a, v, path)
	if !ok {
		return nil, false
	}
	if a.Kind == KindObject && !l.exactInts(v, path) {
		return nil, false
	}
	if err := a.Check(v); err != nil {
		l.errPath(path, "%v", err)
		return nil, false
	}
	return v, true
}

// exactInts reports the integers inside a free-form value that the
// workflow would not read back exactly, and whether there were none.
func (l *loader) exactInts(v any, path string) bool {
	good := true
	switch x := v.(type) {
	case int64:
		if err := checkExactInt(x); err != nil {
			l.errPath(path, "%v; quote it to pass it as a string", err)
			return false
		}
	case []any:
		for i, e := range x {
			good = l.exactInts(e, indexPath(path, i)) && good
		}
	case map[string]any:
		for _, k := range sortedKeys(x) {
			good = l.exactInts(x[k], joinPath(path, k)) && good
		}
	}
	return good
}

// argKind checks one argument's kind, reporting a wrong one at the value
// (or list entry) as written, and returns the value normalised.
func (l *loader) argKind(a ArgSpec, v any, path string) (any, bool) {
	switch a.Kind {
	case KindString:
		s, ok := l.argText(v, path)
		if !ok {
			l.errPath(path, "must be a string, got %s", l.describeAt(path, v))
			return nil, false
		}
		return s, true
	case KindInt:
		if _, ok := v.(int64); ok {
			return v, true
		}
	case KindFloat:
		switch x := v.(type) {
		case float64:
			return x, true
		case int64:
			return float64(x), true
		}
	case KindBool:
		if _, ok := v.(bool); ok {
			return v, true
		}
	case KindDuration:
		if _, ok := v.(string); ok {
			return v, true // Check parses it
		}
	case KindStringList:
		list, ok := v.([]any)
		if !ok {
			break
		}
		good := true
		for i, e := range list {
			var ok bool
			list[i], ok = l.elementText(e, indexPath(path, i))
			good = good && ok
		}
		return list, good
	case KindStringMap:
		m, ok := v.(map[string]any)
		if !ok {
			break
		}
		good := true
		for k, e := range m {
			var ok bool
			m[k], ok = l.elementText(e, joinPath(path, k))
			good = good && ok
		}
		return m, good
	case KindObject:
		if _, ok := v.(map[string]any); ok {
			return v, true
		}
	default:
		return v, true // a kind added later: its type's Validate checks it
	}
	l.errPath(path, "must be %s, got %s", kindWant(a.Kind), l.describeAt(path, v))
	return nil, false
}

// elementText checks one element of a string list or map argument at
// path p: an expression, or an element whose YAML was already reported,
// stays as it is; any other scalar becomes the text written. It reports
// whether the element is good.
func (l *loader) elementText(e any, p string) (any, bool) {
	if s, isStr := e.(string); isStr && strings.Contains(s, "${{") || l.bad[p] {
		return e, !l.bad[p]
	}
	s, ok := l.argText(e, p)
	if !ok {
		l.errPath(p, "must be a string, got %s", l.describeAt(p, e))
		return e, false
	}
	return s, true
}

// describeAt describes a free-form value by its YAML node, which shows it
// as written (99999999999999999999, not 1e+20).
func (l *loader) describeAt(path string, v any) string {
	if n, ok := l.pos[path]; ok {
		return describe(n)
	}
	return describeValue(v)
}

// argText returns a scalar argument as the text written in the file.
func (l *loader) argText(v any, path string) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case int64, float64, bool:
		if n := deref(l.pos[path]); n != nil && n.Kind == yaml.ScalarNode {
			return n.Value, true
		}
		return fmt.Sprint(x), true
	}
	return "", false
}

func kindWant(k ArgKind) string {
	switch k {
	case KindString:
		return "a string"
	case KindInt:
		return "an integer"
	case KindFloat:
		return "a number"
	case KindBool:
		return "true or false"
	case KindDuration:
		return "a duration string like 30s"
	case KindStringList:
		return "a list of strings"
	case KindStringMap:
		return "a mapping of strings"
	case KindObject:
		return "a mapping"
	}
	return string(k)
}

func (l *loader) checkCycles() {
	for _, c := range l.p.cycles() {
		i := l.p.indexByID()[c.ids[0]]
		l.errPath(indexPath(indexPath("steps", i)+".needs", c.need), "dependency cycle: %s", strings.Join(c.ids, " -> "))
	}
}
