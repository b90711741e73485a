/* Depthwise 2-D correlation for MTA's key-query convolution on CPU (the forward, the
 * input gradient and the weight gradient all reduce to the two loops below).
 *
 * Compiled on first use by mta_repro/model/kq_conv_cpu.py (cc -O3 -march=native
 * -fopenmp) and called through ctypes. Why not F.conv2d: its depthwise backward on CPU is
 * the largest single cost of an MTA layer (PERF_NOTES.md). Out-of-range inputs read as 0
 * (no padded copies); the interior columns keep JB outputs in registers while all CQ*CK
 * taps accumulate, which vectorises along the key axis.
 *
 * Layout (contiguous): P = B*H planes of R rows x K keys, plane p uses kernel head p % H.
 *   corr:  y[p, i, j]  = sum_{a<CQ, b<CK} w[h, a, b] * x[p, i + a - ro, j + b - pl]
 *   wgrad: gw[p, a, b] = sum_{i, j} g[p, i, j] * x[p, i + a - ro, j + b - pl]   (per plane;
 *          the caller sums the planes of each head)
 */
#include <stdint.h>

#define JB 64

#define DEFINE(T, SUF)                                                                      \
void kq_corr_##SUF(const T *x, const T *w, T *y, int64_t P, int64_t H, int64_t R,          \
                   int64_t K, int64_t CQ, int64_t CK, int64_t ro, int64_t pl, int nthreads) { \
    /* columns whose taps all fall inside [0, K) */                                         \
    const int64_t jlo = pl < K ? pl : K;                                                    \
    int64_t jhi = K - (CK - 1 - pl);                                                        \
    if (jhi < jlo) jhi = jlo;                                                               \
    _Pragma("omp parallel for collapse(2) num_threads(nthreads) schedule(static)")          \
    for (int64_t p = 0; p < P; ++p) {                                                       \
        for (int64_t i = 0; i < R; ++i) {                                                   \
            const T *xp = x + p * R * K, *wh = w + (p % H) * CQ * CK;                       \
            T *yr = y + (p * R + i) * K;                                                    \
            int64_t j0 = jlo;                                                               \
            for (; j0 + JB <= jhi; j0 += JB) {                                              \
                T acc[JB];                                                                  \
                for (int64_t jj = 0; jj < JB; ++jj) acc[jj] = 0;                            \
                for (int64_t a = 0; a < CQ; ++a) {                                          \
                    const int64_t src = i + a - ro;                                         \
                    if (src < 0 || src >= R) continue;                                      \
                    const T *xr = xp + src * K + j0 - pl;                                   \
                    for (int64_t b = 0; b < CK; ++b) {                                      \
                        const T wv = wh[a * CK + b];                                        \
                        _Pragma("omp simd")                                                 \
                        for (int64_t jj = 0; jj < JB; ++jj) acc[jj] += wv * xr[b + jj];     \
                    }                                                                       \
                }                                                                           \
                for (int64_t jj = 0; jj < JB; ++jj) yr[j0 + jj] = acc[jj];                  \
            }                                                                               \
            /* edges and the remainder: bounds-checked */                                   \
            for (int64_t j = 0; j < K; ++j) {                                               \
                if (j >= jlo && j < j0) { j = j0 - 1; continue; }                           \
                T s = 0;                                                                    \
                for (int64_t a = 0; a < CQ; ++a) {                                          \
                    const int64_t src = i + a - ro;                                         \
                    if (src < 0 || src >= R) continue;                                      \
                    for (int64_t b = 0; b < CK; ++b) {                                      \
                        const int64_t c = j + b - pl;                                       \
                        if (c >= 0 && c < K) s += wh[a * CK + b] * xp[src * K + c];         \
                    }                                                                       \
                }                                                                           \
                yr[j] = s;                                                                  \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void kq_wgrad_##SUF(const T *g, const T *x, double *gw, int64_t P, int64_t H, int64_t R,   \
                    int64_t K, int64_t CQ, int64_t CK, int64_t ro, int64_t pl, int nthreads) { \
    (void)H;                                                                                \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                      \
    for (int64_t p = 0; p < P; ++p) {                                                       \
        const T *gp = g + p * R * K, *xp = x + p * R * K;                                   \
        double *gwp = gw + p * CQ * CK;                                                     \
        for (int64_t t = 0; t < CQ * CK; ++t) gwp[t] = 0.0;                                 \
        for (int64_t i = 0; i < R; ++i) {                                                   \
            const T *gr = gp + i * K;                                                       \
            for (int64_t a = 0; a < CQ; ++a) {                                              \
                const int64_t src = i + a - ro;                                             \
                if (src < 0 || src >= R) continue;                                          \
                const T *xr = xp + src * K;                                                 \
                for (int64_t b = 0; b < CK; ++b) {                                          \
                    const int64_t off = b - pl; /* g[j] * x[j + off] */                     \
                    const int64_t j0 = off < 0 ? -off : 0, j1 = off > 0 ? K - off : K;      \
                    const T *xs = xr + off;                                                 \
                    T acc = 0;                                                              \
                    _Pragma("omp simd reduction(+:acc)")                                    \
                    for (int64_t j = j0; j < j1; ++j) acc += gr[j] * xs[j];                 \
                    gwp[a * CK + b] += (double)acc;                                         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

DEFINE(float, f32)
DEFINE(double, f64)
