// Mixture of experts with static shapes: MoeDispatch (slot assignment, then the rows copied
// into the zeroed [E,C,H] buffer), MoeCombine and MoeCombineGrad. Every value equals the CPU
// kernels' (runtime/kernels/src/cpu/moe.rs) bit for bit: the slots are GShard's priority
// rule exactly, and every float is computed in f32 (bf16/f16 widened, rounded once on
// store) with the CPU's operations in the CPU's order. A bad expert index or slot sets the
// error word (`fail`) and is skipped: nothing is read or written out of bounds.

// The row of [E,C,H] that choice `at` reads ((e * C + s) * H), or -1 when the choice was
// dropped (slot -1) or is bad (reported).
__device__ __forceinline__ i64 moe_row(i64 at, i64 experts, i64 capacity, i64 h, const void* idx,
                                       int idx64, const i64* slots, int* err, int code) {
    const i64 s = slots[at];
    if (s == -1) return -1;
    const i64 e = load_index(idx, idx64, at);
    if (s < 0 || s >= capacity || e < 0 || e >= experts) { fail(err, code); return -1; }
    return (e * capacity + s) * h;
}

// The slots: thread e (one per expert) walks the [T,K] choices in priority order (column j
// of every token before column j + 1, tokens in order) and numbers the ones that name e,
// -1 once `capacity` are taken -- the CPU's `assign_slots` with one counter per thread
// instead of a shared table, so the result is the same whatever the launch. A warp reads
// the same choice at the same time (one broadcast load), MOE_BATCH tokens' choices loaded
// before any is numbered so the loads overlap. Thread 0 also marks the choices whose expert
// is out of range (slot -1) and reports them.
#define MOE_BATCH 16
extern "C" __global__ void moe_slots(i64 t, i64 k, i64 experts, i64 capacity, const void* idx,
                                     int idx64, i64* slots, int* err, int code) {
    GRID_LOOP(e, experts) {
        i64 fill = 0;
        for (i64 j = 0; j < k; ++j) {
            for (i64 t0 = 0; t0 < t; t0 += MOE_BATCH) {
                const int m = t - t0 < MOE_BATCH ? (int)(t - t0) : MOE_BATCH;
                i64 x[MOE_BATCH];
                for (int q = 0; q < MOE_BATCH; ++q) {
                    if (q < m) x[q] = load_index(idx, idx64, (t0 + q) * k + j);
                }
                for (int q = 0; q < m; ++q) {
                    const i64 at = (t0 + q) * k + j;
                    if (x[q] == e) {
                        slots[at] = fill < capacity ? fill++ : -1;
                    } else if (e == 0 && (x[q] < 0 || x[q] >= experts)) {
                        fail(err, code);
                        slots[at] = -1;
                    }
                }
            }
        }
    }
}

// The dispatch's copy, one thread per element of the [T,K,H] rows: a kept choice's token
// row into its buffer row (a row has one writer: each expert numbers its choices once).
// The buffer was zeroed first (`moe_zero`), so rows no choice fills stay zero.
template <typename E>
__device__ void moe_dispatch_k(i64 t, i64 k, i64 experts, i64 capacity, i64 h, const void* idx,
                               int idx64, const i64* slots, const E* x, E* buf) {
    GRID_LOOP(i, t * k * h) {
        const i64 at = i / h, c = i - at * h;
        const i64 s = slots[at];
        const i64 e = load_index(idx, idx64, at);
        // (moe_slots gives -1 or a slot below the capacity, and -1 for a bad expert)
        if (s < 0 || s >= capacity || e < 0 || e >= experts) continue;
        buf[(e * capacity + s) * h + c] = x[(at / k) * h + c];
    }
}

template <typename E>
__device__ void moe_zero_k(i64 n, E* y) {
    GRID_LOOP(i, n) { y[i] = (E)0; }
}

// MoeCombine, one thread per element of y [T,H]: from zero, for j = 0..K in order, plus
// weight * expert row (the product rounded, then the sum: no contraction), as the CPU.
template <typename T>
__device__ void moe_combine_k(i64 t, i64 k, i64 experts, i64 capacity, i64 h, const void* idx,
                              int idx64, const i64* slots, const T* ye, const T* w, T* y,
                              int* err, int code) {
    GRID_LOOP(i, t * h) {
        const i64 tok = i / h, c = i - tok * h;
        float acc = 0.0f;
        for (i64 j = 0; j < k; ++j) {
            const i64 at = tok * k + j;
            const i64 row = moe_row(at, experts, capacity, h, idx, idx64, slots, err, code);
            if (row < 0) continue;
            acc = acc + to_f(w[at]) * to_f(ye[row + c]);
        }
        y[i] = from_f<T>(acc);
    }
}

// MoeCombineGrad's d_expert_out, one thread per element of the [T,K,H] rows: a kept
// choice's row is weight * dy (added to the zero the CPU starts from; a row has one writer
// when the slots are MoeDispatch's). d_expert_out was zeroed first (`moe_zero`).
template <typename T>
__device__ void moe_combine_grad_rows_k(i64 t, i64 k, i64 experts, i64 capacity, i64 h,
                                        const void* idx, int idx64, const i64* slots, const T* w,
                                        const T* dy, T* dye, int* err, int code) {
    GRID_LOOP(i, t * k * h) {
        const i64 at = i / h, c = i - at * h;
        const i64 row = moe_row(at, experts, capacity, h, idx, idx64, slots, err, code);
        if (row < 0) continue;
        dye[row + c] = from_f<T>(0.0f + to_f(w[at]) * to_f(dy[(at / k) * h + c]));
    }
}

// MoeCombineGrad's d_weights, one thread per choice: dot(dy[t], expert row) summed from
// zero over the H elements in order, as the CPU; 0 for a dropped choice.
template <typename T>
__device__ void moe_combine_grad_weights_k(i64 t, i64 k, i64 experts, i64 capacity, i64 h,
                                           const void* idx, int idx64, const i64* slots,
                                           const T* ye, const T* dy, T* dw, int* err, int code) {
    GRID_LOOP(at, t * k) {
        const i64 row = moe_row(at, experts, capacity, h, idx, idx64, slots, err, code);
        float dot = 0.0f;
        if (row >= 0) {
            const T* g = dy + (at / k) * h;
            for (i64 c = 0; c < h; ++c) dot = dot + to_f(g[c]) * to_f(ye[row + c]);
        }
        dw[at] = from_f<T>(dot);
    }
}

#define MOE_MOVE(N, E) \
    extern "C" __global__ void moe_dispatch_##N(i64 t, i64 k, i64 experts, i64 capacity, i64 h, const void* idx, int idx64, const i64* slots, const E* x, E* buf) { moe_dispatch_k<E>(t, k, experts, capacity, h, idx, idx64, slots, x, buf); } \
    extern "C" __global__ void moe_zero_##N(i64 n, E* y) { moe_zero_k<E>(n, y); }
MOE_MOVE(b2, u16) MOE_MOVE(b4, u32)

#define MOE_FLOAT(N, T) \
    extern "C" __global__ void moe_combine_##N(i64 t, i64 k, i64 experts, i64 capacity, i64 h, const void* idx, int idx64, const i64* slots, const T* ye, const T* w, T* y, int* err, int code) { moe_combine_k<T>(t, k, experts, capacity, h, idx, idx64, slots, ye, w, y, err, code); } \
    extern "C" __global__ void moe_combine_grad_rows_##N(i64 t, i64 k, i64 experts, i64 capacity, i64 h, const void* idx, int idx64, const i64* slots, const T* w, const T* dy, T* dye, int* err, int code) { moe_combine_grad_rows_k<T>(t, k, experts, capacity, h, idx, idx64, slots, w, dy, dye, err, code); } \
    extern "C" __global__ void moe_combine_grad_weights_##N(i64 t, i64 k, i64 experts, i64 capacity, i64 h, const void* idx, int idx64, const i64* slots, const T* ye, const T* dy, T* dw, int* err, int code) { moe_combine_grad_weights_k<T>(t, k, experts, capacity, h, idx, idx64, slots, ye, dy, dw, err, code); }
MOE_FLOAT(f32, float) MOE_FLOAT(bf16, bf16) MOE_FLOAT(f16, f16)
