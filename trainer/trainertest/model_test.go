package trainertest

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFloat16Bits(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   float32
		want uint16
	}{
		{"one", 1, 0x3c00},
		{"minus two", -2, 0xc000},
		{"zero", 0, 0},
		{"minus zero", float32(math.Copysign(0, -1)), 0x8000},
		{"largest", 65504, 0x7bff},
		{"halfway past the largest rounds to even: infinity", 65520, 0x7c00},
		{"just below that halfway stays", 65519, 0x7bff},
		{"overflow", 1e6, 0x7c00},
		{"infinity", float32(math.Inf(-1)), 0xfc00},
		{"nan", float32(math.NaN()), 0x7e00},
		{"smallest subnormal", float32(math.Ldexp(1, -24)), 0x0001},
		{"half the smallest subnormal rounds to even: zero", float32(math.Ldexp(1, -25)), 0},
		{"three halves of it rounds to even: two", float32(math.Ldexp(3, -25)), 0x0002},
		{"a bit above half the smallest", float32(math.Ldexp(1, -25) * 1.0001), 0x0001},
		{"largest subnormal", float32(math.Ldexp(1023, -24)), 0x03ff},
		{"subnormal rounding up into the smallest normal", float32(math.Ldexp(2047, -25)), 0x0400},
		{"smallest normal", float32(math.Ldexp(1, -14)), 0x0400},
		{"halfway between 1 and the next, even: down", 1 + float32(math.Ldexp(1, -11)), 0x3c00},
		{"halfway between 1+ulp and the next, odd: up", 1 + float32(math.Ldexp(3, -11)), 0x3c02},
		{"below halfway", 1 + float32(math.Ldexp(1, -11)) - float32(math.Ldexp(1, -20)), 0x3c00},
		{"float32 subnormal", float32(math.Ldexp(1, -140)), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, float16Bits(tc.in), "%x", float16Bits(tc.in))
		})
	}
}

func TestBFloat16Bits(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   float32
		want uint16
	}{
		{"one", 1, 0x3f80},
		{"minus one", -1, 0xbf80},
		{"halfway, even: down", 1 + float32(math.Ldexp(1, -8)), 0x3f80},
		{"halfway, odd: up", 1 + float32(math.Ldexp(3, -8)), 0x3f82},
		{"above halfway", 1 + float32(math.Ldexp(1, -8)) + float32(math.Ldexp(1, -20)), 0x3f81},
		{"largest float32 rounds to infinity", math.MaxFloat32, 0x7f80},
		{"infinity", float32(math.Inf(1)), 0x7f80},
		{"nan stays nan", float32(math.NaN()), 0x7fc0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, bfloat16Bits(tc.in), "%x", bfloat16Bits(tc.in))
		})
	}
}

func TestParseShapes(t *testing.T) {
	specs, err := parseShapes(DefaultShapes)
	require.NoError(t, err)
	var elems int64
	for _, s := range specs {
		elems += s.elems()
	}
	assert.Equal(t, int64(64<<10/4+64), elems, "the default is 64 KiB of float32 plus a vector")

	specs, err = parseShapes("4x2, 3 ,x=2x2x2")
	require.NoError(t, err)
	assert.Equal(t, []tensorSpec{{"model.embed.weight", []int64{4, 2}}, {"model.layers.0.w", []int64{3}}, {"x", []int64{2, 2, 2}}}, specs)

	for _, tc := range []struct{ in, err string }{
		{"", `tensor model.embed.weight: shape "": want dimensions like 64x128, each 1..67108864`},
		{"a=2,a=3", "tensor 2: empty or repeated name"},
		{"=2", "tensor 1: empty or repeated name"},
		{"a=0x2", `tensor a: shape "0x2": want dimensions like 64x128, each 1..67108864`},
		{"a=2xb", `tensor a: shape "2xb": want dimensions like 64x128, each 1..67108864`},
		{"a=65536x1024,b=2", "more than 67108864 elements in all"},
	} {
		_, err := parseShapes(tc.in)
		assert.EqualError(t, err, tc.err, "%q", tc.in)
	}
}

func rollouts(t *testing.T, lines ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "rollouts.jsonl")
	var b []byte
	for _, l := range lines {
		b = append(b, l+"\n"...)
	}
	require.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

func smallSpecs(t *testing.T) []tensorSpec {
	specs, err := parseShapes("a=8x4,b=5")
	require.NoError(t, err)
	return specs
}

func TestTrainIsDeterministicAndDataDriven(t *testing.T) {
	r1 := rollouts(t, `{"text":"a"}`, `{"text":"b"}`)
	r2 := rollouts(t, `{"text":"a"}`, `{"text":"c"}`)
	train := func(seed uint64, files ...string) *model {
		m := newModel(smallSpecs(t), seed)
		for i, f := range files {
			loss, samples, err := m.train(i+1, f, nil)
			require.NoError(t, err)
			assert.Equal(t, 2, samples)
			assert.Greater(t, loss, 0.0)
		}
		return m
	}
	a, b := train(1, r1, r1), train(1, r1, r1)
	assert.Equal(t, a.params, b.params, "the same data and seed give the same bits")
	assert.NotEqual(t, a.params, train(1, r1, r2).params, "other data gives other weights")
	assert.NotEqual(t, a.params, train(2, r1, r1).params, "another seed gives other weights")
	assert.Equal(t, 2, a.iteration)
}

func TestSaveLoadContinuesBitForBit(t *testing.T) {
	r := rollouts(t, "x", "y", "z")
	specs := smallSpecs(t)
	a := newModel(specs, 7)
	for i := 1; i <= 2; i++ {
		_, _, err := a.train(i, r, nil)
		require.NoError(t, err)
	}
	ckpt := filepath.Join(t.TempDir(), "ckpt-2")
	n, err := a.save(ckpt, nil)
	require.NoError(t, err)
	assert.Positive(t, n)
	_, err = a.save(ckpt, nil)
	assert.ErrorContains(t, err, "exists already")

	b := newModel(specs, 99) // other initial weights and generator: load replaces all of it
	require.NoError(t, b.load(ckpt))
	assert.Equal(t, 2, b.iteration)
	for _, m := range []*model{a, b} {
		_, _, err := m.train(3, r, nil)
		require.NoError(t, err)
	}
	assert.Equal(t, a.params, b.params)
	assert.Equal(t, a.momentum, b.momentum)
	assert.Equal(t, a.rng.Uint64(), b.rng.Uint64())

	other, err := parseShapes("a=8x4")
	require.NoError(t, err)
	assert.ErrorContains(t, newModel(other, 1).load(ckpt), "holds other tensors than this trainer's")
}
