package safetensors

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"testing"
)

// refBF16 is a slow reference: round |x| to 8 significant bits with float64
// arithmetic (exact for every float32), ties to even.
func refBF16(b uint32) uint16 {
	x := float64(math.Float32frombits(b))
	sign := uint16(b>>16) & 0x8000
	switch {
	case math.IsNaN(x):
		return sign | 0x7fc0 | uint16(b>>16)&0x3f // quiet, top payload bits kept
	case math.IsInf(x, 0):
		return sign | 0x7f80
	}
	a := math.Abs(x)
	if a == 0 {
		return sign
	}
	if a >= (2-0x1p-8)*0x1p127 { // max finite + half an ulp
		return sign | 0x7f80
	}
	if a < 0x1p-126 { // subnormal: multiples of 2^-133
		return sign | uint16(math.RoundToEven(a*0x1p133))
	}
	_, e := math.Frexp(a) // a in [2^(e-1), 2^e)
	E := e - 1
	k := math.RoundToEven(math.Ldexp(a, 7-E)) // in [128, 256]
	if k == 256 {
		k, E = 128, E+1
	}
	return sign | uint16(E+127)<<7 | uint16(k-128)
}

// refF16 is the same for IEEE half: 11 significant bits, exponents -14..15,
// subnormals in multiples of 2^-24.
func refF16(b uint32) uint16 {
	x := float64(math.Float32frombits(b))
	sign := uint16(b>>16) & 0x8000
	switch {
	case math.IsNaN(x):
		return sign | 0x7e00 | uint16(b>>13)&0x1ff
	case math.IsInf(x, 0):
		return sign | 0x7c00
	}
	a := math.Abs(x)
	if a >= 65520 { // 65504 + half an ulp (16): ties go to "even" infinity
		return sign | 0x7c00
	}
	if a < 0x1p-14 {
		return sign | uint16(math.RoundToEven(a*0x1p24)) // 1024 is the smallest normal: same encoding
	}
	_, e := math.Frexp(a)
	E := e - 1
	k := math.RoundToEven(math.Ldexp(a, 10-E))
	if k == 2048 {
		k, E = 1024, E+1
	}
	return sign | uint16(E+15)<<10 | uint16(k-1024)
}

func TestBF16KnownBits(t *testing.T) {
	tests := []struct {
		in   uint32
		want uint16
	}{
		{0x00000000, 0x0000}, {0x80000000, 0x8000},
		{0x3f800000, 0x3f80}, // 1.0
		{0xbf800000, 0xbf80}, // -1.0
		{0x40490fdb, 0x4049}, // pi: 0x0fdb < half
		{0x3f808000, 0x3f80}, // tie, even stays
		{0x3f818000, 0x3f82}, // tie, odd rounds up
		{0x3f808001, 0x3f81}, // above tie
		{0x3f807fff, 0x3f80}, // below tie
		{0x7f7fffff, 0x7f80}, // max float32 rounds to +inf
		{0x7f7f7fff, 0x7f7f}, // stays max bf16
		{0x7f800000, 0x7f80}, {0xff800000, 0xff80},
		{0x7fc00000, 0x7fc0},                       // quiet NaN
		{0x7f800001, 0x7fc0}, {0xff800001, 0xffc0}, // signalling NaN -> quiet, sign kept
		{0x7fa12345, 0x7fe1}, // payload top bits kept
		{0x00000001, 0x0000}, // tiny subnormal
		{0x00008000, 0x0000}, // tie to even (0)
		{0x00018000, 0x0002}, // tie to even (2)
		{0x007fffff, 0x0080}, // largest subnormal rounds to smallest normal
	}
	for _, tc := range tests {
		if got := F32ToBF16Bits(tc.in); got != tc.want {
			t.Errorf("F32ToBF16(%#08x) = %#04x, want %#04x", tc.in, got, tc.want)
		}
		if got := refBF16(tc.in); got != tc.want {
			t.Errorf("reference BF16(%#08x) = %#04x, want %#04x", tc.in, got, tc.want)
		}
	}
}

func TestF16KnownBits(t *testing.T) {
	tests := []struct {
		in   uint32
		want uint16
	}{
		{0x00000000, 0x0000}, {0x80000000, 0x8000},
		{0x3f800000, 0x3c00},                       // 1
		{0xc0000000, 0xc000},                       // -2
		{0x477fe000, 0x7bff},                       // 65504 max half
		{0x477fefff, 0x7bff},                       // just below 65520
		{0x477ff000, 0x7c00},                       // 65520 -> inf
		{0x47800000, 0x7c00},                       // 65536 -> inf
		{0x38800000, 0x0400},                       // 2^-14 smallest normal
		{0x33800000, 0x0001},                       // 2^-24 smallest subnormal
		{0x33000000, 0x0000},                       // 2^-25: tie -> 0 (even)
		{0x33000001, 0x0001},                       // just above 2^-25
		{0x33c00000, 0x0002},                       // 1.5 * 2^-24: tie -> 2 (even)
		{0x387fc000, 0x03ff},                       // largest subnormal 1023 * 2^-24
		{0x387fe000, 0x0400},                       // 1023.5 * 2^-24: tie, odd -> smallest normal
		{0x3f801000, 0x3c00},                       // tie, even
		{0x3f803000, 0x3c02},                       // tie, odd rounds up
		{0x3dcccccd, 0x2e66},                       // 0.1
		{0x7f800000, 0x7c00}, {0xff800000, 0xfc00}, // inf
		{0x7fc00000, 0x7e00}, {0x7f800001, 0x7e00}, // NaN -> quiet
		{0x00000001, 0x0000}, {0x80000001, 0x8000}, // float32 subnormals
	}
	for _, tc := range tests {
		if got := F32ToF16Bits(tc.in); got != tc.want {
			t.Errorf("F32ToF16(%#08x) = %#04x, want %#04x", tc.in, got, tc.want)
		}
		if got := refF16(tc.in); got != tc.want {
			t.Errorf("reference F16(%#08x) = %#04x, want %#04x", tc.in, got, tc.want)
		}
	}
}

// forInputs calls check on a structured sample of float32 patterns (every
// upper half with boundary lower halves), plus random ones; with
// RLFLOW_EXHAUSTIVE=1 on all 2^32 patterns.
func forInputs(t *testing.T, check func(b uint32) bool) {
	if os.Getenv("RLFLOW_EXHAUSTIVE") == "1" {
		workers := runtime.GOMAXPROCS(0)
		var wg sync.WaitGroup
		var mu sync.Mutex
		bad := 0
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for b := uint64(w); b < 1<<32; b += uint64(workers) {
					if !check(uint32(b)) {
						mu.Lock()
						bad++
						mu.Unlock()
						if bad > 10 {
							return
						}
					}
				}
			}()
		}
		wg.Wait()
		if bad > 0 {
			t.Fatalf("%d mismatches", bad)
		}
		return
	}
	lows := []uint32{0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0xffff}
	bad := 0
	for hi := uint32(0); hi < 1<<16; hi++ {
		for _, lo := range lows {
			if !check(hi<<16 | lo) {
				bad++
			}
		}
		// Half's rounding point lies in bit 12 of the mantissa: vary bits 0..15 around it.
		for _, lo := range []uint32{0x0ffe, 0x2fff, 0x5000, 0xe000, 0xf000} {
			if !check(hi<<16 | lo) {
				bad++
			}
		}
		if bad > 10 {
			t.Fatalf("too many mismatches")
		}
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 2_000_000 {
		if !check(r.Uint32()) {
			bad++
			if bad > 10 {
				t.Fatalf("too many mismatches")
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d mismatches", bad)
	}
}

func TestBF16AgainstReference(t *testing.T) {
	forInputs(t, func(b uint32) bool {
		got, want := F32ToBF16Bits(b), refBF16(b)
		if got != want {
			t.Errorf("F32ToBF16(%#08x) = %#04x, reference %#04x", b, got, want)
			return false
		}
		return true
	})
}

func TestF16AgainstReference(t *testing.T) {
	forInputs(t, func(b uint32) bool {
		got, want := F32ToF16Bits(b), refF16(b)
		if got != want {
			t.Errorf("F32ToF16(%#08x) = %#04x, reference %#04x", b, got, want)
			return false
		}
		return true
	})
}

// Every 16-bit value widens exactly and narrows back to itself.
func TestWidenNarrowIdentity(t *testing.T) {
	for h := range uint32(1 << 16) {
		f := F16ToF32Bits(uint16(h))
		x := math.Float32frombits(f)
		isNaN := h&0x7c00 == 0x7c00 && h&0x3ff != 0
		if isNaN != math.IsNaN(float64(x)) {
			t.Fatalf("f16 %#04x widened to %#08x: NaN-ness changed", h, f)
		}
		back := F32ToF16Bits(f)
		if isNaN {
			back &^= 0x200 // quieting is allowed
			if back != uint16(h)&^0x200 {
				t.Fatalf("f16 NaN %#04x -> %#08x -> %#04x", h, f, back)
			}
			continue
		}
		if back != uint16(h) {
			t.Fatalf("f16 %#04x -> %#08x -> %#04x", h, f, back)
		}
		// Widening must be exact: compare against the reference value.
		if want := refF16(f); want != uint16(h) {
			t.Fatalf("f16 %#04x widened to %v, which the reference rounds to %#04x", h, x, want)
		}
		bf := uint32(h) << 16
		if F32ToBF16Bits(bf) != uint16(h) && !math.IsNaN(float64(math.Float32frombits(bf))) {
			t.Fatalf("bf16 %#04x does not round trip", h)
		}
	}
}

func TestConvertSlices(t *testing.T) {
	vals := []float32{1, -2.5, 3.14159, 65504, 1e-8, float32(math.Inf(-1))}
	src := make([]byte, 4*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint32(src[4*i:], math.Float32bits(v))
	}
	bf := make([]byte, 2*len(vals))
	if err := ConvertF32ToBF16(bf, src); err != nil {
		t.Fatal(err)
	}
	hf := make([]byte, 2*len(vals))
	if err := ConvertF32ToF16(hf, src); err != nil {
		t.Fatal(err)
	}
	wide := make([]byte, len(src))
	if err := ConvertBF16ToF32(wide, bf); err != nil {
		t.Fatal(err)
	}
	for i, v := range vals {
		b := math.Float32bits(v)
		if got := binary.LittleEndian.Uint16(bf[2*i:]); got != F32ToBF16Bits(b) {
			t.Errorf("bf16[%d] = %#04x", i, got)
		}
		if got := binary.LittleEndian.Uint16(hf[2*i:]); got != F32ToF16Bits(b) {
			t.Errorf("f16[%d] = %#04x", i, got)
		}
		if got := binary.LittleEndian.Uint32(wide[4*i:]); got != uint32(F32ToBF16Bits(b))<<16 {
			t.Errorf("widened[%d] = %#08x", i, got)
		}
	}
	if err := ConvertF16ToF32(wide, hf); err != nil {
		t.Fatal(err)
	}
	if err := ConvertF32ToBF16(bf[:3], src); err == nil {
		t.Error("short dst accepted")
	}
	if err := ConvertF32ToF16(hf, src[:5]); err == nil {
		t.Error("ragged src accepted")
	}
	if err := ConvertBF16ToF32(wide[:4], bf); err == nil {
		t.Error("short dst accepted")
	}
	if err := ConvertF16ToF32(wide, hf[:3]); err == nil {
		t.Error("ragged src accepted")
	}
}
