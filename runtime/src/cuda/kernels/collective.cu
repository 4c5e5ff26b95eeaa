// The reductions of the local device communicator (`hzp run --backend cuda
// --ranks-on-one-gpu`, runtime/src/cuda/transport.rs): `coll_acc_*` folds one member's
// elements into the partial result (member order is the caller's: one launch per member),
// `coll_scale_*` multiplies by a mean's 1/n (given in the dtype, rounded on the host as the
// CPU communicator rounds it). op: 0 sum (and mean), 1 prod, 2 max, 3 min; float max/min
// propagate NaN; integers wrap; bool sum/max are or, prod/min are and.

__device__ __forceinline__ float coll_f(int op, float a, float b) {
    switch (op) {
        case 1: return a * b;
        case 2: return nan_max(a, b);
        case 3: return nan_min(a, b);
        default: return a + b;
    }
}

template <typename T>
__device__ void coll_acc_float(int op, i64 n, T* dst, const T* src) {
    GRID_LOOP(i, n) { dst[i] = from_f<T>(coll_f(op, to_f(dst[i]), to_f(src[i]))); }
}

template <typename T>
__device__ void coll_acc_int(int op, i64 n, T* dst, const T* src) {
    typedef typename Uns<T>::t U;
    GRID_LOOP(i, n) {
        T a = dst[i];
        T b = src[i];
        T r;
        switch (op) {
            case 1: r = (T)((U)a * (U)b); break;
            case 2: r = a > b ? a : b; break;
            case 3: r = a < b ? a : b; break;
            default: r = (T)((U)a + (U)b); break;
        }
        dst[i] = r;
    }
}

#define COLL_FLOAT(N, T) \
    extern "C" __global__ void coll_acc_##N(int op, i64 n, T* dst, const T* src) { coll_acc_float<T>(op, n, dst, src); } \
    extern "C" __global__ void coll_scale_##N(i64 n, T* dst, T s) { \
        float k = to_f(s); \
        GRID_LOOP(i, n) { dst[i] = from_f<T>(to_f(dst[i]) * k); } \
    }
COLL_FLOAT(f32, float)
COLL_FLOAT(bf16, bf16)
COLL_FLOAT(f16, f16)

#define COLL_INT(N, T) \
    extern "C" __global__ void coll_acc_##N(int op, i64 n, T* dst, const T* src) { coll_acc_int<T>(op, n, dst, src); } \
    extern "C" __global__ void coll_scale_##N(i64 n, T* dst, T s) { \
        typedef typename Uns<T>::t U; \
        GRID_LOOP(i, n) { dst[i] = (T)((U)dst[i] * (U)s); } \
    }
COLL_INT(i64, i64)
COLL_INT(i32, i32)

extern "C" __global__ void coll_acc_b8(int op, i64 n, u8* dst, const u8* src) {
    GRID_LOOP(i, n) { dst[i] = (op == 1 || op == 3) ? (u8)(dst[i] & src[i]) : (u8)(dst[i] | src[i]); }
}
