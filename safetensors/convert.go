package safetensors

import (
	"encoding/binary"
	"fmt"
	"math"
)

// ConvertF32ToBF16 converts little-endian float32 values in src to bfloat16
// in dst (len(dst) must be len(src)/2), rounding to nearest, ties to even.
// NaNs stay NaNs (made quiet, sign and high payload bits kept); overflow
// rounds to infinity as IEEE 754 requires.
func ConvertF32ToBF16(dst, src []byte) error {
	if err := checkLens("ConvertF32ToBF16", dst, src, 4, 2); err != nil {
		return err
	}
	for i, j := 0, 0; i < len(src); i, j = i+4, j+2 {
		binary.LittleEndian.PutUint16(dst[j:], F32ToBF16Bits(binary.LittleEndian.Uint32(src[i:])))
	}
	return nil
}

// ConvertBF16ToF32 widens little-endian bfloat16 values (exact).
func ConvertBF16ToF32(dst, src []byte) error {
	if err := checkLens("ConvertBF16ToF32", dst, src, 2, 4); err != nil {
		return err
	}
	for i, j := 0, 0; i < len(src); i, j = i+2, j+4 {
		binary.LittleEndian.PutUint32(dst[j:], uint32(binary.LittleEndian.Uint16(src[i:]))<<16)
	}
	return nil
}

// ConvertF32ToF16 converts little-endian float32 values to IEEE half
// precision, rounding to nearest, ties to even, producing subnormals,
// signed zeros and infinities as IEEE 754 does; NaNs stay (quiet) NaNs.
func ConvertF32ToF16(dst, src []byte) error {
	if err := checkLens("ConvertF32ToF16", dst, src, 4, 2); err != nil {
		return err
	}
	for i, j := 0, 0; i < len(src); i, j = i+4, j+2 {
		binary.LittleEndian.PutUint16(dst[j:], F32ToF16Bits(binary.LittleEndian.Uint32(src[i:])))
	}
	return nil
}

// ConvertF16ToF32 widens little-endian IEEE half precision values (exact).
func ConvertF16ToF32(dst, src []byte) error {
	if err := checkLens("ConvertF16ToF32", dst, src, 2, 4); err != nil {
		return err
	}
	for i, j := 0, 0; i < len(src); i, j = i+2, j+4 {
		binary.LittleEndian.PutUint32(dst[j:], F16ToF32Bits(binary.LittleEndian.Uint16(src[i:])))
	}
	return nil
}

func checkLens(fn string, dst, src []byte, srcSize, dstSize int) error {
	if len(src)%srcSize != 0 {
		return fmt.Errorf("safetensors: %s: source length %d is not a multiple of %d", fn, len(src), srcSize)
	}
	if want := len(src) / srcSize * dstSize; len(dst) != want {
		return fmt.Errorf("safetensors: %s: destination length %d, want %d", fn, len(dst), want)
	}
	return nil
}

// F32ToBF16Bits converts one float32 bit pattern to bfloat16 (see ConvertF32ToBF16).
func F32ToBF16Bits(b uint32) uint16 {
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x0040
	}
	// Adding 0x7fff plus the lowest kept bit rounds half to even; a carry
	// into the exponent is the correct result (up to infinity).
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// F32ToF16Bits converts one float32 bit pattern to IEEE half (see ConvertF32ToF16).
func F32ToF16Bits(b uint32) uint16 {
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00 | uint16(man>>13)
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15 // biased half exponent
	if e >= 0x1f {
		return sign | 0x7c00
	}
	var k, rem, half uint32
	if e <= 0 {
		// Half subnormal: value = k * 2^-24 with k = m * 2^(e-14).
		shift := uint(14 - e)
		if shift > 24 {
			return sign // below half the smallest subnormal
		}
		m := man | 0x800000
		k = m >> shift
		rem = m & (1<<shift - 1)
		half = 1 << (shift - 1)
	} else {
		k = uint32(e)<<10 | man>>13
		rem = man & 0x1fff
		half = 0x1000
	}
	if rem > half || (rem == half && k&1 == 1) {
		k++ // may carry into the exponent: still the right encoding
	}
	return sign | uint16(k)
}

// F16ToF32Bits widens one IEEE half bit pattern to float32 (exact).
func F16ToF32Bits(h uint16) uint32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return sign | 0x7f800000 | man<<13
	case exp != 0:
		return sign | (exp+127-15)<<23 | man<<13
	case man == 0:
		return sign
	default:
		// Subnormal half: exact in float32 as a normal number.
		return sign | math.Float32bits(float32(man)*0x1p-24)&0x7fffffff
	}
}
