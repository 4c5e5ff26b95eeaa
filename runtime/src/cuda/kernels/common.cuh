// hzp CUDA kernels: common definitions. Compiled at run time by NVRTC (no CUDA headers
// needed: bf16/f16 conversions are written out here). Floats compute in f32 (bf16/f16
// widened, rounded to nearest even on store), like the CPU kernels; sums accumulate in f64.
// Every kernel walks its elements with a grid-stride loop over 64-bit indices.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef int i32;

struct bf16 { u16 x; };
struct f16 { u16 x; };

#define MAXD 8

// An n-d walk: output shape and up to four strided operands (0 = broadcast dim).
struct Nd {
    int rank;
    i64 shape[MAXD];
    i64 s0[MAXD];
    i64 s1[MAXD];
    i64 s2[MAXD];
    i64 s3[MAXD];
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __uint_as_float(((u32)v.x) << 16); }
__device__ __forceinline__ float to_f(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float v) {
    u32 u = __float_as_uint(v);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.x = (u16)((u >> 16) | 0x40u);  // NaN stays NaN (quiet)
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
        r.x = (u16)(u >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16 from_f<f16>(float v) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(v));
    return r;
}

__device__ __forceinline__ bool is_nan(float v) { return v != v; }

// i / n (non-negative operands), with the remainder: in 32 bits when both fit, which is
// several times cheaper than the 64-bit division the GPU emulates.
__device__ __forceinline__ i64 div_rem(i64 i, i64 n, i64* rem) {
    if (((u64)i | (u64)n) <= 0xffffffffull) {
        const u32 q = (u32)i / (u32)n;
        *rem = (i64)((u32)i - q * (u32)n);
        return (i64)q;
    }
    const i64 q = i / n;
    *rem = i - q * n;
    return q;
}

// A cursor on an n-d walk: the four offsets of the current element and its coordinate in
// the innermost dim, so the next element WARP_RUN_STEP further on costs additions instead of
// divisions while it stays in the same innermost row.
struct NdCursor { i64 o0, o1, o2, o3, c; };

// The cursor at linear index i of the walk's shape.
__device__ __forceinline__ void nd_seek(const Nd& d, i64 i, NdCursor* k) {
    i64 a = 0, b = 0, c = 0, e = 0, inner = 0;
    for (int q = d.rank - 1; q >= 0; --q) {
        i64 cq;
        i = div_rem(i, d.shape[q], &cq);
        if (q == d.rank - 1) inner = cq;
        a += cq * d.s0[q];
        b += cq * d.s1[q];
        c += cq * d.s2[q];
        e += cq * d.s3[q];
    }
    k->o0 = a; k->o1 = b; k->o2 = c; k->o3 = e; k->c = inner;
}

// Offsets of linear index i of the walk's shape in operands 0..3.
__device__ __forceinline__ void nd_offsets(const Nd& d, i64 i, i64* o0, i64* o1, i64* o2, i64* o3) {
    NdCursor k;
    nd_seek(d, i, &k);
    *o0 = k.o0; *o1 = k.o1; *o2 = k.o2; *o3 = k.o3;
}

// Elementwise kernels over a walk take the elements in warp tiles: warp w of the grid owns
// tiles of 32 * WARP_RUN consecutive elements, lane l the elements tile + l + 32 e (e <
// WARP_RUN), so every load and store of a warp is one contiguous run and each lane divides
// once per tile. Correct for any grid (the tiles stride over the whole range).
#define WARP_RUN 4
#define WARP_RUN_STEP 32

// Moves the cursor from element i - 32 to element i.
__device__ __forceinline__ void nd_step(const Nd& d, i64 i, NdCursor* k) {
    const int l = d.rank - 1;
    if (l >= 0 && k->c + WARP_RUN_STEP < d.shape[l]) {
        k->c += WARP_RUN_STEP;
        k->o0 += WARP_RUN_STEP * d.s0[l];
        k->o1 += WARP_RUN_STEP * d.s1[l];
        k->o2 += WARP_RUN_STEP * d.s2[l];
        k->o3 += WARP_RUN_STEP * d.s3[l];
    } else {
        nd_seek(d, i, k);
    }
}

// Calls body(i, cursor) for every element i < n of the walk, in warp tiles (above).
template <typename F>
__device__ __forceinline__ void walk_runs(const Nd& d, i64 n, F body) {
    const i64 stride = (i64)blockDim.x * gridDim.x * WARP_RUN;
    // (blockDim.x is a whole number of warps: the launch's 256)
    const i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 first = g / 32 * (32 * WARP_RUN) + g % 32;
    for (i64 t = first; t < n; t += stride) {
        NdCursor k;
        nd_seek(d, t, &k);
        for (int e = 0; e < WARP_RUN; ++e) {
            const i64 i = t + (i64)WARP_RUN_STEP * e;
            if (i >= n) break;
            if (e > 0) nd_step(d, i, &k);
            body(i, k);
        }
    }
}

#define GRID_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Reports the first failing node: `code` is the node's index + 1.
__device__ __forceinline__ void fail(int* err, int code) { atomicCAS(err, 0, code); }

// Wraps a negative index once; -1 when still out of range.
__device__ __forceinline__ i64 wrap_index(i64 j, i64 dim) {
    if (j < 0) j += dim;
    return (j < 0 || j >= dim) ? -1 : j;
}

__device__ __forceinline__ i64 load_index(const void* idx, int idx64, i64 k) {
    return idx64 ? ((const i64*)idx)[k] : (i64)((const i32*)idx)[k];
}

// Block-wide reductions over blockDim.x threads (a power of two, at most 1024), in a fixed
// tree: deterministic for a given launch shape.
__device__ __forceinline__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float nan_max(float a, float b) { return (is_nan(a) || is_nan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b); }
__device__ __forceinline__ float nan_min(float a, float b) { return (is_nan(a) || is_nan(b)) ? __int_as_float(0x7fc00000) : fminf(a, b); }

__device__ __forceinline__ float block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float a = sh[threadIdx.x], b = sh[threadIdx.x + s];
            sh[threadIdx.x] = (is_nan(a) || is_nan(b) || b > a) ? (is_nan(a) ? a : b) : a;
        }
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// The unsigned type of an integer type (for wrapping arithmetic).
template <typename T> struct Uns;
template <> struct Uns<i64> { typedef u64 t; };
template <> struct Uns<i32> { typedef u32 t; };

// Values as compared by ArgMax/TopK: floats as f32, integers as themselves, bools as int.
__device__ __forceinline__ float as_c(float v) { return v; }
__device__ __forceinline__ float as_c(bf16 v) { return to_f(v); }
__device__ __forceinline__ float as_c(f16 v) { return to_f(v); }
__device__ __forceinline__ i64 as_c(i64 v) { return v; }
__device__ __forceinline__ i32 as_c(i32 v) { return v; }
__device__ __forceinline__ int as_c(u8 v) { return (int)v; }
