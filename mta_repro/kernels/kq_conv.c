/* Depthwise 2-D correlation for MTA's key-query convolution on CPU, causal-aware (the
 * forward, the input gradient and the weight gradient all reduce to the two loops below).
 *
 * Compiled on first use by mta_repro/kernels/kq_conv_cpu.py (cc -O3 -march=native
 * -fopenmp) and called through ctypes. Why not F.conv2d: its depthwise backward on CPU is
 * the largest single cost of an MTA layer (scripts/bench_kq_conv.py). Each output row stays in L1
 * while every tap adds a shifted input row to it; those loops vectorise along the keys.
 *
 * Layout (contiguous): P = B*H planes of R rows x K keys, plane p uses kernel head p % H.
 * Entries above the diagonal `diag` (column c > row r + diag) read as 0 and are written
 * as 0: the causal mask is applied here, on both sides, and its upper triangle costs
 * nothing. Out-of-range rows/columns read as 0.
 *   corr:  y[p, i, j]  = sum_{a<CQ, b<CK} w[h, a, b] * x[p, i + a - ro, j + b - pl]
 *   wgrad: gw[p, a, b] = sum_{i, j} g[p, i, j] * x[p, i + a - ro, j + b - pl]  (per plane;
 *          the caller sums the planes of each head)
 */
#include <stdint.h>
#include <string.h>

static inline int64_t mn(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t mx(int64_t a, int64_t b) { return a > b ? a : b; }

/* Register blocking of the interior: NV vectors of VBYTES (GCC vector extensions, so any
 * target with SIMD gets its own instructions). */
#define VBYTES 32
#define NV 4

/* The accumulate loop: y[j] += w[a, b] * x[src_a, j + b - pl] for j in [lo, hi), each tap
 * clipped to the readable columns of its source row. */
#define ACCUMULATE(T, lo, hi)                                                               \
    for (int64_t a = 0; a < CQ; ++a) {                                                      \
        const int64_t src = i + a - ro;                                                     \
        if (src < 0 || src >= R) continue;                                                  \
        const T *xr = xp + src * K;                                                         \
        const int64_t cend = mn(K, src + diag + 1); /* readable columns */                  \
        for (int64_t b = 0; b < CK; ++b) {                                                  \
            const T wv = wh[a * CK + b];                                                    \
            const int64_t off = b - pl; /* y[j] += wv * x[j + off] */                       \
            const int64_t j0 = mx(lo, -off), j1 = mn(hi, cend - off);                       \
            const T *xs = xr + off;                                                         \
            _Pragma("omp simd")                                                             \
            for (int64_t j = j0; j < j1; ++j) yr[j] += wv * xs[j];                          \
        }                                                                                   \
    }

#define DEFINE(T, SUF)                                                                      \
typedef T V_##SUF __attribute__((vector_size(VBYTES)));                                     \
void kq_corr_##SUF(const T *x, const T *w, T *y, int64_t P, int64_t H, int64_t R,          \
                   int64_t K, int64_t CQ, int64_t CK, int64_t ro, int64_t pl, int64_t diag, \
                   int nthreads) {                                                          \
    enum { VL = VBYTES / sizeof(T), JB = NV * (VBYTES / sizeof(T)) };                       \
    _Pragma("omp parallel for collapse(2) num_threads(nthreads) schedule(static)")          \
    for (int64_t p = 0; p < P; ++p) {                                                       \
        for (int64_t i = 0; i < R; ++i) {                                                   \
            const T *xp = x + p * R * K, *wh = w + (p % H) * CQ * CK;                       \
            T *yr = y + (p * R + i) * K;                                                    \
            const int64_t jend = mx(0, mn(K, i + diag + 1)); /* outputs [0, jend) */        \
            /* Interior [ja, jb): every tap of every source row is readable, so JB       */ \
            /* outputs stay in registers while all CQ*CK taps accumulate (1 load/FMA). */  \
            int64_t ja = mn(pl, jend), jb = jend;                                           \
            for (int64_t a = 0; a < CQ; ++a) {                                              \
                const int64_t src = i + a - ro;                                             \
                if (src >= 0 && src < R) jb = mn(jb, mn(K, src + diag + 1) - (CK - 1 - pl)); \
            }                                                                               \
            int64_t jr = ja; /* end of the register-blocked chunks */                       \
            for (; jr + JB <= jb; jr += JB) {                                               \
                V_##SUF acc[NV];                                                            \
                for (int v = 0; v < NV; ++v) acc[v] = (V_##SUF){0};                         \
                for (int64_t a = 0; a < CQ; ++a) {                                          \
                    const int64_t src = i + a - ro;                                         \
                    if (src < 0 || src >= R) continue;                                      \
                    const T *xr = xp + src * K + jr - pl;                                   \
                    for (int64_t b = 0; b < CK; ++b) {                                      \
                        const T wv = wh[a * CK + b];                                        \
                        for (int v = 0; v < NV; ++v) {                                      \
                            V_##SUF xv;                                                     \
                            memcpy(&xv, xr + b + v * VL, sizeof xv);                        \
                            acc[v] += wv * xv;                                              \
                        }                                                                   \
                    }                                                                       \
                }                                                                           \
                memcpy(yr + jr, acc, sizeof acc);                                           \
            }                                                                               \
            /* The rest (edges, the diagonal band, beyond): accumulate per tap. */          \
            if (jr == ja) ja = jr = 0; /* no chunk: all columns by the general loop */      \
            memset(yr, 0, sizeof(T) * ja);                                                  \
            memset(yr + jr, 0, sizeof(T) * (K - jr));                                       \
            ACCUMULATE(T, 0, ja)                                                            \
            ACCUMULATE(T, jr, jend)                                                         \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void kq_wgrad_##SUF(const T *g, const T *x, double *gw, int64_t P, int64_t H, int64_t R,   \
                    int64_t K, int64_t CQ, int64_t CK, int64_t ro, int64_t pl, int64_t diag, \
                    int nthreads) {                                                         \
    (void)H;                                                                                \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                      \
    for (int64_t p = 0; p < P; ++p) {                                                       \
        const T *gp = g + p * R * K, *xp = x + p * R * K;                                   \
        double *gwp = gw + p * CQ * CK;                                                     \
        for (int64_t t = 0; t < CQ * CK; ++t) gwp[t] = 0.0;                                 \
        for (int64_t i = 0; i < R; ++i) {                                                   \
            const T *gr = gp + i * K;                                                       \
            const int64_t jend = mx(0, mn(K, i + diag + 1));                                \
            for (int64_t a = 0; a < CQ; ++a) {                                              \
                const int64_t src = i + a - ro;                                             \
                if (src < 0 || src >= R) continue;                                          \
                const T *xr = xp + src * K;                                                 \
                const int64_t cend = mn(K, src + diag + 1);                                 \
                for (int64_t b = 0; b < CK; ++b) {                                          \
                    const int64_t off = b - pl; /* g[j] * x[j + off] */                     \
                    const int64_t j0 = mx(0, -off), j1 = mn(jend, cend - off);              \
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
