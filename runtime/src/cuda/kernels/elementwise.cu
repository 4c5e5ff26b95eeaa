// Elementwise kernels: Unary, Binary (numpy broadcasting through an Nd walk), Where, Cast,
// Fill. Op codes are hzp_ir's UnaryOp::code / BinaryOp::code; a code a switch does not know
// traps (a new op never runs as another one).

__device__ __forceinline__ float unary_f(int op, float v) {
    switch (op) {
    case 0: return -v;
    case 1: return fabsf(v);
    case 2: return expf(v);
    case 3: return logf(v);
    case 4: return sqrtf(v);
    case 5: return 1.0f / sqrtf(v);
    case 6: return 1.0f / v;
    case 7: return tanhf(v);
    case 8: return erff(v);
    case 9: return 1.0f / (1.0f + expf(-v));
    case 10: return (v > 0.0f || is_nan(v)) ? v : 0.0f;
    case 11: return 0.5f * v * erfcf(-v * 0.70710678118654752f);
    case 12: return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    case 13: return v * (1.0f / (1.0f + expf(-v)));
    case 14: return sinf(v);
    case 15: return cosf(v);
    case 16: return floorf(v);
    case 17: return ceilf(v);
    case 18: return v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : v);
    default: __trap(); return v;
    }
}

template <typename T>
__device__ void unary_float(int op, i64 n, const T* x, T* y) {
    GRID_LOOP(i, n) { y[i] = from_f<T>(unary_f(op, to_f(x[i]))); }
}

template <typename T>
__device__ void unary_int(int op, i64 n, const T* x, T* y) {
    GRID_LOOP(i, n) {
        T v = x[i];
        typedef typename Uns<T>::t U;
        switch (op) {
        case 0: y[i] = (T)(U)(0 - (U)v); break;                  // wrapping negation
        case 1: y[i] = v < 0 ? (T)(U)(0 - (U)v) : v; break;       // wrapping abs
        case 18: y[i] = (T)(v > 0 ? 1 : (v < 0 ? -1 : 0)); break; // Sign
        default: __trap(); break;
        }
    }
}

template <typename T>
__device__ void isnan_k(i64 n, const T* x, u8* y) {
    GRID_LOOP(i, n) { y[i] = is_nan(to_f(x[i])) ? 1 : 0; }
}

// ---- binary

__device__ __forceinline__ float binary_f(int op, float a, float b) {
    switch (op) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4:
        if (b == 2.0f) return a * a;
        if (b == 3.0f) return a * a * a;
        if (b == 1.0f) return a;
        return powf(a, b);
    case 5: return nan_max(a, b);
    case 6: return nan_min(a, b);
    case 7: return fmodf(a, b);
    default: __trap(); return __int_as_float(0x7fc00000);
    }
}

template <typename C>
__device__ __forceinline__ bool compare(int op, C a, C b) {
    switch (op) {
    case 8: return a == b;
    case 9: return a < b;
    case 10: return a <= b;
    case 11: return a > b;
    case 12: return a >= b;
    default: __trap(); return false;
    }
}

template <typename T>
__device__ void binary_float(int op, i64 n, Nd d, const T* a, const T* b, T* y) {
    walk_runs(d, n, [&](i64 i, const NdCursor& k) {
        y[i] = from_f<T>(binary_f(op, to_f(a[k.o0]), to_f(b[k.o1])));
    });
}

template <typename T>
__device__ void compare_float(int op, i64 n, Nd d, const T* a, const T* b, u8* y) {
    walk_runs(d, n, [&](i64 i, const NdCursor& k) {
        y[i] = compare<float>(op, to_f(a[k.o0]), to_f(b[k.o1])) ? 1 : 0;
    });
}

template <typename T>
__device__ T int_pow(T base, T e, bool* bad) {
    typedef typename Uns<T>::t U;
    if (e < 0) {
        if (base == 0) { *bad = true; return 0; }
        if (base == 1) return 1;
        if (base == -1) return (e % 2 == 0) ? 1 : -1;
        return 0;
    }
    U acc = 1, b = (U)base;
    u64 k = (u64)e;
    while (k > 0) {
        if (k & 1) acc = acc * b;
        b = b * b;
        k >>= 1;
    }
    return (T)acc;
}

template <typename T>
__device__ void binary_int(int op, i64 n, Nd d, const T* a, const T* b, T* y, int* err, int code) {
    typedef typename Uns<T>::t U;
    GRID_LOOP(i, n) {
        i64 oa, ob, o2, o3;
        nd_offsets(d, i, &oa, &ob, &o2, &o3);
        T x = a[oa], z = b[ob], r = 0;
        bool bad = false;
        switch (op) {
        case 0: r = (T)((U)x + (U)z); break;
        case 1: r = (T)((U)x - (U)z); break;
        case 2: r = (T)((U)x * (U)z); break;
        case 3:
            if (z == 0) { bad = true; break; }
            // the one overflowing quotient (MIN / -1) wraps to MIN
            r = (z == -1) ? (T)(0 - (U)x) : x / z;
            break;
        case 7:
            if (z == 0) { bad = true; break; }
            r = (z == -1) ? 0 : x % z;
            if (r != 0 && ((r < 0) != (z < 0))) r = (T)((U)r + (U)z);
            break;
        case 4: r = int_pow<T>(x, z, &bad); break;
        case 5: r = x > z ? x : z; break;
        case 6: r = x < z ? x : z; break;
        default: __trap(); break;
        }
        if (bad) fail(err, code);
        y[i] = r;
    }
}

template <typename T>
__device__ void compare_int(int op, i64 n, Nd d, const T* a, const T* b, u8* y) {
    GRID_LOOP(i, n) {
        i64 oa, ob, o2, o3;
        nd_offsets(d, i, &oa, &ob, &o2, &o3);
        y[i] = compare<T>(op, a[oa], b[ob]) ? 1 : 0;
    }
}

// bool operands: the mapping of the CPU kernel (Add/Max = or, Mul/Min = and, ...).
__device__ void binary_bool(int op, i64 n, Nd d, const u8* a, const u8* b, u8* y) {
    GRID_LOOP(i, n) {
        i64 oa, ob, o2, o3;
        nd_offsets(d, i, &oa, &ob, &o2, &o3);
        bool x = a[oa] != 0, z = b[ob] != 0, r;
        switch (op) {
        case 13: case 2: case 6: r = x && z; break;
        case 14: case 0: case 5: r = x || z; break;
        case 15: r = x != z; break;
        case 8: r = x == z; break;
        case 9: r = !x && z; break;
        case 10: r = !x || z; break;
        case 11: r = x && !z; break;
        case 12: r = x || !z; break;  // GreaterOrEqual
        default: __trap(); r = false; break;
        }
        y[i] = r ? 1 : 0;
    }
}

// ---- where (s0: cond, s1: x, s2: y)

template <typename T>
__device__ void where_k(i64 n, Nd d, const u8* c, const T* x, const T* y, T* out) {
    walk_runs(d, n, [&](i64 i, const NdCursor& k) { out[i] = c[k.o0] ? x[k.o1] : y[k.o2]; });
}

// ---- cast: float -> int truncates toward zero, saturating, NaN -> 0; numbers -> bool test
// != 0; bool -> numbers 0/1; int -> int wraps.

template <typename S> struct Src;
template <> struct Src<float> { static const int kind = 0; };
template <> struct Src<bf16> { static const int kind = 0; };
template <> struct Src<f16> { static const int kind = 0; };
template <> struct Src<i64> { static const int kind = 1; };
template <> struct Src<i32> { static const int kind = 1; };
template <> struct Src<u8> { static const int kind = 2; };

__device__ __forceinline__ i64 sat_i64(float v) {
    if (is_nan(v)) return 0;
    if (v >= 9.223372036854775807e18f) return 0x7fffffffffffffffLL;
    if (v <= -9.223372036854775808e18f) return (i64)0x8000000000000000ULL;
    return (i64)v;
}
__device__ __forceinline__ i32 sat_i32(float v) {
    if (is_nan(v)) return 0;
    if (v >= 2147483647.0f) return 2147483647;
    if (v <= -2147483648.0f) return (i32)0x80000000u;
    return (i32)v;
}

template <typename S> __device__ __forceinline__ float cvt_float(S v) { return to_f(v); }
template <> __device__ __forceinline__ float cvt_float<i64>(i64 v) { return (float)v; }
template <> __device__ __forceinline__ float cvt_float<i32>(i32 v) { return (float)v; }
template <> __device__ __forceinline__ float cvt_float<u8>(u8 v) { return v ? 1.0f : 0.0f; }

template <typename S> __device__ __forceinline__ i64 cvt_int(S v) { return sat_i64(to_f(v)); }
template <> __device__ __forceinline__ i64 cvt_int<i64>(i64 v) { return v; }
template <> __device__ __forceinline__ i64 cvt_int<i32>(i32 v) { return (i64)v; }
template <> __device__ __forceinline__ i64 cvt_int<u8>(u8 v) { return v ? 1 : 0; }

template <typename S> __device__ __forceinline__ bool cvt_bool(S v) { return to_f(v) != 0.0f; }
template <> __device__ __forceinline__ bool cvt_bool<i64>(i64 v) { return v != 0; }
template <> __device__ __forceinline__ bool cvt_bool<i32>(i32 v) { return v != 0; }
template <> __device__ __forceinline__ bool cvt_bool<u8>(u8 v) { return v != 0; }

template <typename S, typename D> struct Cast {
    static __device__ __forceinline__ D go(S v) { return from_f<D>(cvt_float<S>(v)); }
};
template <typename S> struct Cast<S, i64> {
    static __device__ __forceinline__ i64 go(S v) { return cvt_int<S>(v); }
};
template <typename S> struct Cast<S, i32> {
    static __device__ __forceinline__ i32 go(S v) {
        return Src<S>::kind == 0 ? sat_i32(cvt_float<S>(v)) : (i32)cvt_int<S>(v);
    }
};
template <typename S> struct Cast<S, u8> {
    static __device__ __forceinline__ u8 go(S v) { return cvt_bool<S>(v) ? 1 : 0; }
};

template <typename S, typename D>
__device__ void cast_k(i64 n, const S* x, D* y) {
    GRID_LOOP(i, n) { y[i] = Cast<S, D>::go(x[i]); }
}

// ---- fill with a value given as its bit pattern (converted on the host as the CPU does)

template <typename T>
__device__ void fill_k(i64 n, T v, T* y) {
    GRID_LOOP(i, n) { y[i] = v; }
}

// ---- the gradient of the tanh-approximated GELU: y = dy * gelu_tanh'(x)

template <typename T>
__device__ void gelu_tanh_grad_k(i64 n, const T* x, const T* dy, T* y) {
    GRID_LOOP(i, n) {
        float v = to_f(x[i]), v2 = v * v;
        float t = tanhf(0.7978845608f * (v + 0.044715f * v2 * v));
        float du = 0.7978845608f * (1.0f + 3.0f * 0.044715f * v2);
        y[i] = from_f<T>(to_f(dy[i]) * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du));
    }
}

// ---- the fused AdamW step (Op::AdamW), f32; each result may be its input's buffer (every
// thread reads its element's inputs before it stores that element's results)

// decay = 1 - lr * weight_decay in double, rounded once (as the CPU kernel and torch do)

// One element's step: the CPU kernel's f32 operations in its order (no contraction: every
// kernel is compiled with --fmad=false), shared by the per-node and the multi-tensor kernel.
__device__ __forceinline__ void adamw_elem(float wi, float gi, float mi, float vi, float one_m_b1,
                                           float b2, float one_m_b2, float eps, float decay,
                                           float lr, float bc, float* w2, float* m2, float* v2) {
    float mn = mi + (gi - mi) * one_m_b1;
    float vn = vi * b2 + gi * gi * one_m_b2;
    float den = sqrtf(vn) / bc + eps;
    *w2 = wi * decay - mn / den * lr;
    *m2 = mn;
    *v2 = vn;
}

extern "C" __global__ void adamw_f32(i64 n, float one_m_b1, float b2, float one_m_b2, float eps,
                                     double weight_decay, const float* w, const float* g,
                                     const float* m, const float* v, const float* step_size,
                                     const float* bias2_sqrt, const float* lr_now, float* w2,
                                     float* m2, float* v2) {
    float lr = *step_size, bc = *bias2_sqrt;
    float decay = (float)(1.0 - (double)*lr_now * weight_decay);
    GRID_LOOP(i, n) {
        float wi = w[i], gi = g[i], mi = m[i], vi = v[i];
        adamw_elem(wi, gi, mi, vi, one_m_b1, b2, one_m_b2, eps, decay, lr, bc, &w2[i], &m2[i],
                   &v2[i]);
    }
}

// ---- the multi-tensor AdamW step: one launch for a group of Op::AdamW nodes
// (runtime/src/cuda/adamw_multi.rs builds the table). Every operand is a byte offset from
// `base` (the arena), so the table is the same for every run of the plan and is uploaded once.
// Each block takes one chunk (`chunk` elements) of one tensor, as its entry in `chunks` says;
// its threads stride through the chunk. Results may be their input's buffer, as above.

struct AdamWTensor {
    // byte offsets from base: param, grad, m, v, the three scalars, param', m', v'
    u64 w, g, m, v, step_size, bias2_sqrt, lr, w2, m2, v2;
    i64 n;
    float one_m_b1, b2, one_m_b2, eps;
    double weight_decay;
};
static_assert(sizeof(AdamWTensor) == 112, "AdamWTensor is the table's 112-byte entry");

struct AdamWChunk {
    unsigned int tensor, chunk;
};

extern "C" __global__ void adamw_multi_f32(char* base, const AdamWTensor* tensors,
                                           const AdamWChunk* chunks, i64 chunk) {
    AdamWChunk c = chunks[blockIdx.x];
    const AdamWTensor& t = tensors[c.tensor];
    const float* w = (const float*)(base + t.w);
    const float* g = (const float*)(base + t.g);
    const float* m = (const float*)(base + t.m);
    const float* v = (const float*)(base + t.v);
    float* w2 = (float*)(base + t.w2);
    float* m2 = (float*)(base + t.m2);
    float* v2 = (float*)(base + t.v2);
    float lr = *(const float*)(base + t.step_size), bc = *(const float*)(base + t.bias2_sqrt);
    float decay = (float)(1.0 - (double)*(const float*)(base + t.lr) * t.weight_decay);
    i64 start = (i64)c.chunk * chunk;
    i64 end = start + chunk < t.n ? start + chunk : t.n;
    for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        float wi = w[i], gi = g[i], mi = m[i], vi = v[i];
        adamw_elem(wi, gi, mi, vi, t.one_m_b1, t.b2, t.one_m_b2, t.eps, decay, lr, bc, &w2[i],
                   &m2[i], &v2[i]);
    }
}

// ---- instantiations (extern "C" names: <kernel>_<dtype>)

#define FLOAT_TYPES(X) X(f32, float) X(bf16, bf16) X(f16, f16)
#define INT_TYPES(X) X(i64, i64) X(i32, i32)
#define ALL_TYPES(X) FLOAT_TYPES(X) INT_TYPES(X) X(b8, u8)

#define UNARY_FLOAT(N, T) \
    extern "C" __global__ void unary_##N(int op, i64 n, const T* x, T* y) { unary_float<T>(op, n, x, y); } \
    extern "C" __global__ void isnan_##N(i64 n, const T* x, u8* y) { isnan_k<T>(n, x, y); } \
    extern "C" __global__ void gelu_tanh_grad_##N(i64 n, const T* x, const T* dy, T* y) { gelu_tanh_grad_k<T>(n, x, dy, y); } \
    extern "C" __global__ void binary_##N(int op, i64 n, Nd d, const T* a, const T* b, T* y, int* err, int code) { binary_float<T>(op, n, d, a, b, y); } \
    extern "C" __global__ void compare_##N(int op, i64 n, Nd d, const T* a, const T* b, u8* y) { compare_float<T>(op, n, d, a, b, y); }
FLOAT_TYPES(UNARY_FLOAT)

#define UNARY_INT(N, T) \
    extern "C" __global__ void unary_##N(int op, i64 n, const T* x, T* y) { unary_int<T>(op, n, x, y); } \
    extern "C" __global__ void binary_##N(int op, i64 n, Nd d, const T* a, const T* b, T* y, int* err, int code) { binary_int<T>(op, n, d, a, b, y, err, code); } \
    extern "C" __global__ void compare_##N(int op, i64 n, Nd d, const T* a, const T* b, u8* y) { compare_int<T>(op, n, d, a, b, y); }
INT_TYPES(UNARY_INT)

extern "C" __global__ void unary_b8(int op, i64 n, const u8* x, u8* y) {
    // Not (19) negates; Abs and Sign of a bool are the bool
    GRID_LOOP(i, n) { y[i] = op == 19 ? (x[i] ? 0 : 1) : x[i]; }
}
extern "C" __global__ void binary_b8(int op, i64 n, Nd d, const u8* a, const u8* b, u8* y, int* err, int code) {
    binary_bool(op, n, d, a, b, y);
}
extern "C" __global__ void compare_b8(int op, i64 n, Nd d, const u8* a, const u8* b, u8* y) {
    binary_bool(op, n, d, a, b, y);
}

#define WHERE_FILL(N, T) \
    extern "C" __global__ void where_##N(i64 n, Nd d, const u8* c, const T* x, const T* y, T* out) { where_k<T>(n, d, c, x, y, out); } \
    extern "C" __global__ void fill_##N(i64 n, T v, T* y) { fill_k<T>(n, v, y); }
ALL_TYPES(WHERE_FILL)

#define CAST_TO(NS, S) \
    extern "C" __global__ void cast_##NS##_f32(i64 n, const S* x, float* y) { cast_k<S, float>(n, x, y); } \
    extern "C" __global__ void cast_##NS##_bf16(i64 n, const S* x, bf16* y) { cast_k<S, bf16>(n, x, y); } \
    extern "C" __global__ void cast_##NS##_f16(i64 n, const S* x, f16* y) { cast_k<S, f16>(n, x, y); } \
    extern "C" __global__ void cast_##NS##_i64(i64 n, const S* x, i64* y) { cast_k<S, i64>(n, x, y); } \
    extern "C" __global__ void cast_##NS##_i32(i64 n, const S* x, i32* y) { cast_k<S, i32>(n, x, y); } \
    extern "C" __global__ void cast_##NS##_b8(i64 n, const S* x, u8* y) { cast_k<S, u8>(n, x, y); }
ALL_TYPES(CAST_TO)
