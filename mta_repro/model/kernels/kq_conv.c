/* Depthwise 2-D correlation for MTA's key-query convolution on CPU (forward, input
 * gradient and weight gradient all reduce to the two loops below).
 *
 * Compiled on first use by mta_repro/model/kq_conv_cpu.py (cc -O3 -march=native
 * -fopenmp) and called through ctypes. Why not F.conv2d: its depthwise backward on CPU is
 * the largest single cost of an MTA layer (PERF_NOTES.md). The caller zero-pads the
 * input, so the loops need no bounds checks and vectorise along the key axis.
 *
 * Layout (contiguous): P = B*H planes, plane p uses kernel head p % H.
 *   xp: (P, R + CQ - 1, K + CK - 1) padded input;   w: (H, CQ, CK)
 *   corr:  y[p, i, j]  = sum_{a<CQ, b<CK} w[h, a, b] * xp[p, i + a, j + b]     y: (P, R, K)
 *   wgrad: gw[p, a, b] = sum_{i<R, j<K} g[p, i, j] * xp[p, i + a, j + b]       gw: (P, CQ, CK)
 */
#include <stdint.h>

#define JB 64 /* output columns kept in registers while all CQ*CK taps accumulate */

#define DEFINE(T, SUF)                                                                      \
void kq_corr_##SUF(const T *xp, const T *w, T *y, int64_t P, int64_t H, int64_t R,         \
                   int64_t K, int64_t CQ, int64_t CK, int nthreads) {                       \
    const int64_t KP = K + CK - 1, RP = R + CQ - 1;                                         \
    _Pragma("omp parallel for collapse(2) num_threads(nthreads) schedule(static)")          \
    for (int64_t p = 0; p < P; ++p) {                                                       \
        for (int64_t i = 0; i < R; ++i) {                                                   \
            const T *xpl = xp + p * RP * KP, *wh = w + (p % H) * CQ * CK;                   \
            T *yr = y + (p * R + i) * K;                                                    \
            int64_t j0 = 0;                                                                 \
            for (; j0 + JB <= K; j0 += JB) {                                                \
                T acc[JB];                                                                  \
                for (int64_t jj = 0; jj < JB; ++jj) acc[jj] = 0;                            \
                for (int64_t a = 0; a < CQ; ++a) {                                          \
                    const T *xr = xpl + (i + a) * KP + j0;                                  \
                    for (int64_t b = 0; b < CK; ++b) {                                      \
                        const T wv = wh[a * CK + b];                                        \
                        _Pragma("omp simd")                                                 \
                        for (int64_t jj = 0; jj < JB; ++jj) acc[jj] += wv * xr[b + jj];     \
                    }                                                                       \
                }                                                                           \
                for (int64_t jj = 0; jj < JB; ++jj) yr[j0 + jj] = acc[jj];                  \
            }                                                                               \
            for (int64_t j = j0; j < K; ++j) {                                              \
                T s = 0;                                                                    \
                for (int64_t a = 0; a < CQ; ++a)                                            \
                    for (int64_t b = 0; b < CK; ++b)                                        \
                        s += wh[a * CK + b] * xpl[(i + a) * KP + j + b];                    \
                yr[j] = s;                                                                  \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void kq_wgrad_##SUF(const T *g, const T *xp, double *gw, int64_t P, int64_t H, int64_t R,  \
                    int64_t K, int64_t CQ, int64_t CK, int nthreads) {                      \
    (void)H;                                                                                \
    const int64_t KP = K + CK - 1, RP = R + CQ - 1;                                         \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                      \
    for (int64_t p = 0; p < P; ++p) {                                                       \
        const T *gp = g + p * R * K, *xpl = xp + p * RP * KP;                               \
        double *gwp = gw + p * CQ * CK;                                                     \
        for (int64_t t = 0; t < CQ * CK; ++t) gwp[t] = 0.0;                                 \
        for (int64_t i = 0; i < R; ++i) {                                                   \
            const T *gr = gp + i * K;                                                       \
            for (int64_t a = 0; a < CQ; ++a) {                                              \
                const T *xr = xpl + (i + a) * KP;                                           \
                for (int64_t b = 0; b < CK; ++b) {                                          \
                    const T *xs = xr + b;                                                   \
                    T acc = 0;                                                              \
                    _Pragma("omp simd reduction(+:acc)")                                    \
                    for (int64_t j = 0; j < K; ++j) acc += gr[j] * xs[j];                   \
                    gwp[a * CK + b] += (double)acc;                                         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

DEFINE(float, f32)
DEFINE(double, f64)
