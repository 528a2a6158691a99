package pipelines

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestExamplesLoad(t *testing.T) {
	files, err := filepath.Glob("examples/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	for _, f := range files {
		p, err := LoadFile(f)
		require.NoError(t, err, f)
		_, err = p.ResolveParams(nil)
		require.NoError(t, err, f)
		_, err = p.Order()
		require.NoError(t, err, f)
	}
}

func TestLoadErrors(t *testing.T) {
	const head = "version: 1\nname: t\n"
	cases := []struct{ name, yaml, want string }{
		{"syntax", "version: 1\n  name: [\n", "x.yaml:2:1: yaml:"},
		{"not a mapping", "- a\n", "x.yaml:1:1: a pipeline must be a YAML mapping"},
		{"unknown top key", head + "stepz: []\n", `x.yaml:3:1: stepz: unknown key "stepz"`},
		{"missing version", "name: t\nsteps: [{id: a, uses: noop}]\n", "x.yaml:1:1: version: required"},
		{"bad version", "version: 2\nname: t\nsteps: [{id: a, uses: noop}]\n", "x.yaml:1:10: version: unsupported version 2"},
		{"no steps", head, "steps: required"},
		{"unknown uses", head + "steps:\n  - id: a\n    uses: exce\n", `x.yaml:5:11: steps[0].uses: unknown step type "exce" (did you mean "exec"?)`},
		{"duplicate id", head + "steps:\n  - {id: a, uses: noop}\n  - {id: a, uses: noop}\n", `x.yaml:5:10: steps[1].id: duplicate step id "a" (first defined at line 4)`},
		{"unknown need", head + "steps:\n  - {id: train, uses: noop}\n  - {id: b, uses: noop, needs: [trian]}\n", `steps[1].needs[0]: unknown step "trian" (did you mean "train"?)`},
		{"cycle", head + "steps:\n  - {id: a, uses: noop, needs: [c]}\n  - {id: b, uses: noop, needs: [a]}\n  - {id: c, uses: noop, needs: [b]}\n", "dependency cycle: a -> b -> c -> a"},
		{"bad duration", head + "defaults: {timeout: 5 minutes}\nsteps: [{id: a, uses: noop}]\n", `defaults.timeout: invalid duration "5 minutes"`},
		{"missing required arg", head + "steps:\n  - {id: a, uses: exec}\n", "steps[0].with.command: required by exec"},
		{"unknown arg", head + "steps:\n  - {id: a, uses: exec, with: {command: [ls], cmd: x}}\n", `steps[0].with.cmd: exec takes no argument "cmd"`},
		{"wrong arg kind", head + "steps:\n  - {id: a, uses: exec, with: {command: ls}}\n", "steps[0].with.command: want a list of strings"},
		{"not upstream", head + "steps:\n  - {id: a, uses: exec, outputs: [x], with: {command: [ls]}}\n  - {id: b, uses: exec, with: {command: [\"${{ steps.a.outputs.x }}\"]}}\n", `step "a" is not upstream of this step`},
		{"unknown output", head + "steps:\n  - {id: a, uses: exec, with: {command: [ls]}}\n  - {id: b, uses: exec, needs: [a], with: {command: [\"${{ steps.a.outputs.x }}\"]}}\n", `has no output "x"`},
		{"unknown param", head + "steps:\n  - {id: a, uses: exec, with: {command: [\"${{ params.lr }}\"]}}\n", `unknown param "lr"`},
		{"bad expr", head + "steps:\n  - {id: a, uses: noop, when: \"1 +\"}\n", `steps[0].when: expression "1 +"`},
		{"until without max", head + "loop: {until: \"true\"}\nsteps: [{id: a, uses: noop}]\n", "loop.max_iterations: required with until"},
		{"param default type", head + "params: {n: {type: int, default: abc}}\nsteps: [{id: a, uses: noop}]\n", `params.n.default: want an int, got "abc"`},
		{"heartbeat >= timeout", head + "steps: [{id: a, uses: noop, timeout: 1s, heartbeat: 2s}]\n", "heartbeat 2s must be shorter than timeout 1s"},
		{"bad server url", head + "servers: [{url: localhost}]\nsteps: [{id: a, uses: noop}]\n", `servers[0].url: "localhost" is not an http(s) URL`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Load("x.yaml", []byte(c.yaml))
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.want)
			for _, line := range strings.Split(err.Error(), "\n") {
				assert.Regexp(t, `^x\.yaml:\d+:\d+: `, line)
			}
		})
	}
}

func TestManyErrorsSorted(t *testing.T) {
	_, err := Load("x.yaml", []byte("version: 1\nname: T\nsteps:\n  - {id: a, uses: nope}\n  - {id: b, uses: noop, needs: [zz]}\n"))
	require.Error(t, err)
	list := err.(ErrorList)
	require.Len(t, list, 3)
	for i := 1; i < len(list); i++ {
		assert.LessOrEqual(t, list[i-1].Line, list[i].Line)
	}
}

func TestHostileInputIsRefusedQuickly(t *testing.T) {
	bomb := "a: &a [x, x, x, x, x, x, x, x, x]\n"
	prev := "a"
	for i := 0; i < 9; i++ {
		n := string(rune('b' + i))
		bomb += n + ": &" + n + " [*" + prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev + "]\n"
		prev = n
	}
	deep := strings.Repeat("[", 10000) + strings.Repeat("]", 10000)
	huge := strings.Repeat("# padding\n", 11<<20/10)
	for name, data := range map[string]string{"alias bomb": bomb, "deep": deep, "huge": huge} {
		start := time.Now()
		_, err := Load("x.yaml", []byte(data))
		require.Error(t, err, name)
		assert.Less(t, time.Since(start), 2*time.Second, name)
	}
}

func FuzzLoad(f *testing.F) {
	files, _ := filepath.Glob("examples/*.yaml")
	for _, file := range files {
		if b, err := readFile(file); err == nil {
			f.Add(b)
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		_, err := Load("f.yaml", data)
		if err != nil && !strings.HasPrefix(err.Error(), "f.yaml:") {
			t.Fatalf("error without position: %v", err)
		}
	})
}

func readFile(p string) ([]byte, error) { return osReadFile(p) }
var osReadFile = os.ReadFile
