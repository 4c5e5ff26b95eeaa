// Data movement and indexing. Movement kernels only move bytes, so they exist per element
// size (b1, b2, b4, b8) rather than per dtype.

// copy_nd: for every element of the walk's shape, out[s1 . c] = in[s0 . c'] where c' is c
// reduced modulo s2 on dims where s2 > 0 (Tile) -- Transpose, Slice (start folded into the
// base, step into the stride), Expand (stride 0), Tile, Concat/Split (one launch per piece).
template <typename E>
__device__ void copy_nd_k(i64 n, Nd d, i64 in_base, i64 out_base, const E* x, E* y) {
    GRID_LOOP(i, n) {
        i64 r = i, oi = in_base, oo = out_base;
        for (int k = d.rank - 1; k >= 0; --k) {
            i64 c;
            r = div_rem(r, d.shape[k], &c);
            i64 ci = d.s2[k] > 0 ? c % d.s2[k] : c;
            oi += ci * d.s0[k];
            oo += c * d.s1[k];
        }
        y[oo] = x[oi];
    }
}

// Trilu over the last two dims (rows x cols): keep the triangle, zero the rest.
template <typename E>
__device__ void trilu_k(i64 n, i64 rows, i64 cols, int upper, i64 k, const E* x, E* y) {
    GRID_LOOP(i, n) {
        i64 c = i % cols, r = (i / cols) % rows;
        bool keep = upper ? (c - r >= k) : (c - r <= k);
        y[i] = keep ? x[i] : (E)0;
    }
}

// Gather along an axis: out[o, j, i] = x[o, idx[j], i].
template <typename E>
__device__ void gather_k(i64 outer, i64 dim, i64 nidx, i64 inner, const void* idx, int idx64,
                         const E* x, E* y, int* err, int code) {
    GRID_LOOP(t, outer * nidx * inner) {
        i64 i = t % inner, j = (t / inner) % nidx, o = t / (inner * nidx);
        i64 w = wrap_index(load_index(idx, idx64, j), dim);
        if (w < 0) { fail(err, code); y[t] = (E)0; continue; }
        y[t] = x[(o * dim + w) * inner + i];
    }
}

// GatherElements: the walk is the indices' shape (s0: data strides); `axis` takes the index.
template <typename E>
__device__ void gather_elements_k(i64 n, Nd d, int axis, i64 dim, const void* idx, int idx64,
                                  const E* x, E* y, int* err, int code) {
    GRID_LOOP(i, n) {
        i64 w = wrap_index(load_index(idx, idx64, i), dim);
        if (w < 0) { fail(err, code); y[i] = (E)0; continue; }
        i64 r = i, off = 0;
        for (int k = d.rank - 1; k >= 0; --k) {
            i64 q = r / d.shape[k];
            i64 c = r - q * d.shape[k];
            r = q;
            off += (k == axis ? w : c) * d.s0[k];
        }
        y[i] = x[off];
    }
}

template <typename E> __device__ __forceinline__ E add_e(E a, E b) { return a + b; }
template <> __device__ __forceinline__ bf16 add_e<bf16>(bf16 a, bf16 b) { return from_f<bf16>(to_f(a) + to_f(b)); }
template <> __device__ __forceinline__ f16 add_e<f16>(f16 a, f16 b) { return from_f<f16>(to_f(a) + to_f(b)); }
template <> __device__ __forceinline__ i64 add_e<i64>(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
template <> __device__ __forceinline__ i32 add_e<i32>(i32 a, i32 b) { return (i32)((u32)a + (u32)b); }
template <> __device__ __forceinline__ u8 add_e<u8>(u8 a, u8 b) { return (a || b) ? 1 : 0; }

// ScatterElements into y (already a copy of the data). One thread per lane of the indices
// along `axis` (the walk d is the indices' shape with the axis dim set to 1; s0: data
// strides, s1: index/update strides); the lane's updates are applied in order, so repeated
// indices add (or overwrite) deterministically, exactly as the sequential CPU kernel.
template <typename E>
__device__ void scatter_elements_k(i64 lanes, Nd d, int axis, i64 naxis, i64 dim, const void* idx,
                                   int idx64, const E* upd, E* y, int add, int* err, int code) {
    GRID_LOOP(l, lanes) {
        i64 r = l, dbase = 0, ubase = 0;
        for (int k = d.rank - 1; k >= 0; --k) {
            i64 q = r / d.shape[k];
            i64 c = r - q * d.shape[k];
            r = q;
            dbase += c * d.s0[k];
            ubase += c * d.s1[k];
        }
        for (i64 a = 0; a < naxis; ++a) {
            i64 u = ubase + a * d.s1[axis];
            i64 w = wrap_index(load_index(idx, idx64, u), dim);
            if (w < 0) { fail(err, code); continue; }
            i64 at = dbase + w * d.s0[axis];
            y[at] = add ? add_e<E>(y[at], upd[u]) : upd[u];
        }
    }
}

// GatherND: tuples of `last` indices (into data dims b..b+last) select slices of `slice`
// elements; dims[k] and strides[k] (in d.shape / d.s0) describe those data dims.
template <typename E>
__device__ void gather_nd_k(i64 n, i64 slice, i64 tuples_per_batch, i64 batch_stride, int last,
                            Nd d, const void* idx, int idx64, const E* x, E* y, int* err, int code) {
    GRID_LOOP(i, n) {
        i64 t = i / slice, e = i - t * slice;
        i64 off = (t / tuples_per_batch) * batch_stride + e;
        bool bad = false;
        for (int k = 0; k < last; ++k) {
            i64 w = wrap_index(load_index(idx, idx64, t * last + k), d.shape[k]);
            if (w < 0) { bad = true; break; }
            off += w * d.s0[k];
        }
        if (bad) { fail(err, code); y[i] = (E)0; continue; }
        y[i] = x[off];
    }
}

// ScatterND into y (already a copy of the data): one thread per slice element, looping over
// the tuples in order (deterministic with repeated indices: the embedding gradient).
template <typename E>
__device__ void scatter_nd_k(i64 slice, i64 tuples, int last, Nd d, const void* idx, int idx64,
                             const E* upd, E* y, int add, int* err, int code) {
    GRID_LOOP(e, slice) {
        for (i64 t = 0; t < tuples; ++t) {
            i64 off = e;
            bool bad = false;
            for (int k = 0; k < last; ++k) {
                i64 w = wrap_index(load_index(idx, idx64, t * last + k), d.shape[k]);
                if (w < 0) { bad = true; break; }
                off += w * d.s0[k];
            }
            if (bad) { fail(err, code); continue; }
            E u = upd[t * slice + e];
            y[off] = add ? add_e<E>(y[off], u) : u;
        }
    }
}

// OneHot: out[o, k, i] = on where idx[o, i] (wrapped once into [0, depth)) == k, else off.
template <typename E>
__device__ void one_hot_k(i64 outer, i64 depth, i64 inner, const void* idx, int idx64,
                          const E* values, E* y) {
    GRID_LOOP(t, outer * depth * inner) {
        i64 i = t % inner, k = (t / inner) % depth, o = t / (inner * depth);
        i64 j = load_index(idx, idx64, o * inner + i);
        if (j < 0) j += depth;
        y[t] = (j == k) ? values[1] : values[0];
    }
}

// TopK per lane by repeated selection in the total order (value, with NaN above everything,
// descending when `largest`; then the lower position first) -- the CPU kernel's order.
template <typename C> __device__ __forceinline__ int cmp_v(C a, C b) { return a < b ? -1 : (a > b ? 1 : 0); }
template <> __device__ __forceinline__ int cmp_v<float>(float a, float b) {
    bool na = is_nan(a), nb = is_nan(b);
    if (na || nb) return na == nb ? 0 : (na ? 1 : -1);
    return a < b ? -1 : (a > b ? 1 : 0);
}

template <typename T, typename C>
__device__ void topk_k(i64 outer, i64 dim, i64 inner, i64 k, int largest, const T* x, T* vals, i64* ids) {
    GRID_LOOP(lane, outer * inner) {
        i64 o = lane / inner, in = lane - o * inner;
        i64 base = o * dim * inner + in;
        i64 prev = -1;
        for (i64 j = 0; j < k; ++j) {
            i64 best = -1;
            for (i64 d = 0; d < dim; ++d) {
                C v = as_c(x[base + d * inner]);
                // strictly after the previous pick in the order?
                if (prev >= 0) {
                    int c = cmp_v<C>(v, as_c(x[base + prev * inner]));
                    if (largest) c = -c;
                    if (c < 0 || (c == 0 && d <= prev)) continue;
                }
                if (best < 0) { best = d; continue; }
                int c = cmp_v<C>(v, as_c(x[base + best * inner]));
                if (largest) c = -c;
                if (c < 0) best = d;  // ties keep the lower position
            }
            i64 out = (o * k + j) * inner + in;
            ids[out] = best;
            vals[out] = x[base + best * inner];
            prev = best;
        }
    }
}

#define MOVE(N, E) \
    extern "C" __global__ void copy_nd_##N(i64 n, Nd d, i64 ib, i64 ob, const E* x, E* y) { copy_nd_k<E>(n, d, ib, ob, x, y); } \
    extern "C" __global__ void trilu_##N(i64 n, i64 rows, i64 cols, int upper, i64 k, const E* x, E* y) { trilu_k<E>(n, rows, cols, upper, k, x, y); } \
    extern "C" __global__ void gather_##N(i64 outer, i64 dim, i64 nidx, i64 inner, const void* idx, int idx64, const E* x, E* y, int* err, int code) { gather_k<E>(outer, dim, nidx, inner, idx, idx64, x, y, err, code); } \
    extern "C" __global__ void gather_elements_##N(i64 n, Nd d, int axis, i64 dim, const void* idx, int idx64, const E* x, E* y, int* err, int code) { gather_elements_k<E>(n, d, axis, dim, idx, idx64, x, y, err, code); } \
    extern "C" __global__ void gather_nd_##N(i64 n, i64 slice, i64 tpb, i64 bs, int last, Nd d, const void* idx, int idx64, const E* x, E* y, int* err, int code) { gather_nd_k<E>(n, slice, tpb, bs, last, d, idx, idx64, x, y, err, code); }
MOVE(b1, u8) MOVE(b2, u16) MOVE(b4, u32) MOVE(b8, u64)

#define SCATTER(N, T) \
    extern "C" __global__ void scatter_elements_##N(i64 lanes, Nd d, int axis, i64 naxis, i64 dim, const void* idx, int idx64, const T* upd, T* y, int add, int* err, int code) { scatter_elements_k<T>(lanes, d, axis, naxis, dim, idx, idx64, upd, y, add, err, code); } \
    extern "C" __global__ void scatter_nd_##N(i64 slice, i64 tuples, int last, Nd d, const void* idx, int idx64, const T* upd, T* y, int add, int* err, int code) { scatter_nd_k<T>(slice, tuples, last, d, idx, idx64, upd, y, add, err, code); } \
    extern "C" __global__ void one_hot_##N(i64 outer, i64 depth, i64 inner, const void* idx, int idx64, const T* v, T* y) { one_hot_k<T>(outer, depth, inner, idx, idx64, v, y); }
ALL_TYPES(SCATTER)

#define TOPK(N, T, C) \
    extern "C" __global__ void topk_##N(i64 outer, i64 dim, i64 inner, i64 k, int largest, const T* x, T* v, i64* ids) { topk_k<T, C>(outer, dim, inner, k, largest, x, v, ids); }
TOPK(f32, float, float) TOPK(bf16, bf16, float) TOPK(f16, f16, float) TOPK(i64, i64, i64) TOPK(i32, i32, i32) TOPK(b8, u8, int)
