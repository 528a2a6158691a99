//go:build amd64 && cgo

package main

/*
#cgo CFLAGS: -O2 -mavx2
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

static void copy_nt(void *dst, const void *src, size_t n) {
	char *d = dst; const char *s = src;
	size_t i = 0;
	for (; i + 128 <= n; i += 128) {
		__m256i a = _mm256_loadu_si256((const __m256i*)(s+i));
		__m256i b = _mm256_loadu_si256((const __m256i*)(s+i+32));
		__m256i c = _mm256_loadu_si256((const __m256i*)(s+i+64));
		__m256i e = _mm256_loadu_si256((const __m256i*)(s+i+96));
		_mm256_stream_si256((__m256i*)(d+i), a);
		_mm256_stream_si256((__m256i*)(d+i+32), b);
		_mm256_stream_si256((__m256i*)(d+i+64), c);
		_mm256_stream_si256((__m256i*)(d+i+96), e);
	}
	for (; i < n; i++) d[i] = s[i];
	_mm_sfence();
}
static void copy_tmp(void *dst, const void *src, size_t n) {
	char *d = dst; const char *s = src;
	size_t i = 0;
	for (; i + 128 <= n; i += 128) {
		__m256i a = _mm256_loadu_si256((const __m256i*)(s+i));
		__m256i b = _mm256_loadu_si256((const __m256i*)(s+i+32));
		__m256i c = _mm256_loadu_si256((const __m256i*)(s+i+64));
		__m256i e = _mm256_loadu_si256((const __m256i*)(s+i+96));
		_mm256_store_si256((__m256i*)(d+i), a);
		_mm256_store_si256((__m256i*)(d+i+32), b);
		_mm256_store_si256((__m256i*)(d+i+64), c);
		_mm256_store_si256((__m256i*)(d+i+96), e);
	}
	for (; i < n; i++) d[i] = s[i];
}
static void copy_movsb(void *dst, const void *src, size_t n) {
	__asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}
static void copy_k(int k, uintptr_t dst, uintptr_t src, size_t n) {
	if (k == 1) copy_nt((void*)dst, (void*)src, n);
	else if (k == 2) copy_tmp((void*)dst, (void*)src, n);
	else copy_movsb((void*)dst, (void*)src, n);
}
*/
import "C"

import "unsafe"

// kernels: 0 go copy, 1 AVX2 non-temporal, 2 AVX2 temporal, 3 rep movsb.
var kernelNames = []string{"go", "nt", "tmp", "movsb"}

func copyK(k int, dst, src []byte) {
	if k == 0 {
		copy(dst, src)
		return
	}
	n := min(len(dst), len(src))
	if n == 0 {
		return
	}
	C.copy_k(C.int(k), C.uintptr_t(uintptr(unsafe.Pointer(&dst[0]))), C.uintptr_t(uintptr(unsafe.Pointer(&src[0]))), C.size_t(n))
}
