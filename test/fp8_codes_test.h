// The value of an 8-bit float code, from the formats' definitions (not from the code under test):
// e4m3fn (OCP: sign, 4 exponent bits with bias 7, 3 mantissa bits; S.1111.111 is NaN, no inf) and
// e5m2 (sign, 5 exponent bits with bias 15, 2 mantissa bits; exponent 31 is inf / NaN, as IEEE).
#pragma once
#include <math.h>

static inline float e4m3_decode(int code) {
    int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) return NAN;
    float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    return code & 0x80 ? -mag : mag;
}

static inline float e5m2_decode(int code) {
    int e = (code >> 2) & 31, m = code & 3;
    float mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexpf((float)m, -16) : ldexpf((float)(4 + m), e - 17);
    return code & 0x80 ? -mag : mag;
}
