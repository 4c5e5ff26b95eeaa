// Softmax / LogSoftmax, LayerNorm / RmsNorm, Reduce, ArgMax and CumSum. Lanes are described as
// (outer, dim, inner): element (o, d, i) is at (o * dim + d) * inner + i. Blocks of
// REDUCE_THREADS threads reduce one lane (or one output) in a fixed tree, so results do not
// depend on scheduling.

#define REDUCE_THREADS 256

template <typename T>
__device__ void softmax_k(i64 outer, i64 dim, i64 inner, int log, const T* x, T* y) {
    __shared__ double shd[REDUCE_THREADS];
    __shared__ float shf[REDUCE_THREADS];
    for (i64 lane = blockIdx.x; lane < outer * inner; lane += gridDim.x) {
        i64 o = lane / inner, in = lane - o * inner;
        i64 base = o * dim * inner + in;
        float m = -__int_as_float(0x7f800000);
        for (i64 d = threadIdx.x; d < dim; d += blockDim.x) {
            float v = to_f(x[base + d * inner]);
            if (v > m || is_nan(v)) m = is_nan(m) ? m : v;
        }
        m = block_max(m, shf);
        double s = 0.0;
        for (i64 d = threadIdx.x; d < dim; d += blockDim.x) s += (double)expf(to_f(x[base + d * inner]) - m);
        s = block_sum(s, shd);
        if (log) {
            float lse = (float)::log(s);
            for (i64 d = threadIdx.x; d < dim; d += blockDim.x)
                y[base + d * inner] = from_f<T>((to_f(x[base + d * inner]) - m) - lse);
        } else {
            float inv = (float)(1.0 / s);
            for (i64 d = threadIdx.x; d < dim; d += blockDim.x)
                y[base + d * inner] = from_f<T>(expf(to_f(x[base + d * inner]) - m) * inv);
        }
    }
}

// Softmax cross-entropy over lanes of `dim` classes (as softmax_k walks them), lane k with
// label idx[k]: grad == 0 writes the loss y[k] = m + log(sum exp(x - m)) - x[label];
// grad != 0 writes the lane's gradient (softmax(x) - onehot(label)) * dy[k]. A label
// outside 0..dim fails with `code` (no wrapping) and leaves zeros.
template <typename T>
__device__ void xent_k(i64 outer, i64 dim, i64 inner, int grad, const T* x, const void* idx,
                       int idx64, const T* dy, T* y, int* err, int code) {
    __shared__ double shd[REDUCE_THREADS];
    __shared__ float shf[REDUCE_THREADS];
    for (i64 lane = blockIdx.x; lane < outer * inner; lane += gridDim.x) {
        i64 o = lane / inner, in = lane - o * inner;
        i64 base = o * dim * inner + in;
        i64 l = load_index(idx, idx64, lane);
        float m = -__int_as_float(0x7f800000);
        for (i64 d = threadIdx.x; d < dim; d += blockDim.x) {
            float v = to_f(x[base + d * inner]);
            if (v > m) m = v;
        }
        m = block_max(m, shf);
        double s = 0.0;
        for (i64 d = threadIdx.x; d < dim; d += blockDim.x) s += (double)expf(to_f(x[base + d * inner]) - m);
        s = block_sum(s, shd);
        if (l < 0 || l >= dim) {
            if (threadIdx.x == 0) fail(err, code);
            if (!grad) {
                if (threadIdx.x == 0) y[lane] = from_f<T>(0.0f);
            } else {
                for (i64 d = threadIdx.x; d < dim; d += blockDim.x) y[base + d * inner] = from_f<T>(0.0f);
            }
            continue;
        }
        if (!grad) {
            if (threadIdx.x == 0)
                y[lane] = from_f<T>((float)((double)m + log(s) - (double)to_f(x[base + l * inner])));
        } else {
            float g = to_f(dy[lane]);
            float scale = (float)((double)g / s);
            for (i64 d = threadIdx.x; d < dim; d += blockDim.x) {
                float v = expf(to_f(x[base + d * inner]) - m) * scale;
                if (d == l) v -= g;
                y[base + d * inner] = from_f<T>(v);
            }
        }
    }
}

// One row's mean (0 for rms) and 1 / sqrt(variance + eps), summed in f64 over the block:
// what norm_k normalizes with and norm_grad_k recomputes.
template <typename T>
__device__ void row_stats(const T* xr, i64 d, float eps, int rms, double* shd, float* mean_out,
                          float* rstd_out) {
    float mean = 0.0f;
    if (!rms) {
        double s = 0.0;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += (double)to_f(xr[j]);
        mean = (float)(block_sum(s, shd) / (double)d);
    }
    double v = 0.0;
    for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
        double c = (double)(to_f(xr[j]) - mean);
        v += c * c;
    }
    double var = block_sum(v, shd) / (double)d;
    *mean_out = mean;
    *rstd_out = (float)(1.0 / sqrt(var + (double)eps));
}

// Rows of d elements; scale (and bias) indexed through the walk p over the normalized dims
// (p.s0: scale strides, p.s1: bias strides, 0 where they broadcast).
template <typename T>
__device__ void norm_k(i64 rows, i64 d, float eps, int rms, Nd p, const T* x, const T* scale,
                       const T* bias, T* y) {
    __shared__ double shd[REDUCE_THREADS];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        T* yr = y + r * d;
        float mean, rstd;
        row_stats(xr, d, eps, rms, shd, &mean, &rstd);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            i64 os, ob, o2, o3;
            nd_offsets(p, j, &os, &ob, &o2, &o3);
            float out = (to_f(xr[j]) - mean) * rstd * to_f(scale[os]);
            if (bias) out += to_f(bias[ob]);
            yr[j] = from_f<T>(out);
        }
    }
}

// The gradient of norm_k: rows of d elements, the statistics recomputed as norm_k computes
// them; g = dy * scale; dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (rms: without
// mean(g)); yh = dy * xhat. Scale indexed through the walk p (p.s0) as in norm_k.
template <typename T>
__device__ void norm_grad_k(i64 rows, i64 d, float eps, int rms, Nd p, const T* x, const T* scale,
                            const T* dy, T* dx, T* yh) {
    __shared__ double shd[REDUCE_THREADS];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * d;
        const T* gr = dy + r * d;
        float mean, rstd;
        row_stats(xr, d, eps, rms, shd, &mean, &rstd);
        double sg = 0.0, sgx = 0.0;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            i64 os, o1, o2, o3;
            nd_offsets(p, j, &os, &o1, &o2, &o3);
            float xh = (to_f(xr[j]) - mean) * rstd;
            float g = to_f(gr[j]) * to_f(scale[os]);
            yh[r * d + j] = from_f<T>(to_f(gr[j]) * xh);
            sg += (double)g;
            sgx += (double)(g * xh);
        }
        float mg = rms ? 0.0f : (float)(block_sum(sg, shd) / (double)d);
        float mgx = (float)(block_sum(sgx, shd) / (double)d);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            i64 os, o1, o2, o3;
            nd_offsets(p, j, &os, &o1, &o2, &o3);
            float xh = (to_f(xr[j]) - mean) * rstd;
            float g = to_f(gr[j]) * to_f(scale[os]);
            dx[r * d + j] = from_f<T>(rstd * (g - mg - xh * mgx));
        }
    }
}

// Reduce: output k = walk `kept` (s0: input strides of the kept dims); reduced element j =
// walk `red` (s0: input strides of the reduced dims).
// op: 0 sum, 1 mean, 2 max, 3 min, 4 prod (hzp_ir's ReduceOp::ALL order).
template <typename T>
__device__ void reduce_float(int op, i64 nout, i64 nred, Nd kept, Nd red, const T* x, T* y) {
    __shared__ double shd[REDUCE_THREADS];
    __shared__ float shf[REDUCE_THREADS];
    for (i64 k = blockIdx.x; k < nout; k += gridDim.x) {
        i64 base, t1, t2, t3;
        nd_offsets(kept, k, &base, &t1, &t2, &t3);
        if (op == 2 || op == 3) {
            float acc = op == 2 ? -__int_as_float(0x7f800000) : __int_as_float(0x7f800000);
            for (i64 j = threadIdx.x; j < nred; j += blockDim.x) {
                i64 off, a, b, c;
                nd_offsets(red, j, &off, &a, &b, &c);
                float v = to_f(x[base + off]);
                acc = op == 2 ? nan_max(acc, v) : nan_min(acc, v);
            }
            // a max tree of -x gives the min
            float r = op == 2 ? block_max(acc, shf) : -block_max(-acc, shf);
            if (threadIdx.x == 0) y[k] = from_f<T>(r);
        } else if (op == 4) {
            double acc = 1.0;
            for (i64 j = threadIdx.x; j < nred; j += blockDim.x) {
                i64 off, a, b, c;
                nd_offsets(red, j, &off, &a, &b, &c);
                acc *= (double)to_f(x[base + off]);
            }
            shd[threadIdx.x] = acc;
            __syncthreads();
            for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
                if (threadIdx.x < s) shd[threadIdx.x] *= shd[threadIdx.x + s];
                __syncthreads();
            }
            if (threadIdx.x == 0) y[k] = from_f<T>((float)shd[0]);
            __syncthreads();
        } else {
            double acc = 0.0;
            for (i64 j = threadIdx.x; j < nred; j += blockDim.x) {
                i64 off, a, b, c;
                nd_offsets(red, j, &off, &a, &b, &c);
                acc += (double)to_f(x[base + off]);
            }
            double s = block_sum(acc, shd);
            if (op == 1) s /= (double)nred;
            if (threadIdx.x == 0) y[k] = from_f<T>((float)s);
        }
    }
}

// Integers (wrapping sum/prod) and bools (sum/max = or, prod/min = and): one thread per
// output, sequential (integer results do not depend on the order).
template <typename T>
__device__ void reduce_int(int op, i64 nout, i64 nred, Nd kept, Nd red, const T* x, T* y) {
    typedef typename Uns<T>::t U;
    GRID_LOOP(k, nout) {
        i64 base, t1, t2, t3;
        nd_offsets(kept, k, &base, &t1, &t2, &t3);
        U acc = op == 4 ? 1 : 0;
        T m = 0;
        for (i64 j = 0; j < nred; ++j) {
            i64 off, a, b, c;
            nd_offsets(red, j, &off, &a, &b, &c);
            T v = x[base + off];
            if (j == 0) m = v;
            if (op == 0) acc += (U)v;
            else if (op == 4) acc *= (U)v;
            else if (op == 2) m = v > m ? v : m;
            else if (op == 3) m = v < m ? v : m;
        }
        if (op == 2 || op == 3) {
            if (nred == 0) m = op == 2 ? (T)((U)1 << (sizeof(T) * 8 - 1)) : (T)~((U)1 << (sizeof(T) * 8 - 1));
            y[k] = m;
        } else {
            y[k] = (T)acc;
        }
    }
}

__device__ void reduce_bool(int op, i64 nout, i64 nred, Nd kept, Nd red, const u8* x, u8* y) {
    GRID_LOOP(k, nout) {
        i64 base, t1, t2, t3;
        nd_offsets(kept, k, &base, &t1, &t2, &t3);
        bool any_op = (op == 0 || op == 2);
        bool acc = !any_op;
        for (i64 j = 0; j < nred; ++j) {
            i64 off, a, b, c;
            nd_offsets(red, j, &off, &a, &b, &c);
            bool v = x[base + off] != 0;
            acc = any_op ? (acc || v) : (acc && v);
        }
        y[k] = acc ? 1 : 0;
    }
}

// ArgMax: index of the first maximum; NaN counts as the maximum (like PyTorch).
template <typename T> __device__ __forceinline__ bool better(T a, T b) { return a > b; }
template <> __device__ __forceinline__ bool better<float>(float a, float b) { return !is_nan(b) && (is_nan(a) || a > b); }

template <typename T, typename C>
__device__ void argmax_k(i64 outer, i64 dim, i64 inner, const T* x, i64* y) {
    GRID_LOOP(lane, outer * inner) {
        i64 o = lane / inner, in = lane - o * inner;
        i64 base = o * dim * inner + in;
        C best = as_c(x[base]);
        i64 bi = 0;
        for (i64 d = 1; d < dim; ++d) {
            C c = as_c(x[base + d * inner]);
            if (better<C>(c, best)) { best = c; bi = d; }
        }
        y[lane] = bi;
    }
}

// CumSum along the lane, sequential per lane; floats accumulate in f64.
template <typename T>
__device__ void cumsum_float(i64 outer, i64 dim, i64 inner, int exclusive, int reverse, const T* x, T* y) {
    GRID_LOOP(lane, outer * inner) {
        i64 o = lane / inner, in = lane - o * inner;
        i64 base = o * dim * inner + in;
        double acc = 0.0;
        for (i64 s = 0; s < dim; ++s) {
            i64 d = reverse ? dim - 1 - s : s;
            i64 at = base + d * inner;
            float v = to_f(x[at]);
            if (exclusive) { y[at] = from_f<T>((float)acc); acc += (double)v; }
            else { acc += (double)v; y[at] = from_f<T>((float)acc); }
        }
    }
}

template <typename T>
__device__ void cumsum_int(i64 outer, i64 dim, i64 inner, int exclusive, int reverse, const T* x, T* y) {
    typedef typename Uns<T>::t U;
    GRID_LOOP(lane, outer * inner) {
        i64 o = lane / inner, in = lane - o * inner;
        i64 base = o * dim * inner + in;
        U acc = 0;
        for (i64 s = 0; s < dim; ++s) {
            i64 d = reverse ? dim - 1 - s : s;
            i64 at = base + d * inner;
            T v = x[at];
            if (exclusive) { y[at] = (T)acc; acc += (U)v; }
            else { acc += (U)v; y[at] = (T)acc; }
        }
    }
}

#define NORM_FLOAT(N, T) \
    extern "C" __global__ void softmax_##N(i64 outer, i64 dim, i64 inner, int log, const T* x, T* y) { softmax_k<T>(outer, dim, inner, log, x, y); } \
    extern "C" __global__ void xent_##N(i64 outer, i64 dim, i64 inner, int grad, const T* x, const void* idx, int idx64, const T* dy, T* y, int* err, int code) { xent_k<T>(outer, dim, inner, grad, x, idx, idx64, dy, y, err, code); } \
    extern "C" __global__ void norm_##N(i64 rows, i64 d, float eps, int rms, Nd p, const T* x, const T* s, const T* b, T* y) { norm_k<T>(rows, d, eps, rms, p, x, s, b, y); } \
    extern "C" __global__ void norm_grad_##N(i64 rows, i64 d, float eps, int rms, Nd p, const T* x, const T* s, const T* dy, T* dx, T* yh) { norm_grad_k<T>(rows, d, eps, rms, p, x, s, dy, dx, yh); } \
    extern "C" __global__ void reduce_##N(int op, i64 nout, i64 nred, Nd kept, Nd red, const T* x, T* y) { reduce_float<T>(op, nout, nred, kept, red, x, y); } \
    extern "C" __global__ void argmax_##N(i64 outer, i64 dim, i64 inner, const T* x, i64* y) { argmax_k<T, float>(outer, dim, inner, x, y); } \
    extern "C" __global__ void cumsum_##N(i64 outer, i64 dim, i64 inner, int ex, int rev, const T* x, T* y) { cumsum_float<T>(outer, dim, inner, ex, rev, x, y); }
FLOAT_TYPES(NORM_FLOAT)

#define REDUCE_INT(N, T) \
    extern "C" __global__ void reduce_##N(int op, i64 nout, i64 nred, Nd kept, Nd red, const T* x, T* y) { reduce_int<T>(op, nout, nred, kept, red, x, y); } \
    extern "C" __global__ void argmax_##N(i64 outer, i64 dim, i64 inner, const T* x, i64* y) { argmax_k<T, T>(outer, dim, inner, x, y); } \
    extern "C" __global__ void cumsum_##N(i64 outer, i64 dim, i64 inner, int ex, int rev, const T* x, T* y) { cumsum_int<T>(outer, dim, inner, ex, rev, x, y); }
INT_TYPES(REDUCE_INT)

extern "C" __global__ void reduce_b8(int op, i64 nout, i64 nred, Nd kept, Nd red, const u8* x, u8* y) {
    reduce_bool(op, nout, nred, kept, red, x, y);
}
extern "C" __global__ void argmax_b8(i64 outer, i64 dim, i64 inner, const u8* x, i64* y) {
    argmax_k<u8, int>(outer, dim, inner, x, y);
}
