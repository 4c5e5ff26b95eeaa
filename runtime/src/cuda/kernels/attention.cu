// hzp CUDA kernels: fused scaled dot-product attention (Attention / AttentionGrad), tiled
// with an online softmax as FlashAttention does it: no T x S score or probability matrix is
// stored, only each row's log-sum-exp (f32). Layouts: q [B, HQ, T, D], k [B, HKV, S, D],
// v [B, HKV, S, DV], o / do [B, HQ, T, DV], lse [B, HQ, T]; query head h reads key/value
// head h / (HQ / HKV). An optional additive mask is read through element strides
// (mb, mh, mt, ms; 0 on a broadcast axis). `causal`: key j is seen by query i when j <= i
// (top-left aligned); key tiles past a query tile's last row are skipped.
//
// Threads: a block is AT_WARPS warps; in the forward and the dq kernel each warp owns
// AT_RPW query rows of the block's AT_BR-row tile, in the dk/dv kernel AT_KPW keys of the
// block's AT_BK-key tile. A row's head-dimension elements are spread over the warp's
// lanes (lane l holds elements l, l + 32, ...; D and DV at most AT_DMAX). Dot products sum
// the lanes' partial sums in a fixed butterfly and take lane 0's result, so every lane sees
// the same bits and the results do not depend on the launch's timing. Values compute in f32
// (bf16 / f16 widened), like the other kernels.
//
// A fully masked row (every score -inf) gives zeros, lse = -inf and no gradient, as the
// CPU kernel and PyTorch's SDPA do.

#define AT_BR 16
#define AT_BC 16
#define AT_WARPS 4
#define AT_RPW (AT_BR / AT_WARPS)
#define AT_DMAX 256
#define AT_EPL (AT_DMAX / 32)
#define AT_BK 8
#define AT_KPW (AT_BK / AT_WARPS)
#define AT_BQ 8

__device__ __forceinline__ float at_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ float at_neg_inf() { return -__int_as_float(0x7f800000); }

struct AtDims {
    i64 b, hq, hkv, t, s, d, dv;
    float scale;
    int causal;
    i64 mb, mh, mt, ms;
};

template <typename T>
__device__ __forceinline__ float at_mask(const T* mask, const AtDims& a, i64 b, i64 h, i64 i, i64 j) {
    return mask ? to_f(mask[b * a.mb + h * a.mh + i * a.mt + j * a.ms]) : 0.0f;
}

// Loads rows [r0, r0 + n) (n <= rows) of a [.., len] matrix at `src` into `dst[rows][AT_DMAX]`
// as f32, zeros past the end of each row and past row n (the lanes' dot products read all
// AT_DMAX columns).
template <typename T>
__device__ __forceinline__ void at_load(float (*dst)[AT_DMAX], int rows, const T* src, i64 r0, i64 n, i64 len) {
    for (i64 x = threadIdx.x; x < (i64)rows * AT_DMAX; x += blockDim.x) {
        i64 r = x / AT_DMAX, c = x - r * AT_DMAX;
        dst[r][c] = (r < n && c < len) ? to_f(src[(r0 + r) * len + c]) : 0.0f;
    }
}

// One query-row tile of one (batch, query head), as attn_fwd, attn_dq and attn_fwd_pasa walk
// them: block `blk` of `b * hq * tiles`. `kb`, `vb`: the K/V rows of the head's K/V head
// (grouped-query: hq / hkv query heads share one); `s_end`: the keys the tile sees (causal:
// none past its last row).
template <typename T>
struct AtRowTile {
    i64 b, h, bh, i0, s_end;
    const T* kb;
    const T* vb;
};

template <typename T>
__device__ __forceinline__ AtRowTile<T> at_row_tile(const AtDims& a, i64 blk, i64 tiles, const T* k, const T* v) {
    AtRowTile<T> t;
    const i64 tile = blk % tiles;
    t.bh = blk / tiles;
    t.h = t.bh % a.hq;
    t.b = t.bh / a.hq;
    const i64 hk = t.h / (a.hq / a.hkv);
    t.kb = k + (t.b * a.hkv + hk) * a.s * a.d;
    t.vb = v + (t.b * a.hkv + hk) * a.s * a.dv;
    t.i0 = tile * AT_BR;
    const i64 last = (t.i0 + AT_BR < a.t ? t.i0 + AT_BR : a.t) - 1;
    t.s_end = (a.causal && last + 1 < a.s) ? last + 1 : a.s;
    return t;
}

template <typename T>
__device__ void attn_fwd_k(AtDims a, const T* q, const T* k, const T* v, const T* mask, T* o, float* lse) {
    __shared__ float ks[AT_BC][AT_DMAX];
    __shared__ float vs[AT_BC][AT_DMAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 tiles = (a.t + AT_BR - 1) / AT_BR;
    for (i64 blk = blockIdx.x; blk < a.b * a.hq * tiles; blk += gridDim.x) {
        const AtRowTile<T> rt = at_row_tile(a, blk, tiles, k, v);
        const i64 b = rt.b, h = rt.h, bh = rt.bh, i0 = rt.i0, s_end = rt.s_end;
        const T* kb = rt.kb;
        const T* vb = rt.vb;
        float qr[AT_RPW][AT_EPL], acc[AT_RPW][AT_EPL], m[AT_RPW], l[AT_RPW];
        for (int r = 0; r < AT_RPW; ++r) {
            const i64 i = i0 + warp + (i64)r * AT_WARPS;
            m[r] = at_neg_inf();
            l[r] = 0.0f;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                qr[r][e] = (i < a.t && c < a.d) ? to_f(q[((bh * a.t) + i) * a.d + c]) : 0.0f;
                acc[r][e] = 0.0f;
            }
        }
        for (i64 j0 = 0; j0 < s_end; j0 += AT_BC) {
            const i64 jn = (a.s - j0 < AT_BC) ? a.s - j0 : AT_BC;
            __syncthreads();
            at_load(ks, AT_BC, kb, j0, jn, a.d);
            at_load(vs, AT_BC, vb, j0, jn, a.dv);
            __syncthreads();
            for (int r = 0; r < AT_RPW; ++r) {
                const i64 i = i0 + warp + (i64)r * AT_WARPS;
                if (i >= a.t) continue;
                for (i64 jj = 0; jj < jn; ++jj) {
                    const i64 j = j0 + jj;
                    if (a.causal && j > i) break;
                    float part = 0.0f;
                    for (int e = 0; e < AT_EPL; ++e) part += qr[r][e] * ks[jj][lane + 32 * e];
                    const float sc = at_warp_sum(part) * a.scale + at_mask(mask, a, b, h, i, j);
                    if (sc == at_neg_inf()) continue;
                    const float mn = fmaxf(m[r], sc);
                    const float corr = expf(m[r] - mn);
                    const float p = expf(sc - mn);
                    l[r] = l[r] * corr + p;
                    for (int e = 0; e < AT_EPL; ++e) acc[r][e] = acc[r][e] * corr + p * vs[jj][lane + 32 * e];
                    m[r] = mn;
                }
            }
        }
        for (int r = 0; r < AT_RPW; ++r) {
            const i64 i = i0 + warp + (i64)r * AT_WARPS;
            if (i >= a.t) continue;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                if (c < a.dv) o[((bh * a.t) + i) * a.dv + c] = from_f<T>(acc[r][e] * inv);
            }
            if (lane == 0) lse[bh * a.t + i] = l[r] > 0.0f ? m[r] + logf(l[r]) : at_neg_inf();
        }
    }
}

// dq: per query row, D_i = dO_i . O_i, then over the keys p = exp(s - lse_i),
// ds = p (dO_i . v_j - D_i), dq_i += scale ds k_j.
template <typename T>
__device__ void attn_dq_k(AtDims a, const T* q, const T* k, const T* v, const T* o, const float* lse,
                          const T* dout, const T* mask, T* dq) {
    __shared__ float ks[AT_BC][AT_DMAX];
    __shared__ float vs[AT_BC][AT_DMAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 tiles = (a.t + AT_BR - 1) / AT_BR;
    for (i64 blk = blockIdx.x; blk < a.b * a.hq * tiles; blk += gridDim.x) {
        const AtRowTile<T> rt = at_row_tile(a, blk, tiles, k, v);
        const i64 b = rt.b, h = rt.h, bh = rt.bh, i0 = rt.i0, s_end = rt.s_end;
        const T* kb = rt.kb;
        const T* vb = rt.vb;
        float qr[AT_RPW][AT_EPL], dor[AT_RPW][AT_EPL], acc[AT_RPW][AT_EPL], di[AT_RPW], ls[AT_RPW];
        for (int r = 0; r < AT_RPW; ++r) {
            const i64 i = i0 + warp + (i64)r * AT_WARPS;
            const bool in = i < a.t;
            float part = 0.0f;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                qr[r][e] = (in && c < a.d) ? to_f(q[((bh * a.t) + i) * a.d + c]) : 0.0f;
                dor[r][e] = (in && c < a.dv) ? to_f(dout[((bh * a.t) + i) * a.dv + c]) : 0.0f;
                const float ov = (in && c < a.dv) ? to_f(o[((bh * a.t) + i) * a.dv + c]) : 0.0f;
                part += dor[r][e] * ov;
                acc[r][e] = 0.0f;
            }
            di[r] = at_warp_sum(part);
            ls[r] = in ? lse[bh * a.t + i] : at_neg_inf();
        }
        for (i64 j0 = 0; j0 < s_end; j0 += AT_BC) {
            const i64 jn = (a.s - j0 < AT_BC) ? a.s - j0 : AT_BC;
            __syncthreads();
            at_load(ks, AT_BC, kb, j0, jn, a.d);
            at_load(vs, AT_BC, vb, j0, jn, a.dv);
            __syncthreads();
            for (int r = 0; r < AT_RPW; ++r) {
                const i64 i = i0 + warp + (i64)r * AT_WARPS;
                if (i >= a.t || ls[r] == at_neg_inf()) continue;
                for (i64 jj = 0; jj < jn; ++jj) {
                    const i64 j = j0 + jj;
                    if (a.causal && j > i) break;
                    float sp = 0.0f, dp = 0.0f;
                    for (int e = 0; e < AT_EPL; ++e) {
                        sp += qr[r][e] * ks[jj][lane + 32 * e];
                        dp += dor[r][e] * vs[jj][lane + 32 * e];
                    }
                    const float sc = at_warp_sum(sp) * a.scale + at_mask(mask, a, b, h, i, j);
                    const float dpv = at_warp_sum(dp);
                    if (sc == at_neg_inf()) continue;
                    const float p = expf(sc - ls[r]);
                    const float ds = p * (dpv - di[r]) * a.scale;
                    for (int e = 0; e < AT_EPL; ++e) acc[r][e] += ds * ks[jj][lane + 32 * e];
                }
            }
        }
        for (int r = 0; r < AT_RPW; ++r) {
            const i64 i = i0 + warp + (i64)r * AT_WARPS;
            if (i >= a.t) continue;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                if (c < a.d) dq[((bh * a.t) + i) * a.d + c] = from_f<T>(acc[r][e]);
            }
        }
    }
}

// dk, dv: per key row j of a key/value head, over every query head of its group and every
// query row i (i >= j when causal): p = exp(s - lse_i), dv_j += p dO_i,
// dk_j += scale p (dO_i . v_j - D_i) q_i. One owner per key row: no atomics.
template <typename T>
__device__ void attn_dkv_k(AtDims a, const T* q, const T* k, const T* v, const T* o, const float* lse,
                           const T* dout, const T* mask, T* dk, T* dv) {
    __shared__ float qs[AT_BQ][AT_DMAX];
    __shared__ float dos[AT_BQ][AT_DMAX];
    __shared__ float dis[AT_BQ];
    __shared__ float lss[AT_BQ];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 tiles = (a.s + AT_BK - 1) / AT_BK;
    const i64 group = a.hq / a.hkv;
    for (i64 blk = blockIdx.x; blk < a.b * a.hkv * tiles; blk += gridDim.x) {
        const i64 tile = blk % tiles, bk = blk / tiles, hk = bk % a.hkv, b = bk / a.hkv;
        const i64 j0 = tile * AT_BK;
        float kr[AT_KPW][AT_EPL], vr[AT_KPW][AT_EPL], gk[AT_KPW][AT_EPL], gv[AT_KPW][AT_EPL];
        for (int r = 0; r < AT_KPW; ++r) {
            const i64 j = j0 + warp + (i64)r * AT_WARPS;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                kr[r][e] = (j < a.s && c < a.d) ? to_f(k[((bk * a.s) + j) * a.d + c]) : 0.0f;
                vr[r][e] = (j < a.s && c < a.dv) ? to_f(v[((bk * a.s) + j) * a.dv + c]) : 0.0f;
                gk[r][e] = 0.0f;
                gv[r][e] = 0.0f;
            }
        }
        // (causal: query rows before the tile's first key see none of its keys)
        const i64 i_start = a.causal ? (j0 / AT_BQ) * AT_BQ : 0;
        for (i64 h = hk * group; h < (hk + 1) * group; ++h) {
            const i64 bh = b * a.hq + h;
            for (i64 i0 = i_start; i0 < a.t; i0 += AT_BQ) {
                const i64 in = (a.t - i0 < AT_BQ) ? a.t - i0 : AT_BQ;
                __syncthreads();
                at_load(qs, AT_BQ, q + bh * a.t * a.d, i0, in, a.d);
                at_load(dos, AT_BQ, dout + bh * a.t * a.dv, i0, in, a.dv);
                // D_i = dO_i . O_i, one row per warp in turn
                for (int r = warp; r < AT_BQ; r += AT_WARPS) {
                    float part = 0.0f;
                    if (r < in) {
                        for (int e = 0; e < AT_EPL; ++e) {
                            const i64 c = lane + 32 * e;
                            if (c < a.dv) part += to_f(dout[((bh * a.t) + i0 + r) * a.dv + c]) *
                                                  to_f(o[((bh * a.t) + i0 + r) * a.dv + c]);
                        }
                    }
                    const float d = at_warp_sum(part);
                    if (lane == 0) {
                        dis[r] = d;
                        lss[r] = r < in ? lse[bh * a.t + i0 + r] : at_neg_inf();
                    }
                }
                __syncthreads();
                for (int r = 0; r < AT_KPW; ++r) {
                    const i64 j = j0 + warp + (i64)r * AT_WARPS;
                    if (j >= a.s) continue;
                    for (i64 ii = 0; ii < in; ++ii) {
                        const i64 i = i0 + ii;
                        if ((a.causal && j > i) || lss[ii] == at_neg_inf()) continue;
                        float sp = 0.0f, dp = 0.0f;
                        for (int e = 0; e < AT_EPL; ++e) {
                            sp += qs[ii][lane + 32 * e] * kr[r][e];
                            dp += dos[ii][lane + 32 * e] * vr[r][e];
                        }
                        const float sc = at_warp_sum(sp) * a.scale + at_mask(mask, a, b, h, i, j);
                        const float dpv = at_warp_sum(dp);
                        if (sc == at_neg_inf()) continue;
                        const float p = expf(sc - lss[ii]);
                        const float ds = p * (dpv - dis[ii]) * a.scale;
                        for (int e = 0; e < AT_EPL; ++e) {
                            gv[r][e] += p * dos[ii][lane + 32 * e];
                            gk[r][e] += ds * qs[ii][lane + 32 * e];
                        }
                    }
                }
            }
        }
        for (int r = 0; r < AT_KPW; ++r) {
            const i64 j = j0 + warp + (i64)r * AT_WARPS;
            if (j >= a.s) continue;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                if (c < a.d) dk[((bk * a.s) + j) * a.d + c] = from_f<T>(gk[r][e]);
                if (c < a.dv) dv[((bk * a.s) + j) * a.dv + c] = from_f<T>(gv[r][e]);
            }
        }
    }
}

// The launch arguments of every attention kernel start with the dimensions (see AtDims).
#define AT_DIM_PARAMS i64 b, i64 hq, i64 hkv, i64 t, i64 s, i64 d, i64 dv, float scale, int causal, i64 mb, i64 mh, i64 mt, i64 ms
#define AT_DIMS AtDims{b, hq, hkv, t, s, d, dv, scale, causal, mb, mh, mt, ms}

#define ATTENTION_FLOAT(N, T) \
    extern "C" __global__ void attn_fwd_##N(AT_DIM_PARAMS, const T* q, const T* k, const T* v, const T* mask, T* o, float* lse) { attn_fwd_k<T>(AT_DIMS, q, k, v, mask, o, lse); } \
    extern "C" __global__ void attn_dq_##N(AT_DIM_PARAMS, const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, const T* mask, T* dq) { attn_dq_k<T>(AT_DIMS, q, k, v, o, lse, dout, mask, dq); } \
    extern "C" __global__ void attn_dkv_##N(AT_DIM_PARAMS, const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, const T* mask, T* dk, T* dv_) { attn_dkv_k<T>(AT_DIMS, q, k, v, o, lse, dout, mask, dk, dv_); }
FLOAT_TYPES(ATTENTION_FLOAT)

// PASA (Pseudo-Average Shifting Attention, arXiv 2503.01873): the forward in fp16 for f16
// operands, every kept value rounded to fp16 as `runtime/kernels/src/cpu/pasa.rs` describes and
// emulates step by step (its module comment is the specification; this kernel runs the same
// roundings, with dot products summed by the lanes' butterfly instead of in order). Per key
// tile of AT_BC keys: the tile's pseudo-average h = fp16(beta fp16(mean of its key rows))
// (one thread per head-dimension column, keys summed in order), the keys shifted in shared
// memory, K' = fp16(K - h); per query row the running maximum moves into the tile's frame,
// m = fp16(m - fp16(fp16(q . fp16(h - h_prev)) scale)) (global recovering), then the online
// softmax over the tile's shifted scores S' = fp16(fp16(q . K') scale) (+ mask), with
// fp16 probabilities, row sum, rescaling and accumulator. The output is fp16(acc / l); the
// saved lse = m + log l + scale q . h_last is the true row log-sum-exp (f32), so the f16
// gradient kernels above serve PASA's backward. Threads, tiles and causal skipping as in
// attn_fwd.

__device__ __forceinline__ float pa_r16(float x) { return to_f(from_f<f16>(x)); }

__device__ void attn_fwd_pasa_k(AtDims a, float beta, const f16* q, const f16* k, const f16* v,
                                const f16* mask, f16* o, float* lse) {
    __shared__ float ks[AT_BC][AT_DMAX];   // the tile's shifted keys K'
    __shared__ float vs[AT_BC][AT_DMAX];
    __shared__ float sh[2][AT_DMAX];       // this tile's shift h and the previous tile's
    __shared__ float dsh[AT_DMAX];         // fp16(h - h_prev)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 tiles = (a.t + AT_BR - 1) / AT_BR;
    for (i64 blk = blockIdx.x; blk < a.b * a.hq * tiles; blk += gridDim.x) {
        const AtRowTile<f16> rt = at_row_tile(a, blk, tiles, k, v);
        const i64 b = rt.b, h = rt.h, bh = rt.bh, i0 = rt.i0, s_end = rt.s_end;
        const f16* kb = rt.kb;
        const f16* vb = rt.vb;
        float qr[AT_RPW][AT_EPL], acc[AT_RPW][AT_EPL], m[AT_RPW], l[AT_RPW];
        for (int r = 0; r < AT_RPW; ++r) {
            const i64 i = i0 + warp + (i64)r * AT_WARPS;
            m[r] = at_neg_inf();
            l[r] = 0.0f;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                qr[r][e] = (i < a.t && c < a.d) ? to_f(q[((bh * a.t) + i) * a.d + c]) : 0.0f;
                acc[r][e] = 0.0f;
            }
        }
        int cur = 0;
        i64 jt = 0;
        for (i64 j0 = 0; j0 < s_end; j0 += AT_BC, ++jt) {
            const i64 jn = (a.s - j0 < AT_BC) ? a.s - j0 : AT_BC;
            __syncthreads();
            at_load(ks, AT_BC, kb, j0, jn, a.d);
            at_load(vs, AT_BC, vb, j0, jn, a.dv);
            __syncthreads();
            // the tile's pseudo-average and shifted keys, one thread per column
            for (int c = threadIdx.x; c < AT_DMAX; c += blockDim.x) {
                float sum = 0.0f;
                for (i64 jj = 0; jj < jn; ++jj) sum += ks[jj][c];
                const float hc = c < a.d ? pa_r16(beta * pa_r16(sum / (float)jn)) : 0.0f;
                dsh[c] = jt > 0 ? pa_r16(hc - sh[cur][c]) : 0.0f;
                sh[cur ^ 1][c] = hc;
                for (i64 jj = 0; jj < jn; ++jj) ks[jj][c] = pa_r16(ks[jj][c] - hc);
            }
            cur ^= 1;
            __syncthreads();
            for (int r = 0; r < AT_RPW; ++r) {
                const i64 i = i0 + warp + (i64)r * AT_WARPS;
                if (i >= a.t) continue;
                // global recovering: the running maximum into this tile's frame
                if (jt > 0 && m[r] != at_neg_inf()) {
                    float part = 0.0f;
                    for (int e = 0; e < AT_EPL; ++e) part += qr[r][e] * dsh[lane + 32 * e];
                    const float delta = pa_r16(pa_r16(at_warp_sum(part)) * a.scale);
                    m[r] = pa_r16(m[r] - delta);
                }
                float p[AT_BC];
                float bmax = at_neg_inf();
#pragma unroll
                for (int jj = 0; jj < AT_BC; ++jj) {
                    p[jj] = at_neg_inf();
                    const i64 j = j0 + jj;
                    if (jj >= jn || (a.causal && j > i)) continue;
                    float part = 0.0f;
                    for (int e = 0; e < AT_EPL; ++e) part += qr[r][e] * ks[jj][lane + 32 * e];
                    float sc = pa_r16(pa_r16(at_warp_sum(part)) * a.scale);
                    if (mask) sc = pa_r16(sc + at_mask(mask, a, b, h, i, j));
                    p[jj] = sc;
                    bmax = fmaxf(bmax, sc);
                }
                const float mn = fmaxf(m[r], bmax);
                if (mn == at_neg_inf()) continue;
                const float corr = m[r] == at_neg_inf() ? 0.0f : pa_r16(expf(pa_r16(m[r] - mn)));
                float psum = 0.0f;
#pragma unroll
                for (int jj = 0; jj < AT_BC; ++jj) {
                    p[jj] = p[jj] == at_neg_inf() ? 0.0f : pa_r16(expf(pa_r16(p[jj] - mn)));
                    psum += p[jj];
                }
                l[r] = pa_r16(pa_r16(l[r] * corr) + pa_r16(psum));
                for (int e = 0; e < AT_EPL; ++e) {
                    float pv = 0.0f;
#pragma unroll
                    for (int jj = 0; jj < AT_BC; ++jj) pv += p[jj] * vs[jj][lane + 32 * e];
                    acc[r][e] = pa_r16(pa_r16(acc[r][e] * corr) + pa_r16(pv));
                }
                m[r] = mn;
            }
        }
        for (int r = 0; r < AT_RPW; ++r) {
            const i64 i = i0 + warp + (i64)r * AT_WARPS;
            if (i >= a.t) continue;
            for (int e = 0; e < AT_EPL; ++e) {
                const i64 c = lane + 32 * e;
                if (c < a.dv) o[((bh * a.t) + i) * a.dv + c] = from_f<f16>(l[r] != 0.0f ? acc[r][e] / l[r] : 0.0f);
            }
            float part = 0.0f;
            for (int e = 0; e < AT_EPL; ++e) part += jt > 0 ? qr[r][e] * sh[cur][lane + 32 * e] : 0.0f;
            const float shift = at_warp_sum(part) * a.scale;
            if (lane == 0) lse[bh * a.t + i] = l[r] != 0.0f ? m[r] + logf(l[r]) + shift : at_neg_inf();
        }
    }
}

extern "C" __global__ void attn_fwd_pasa_f16(AT_DIM_PARAMS, float beta, const f16* q, const f16* k, const f16* v, const f16* mask, f16* o, float* lse) {
    attn_fwd_pasa_k(AT_DIMS, beta, q, k, v, mask, o, lse);
}
