/* gemm: the seed's experiment.  The guest fills two float32 matrices in its own
 * memory, asks the host to multiply them (the host reads them in place as MLX
 * arrays), and checks the product itself. */
#include "kvferry.h"

#define NMAX 256

static float A[NMAX * NMAX], B[NMAX * NMAX], C[NMAX * NMAX];
static uint32_t n_cur;

KV_EXPORT(kvferry_abi_version) int32_t abi_version(void) { return KV_ABI_VERSION; }

/* Exactly representable values: every product and sum is exact in float32. */
static float a_at(uint32_t i, uint32_t j) { return (float)((int)((i * 7 + j * 3) % 17) - 8) * 0.25f; }
static float b_at(uint32_t i, uint32_t j) { return (float)((int)((i * 5 + j * 11) % 13) - 6) * 0.25f; }

static kv_tensor mat(const float *p, uint32_t n) {
    kv_tensor t = {(uint32_t)(uintptr_t)p, KV_F32, 2, {n, n, 0, 0}};
    return t;
}

KV_EXPORT(gemm_setup) int32_t gemm_setup(uint32_t n) {
    if (n == 0 || n > NMAX) return -1;
    n_cur = n;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < n; j++) {
            A[i * n + j] = a_at(i, j);
            B[i * n + j] = b_at(i, j);
            C[i * n + j] = -1.0f;
        }
    return 0;
}

KV_EXPORT(gemm_run) int32_t gemm_run(void) {
    kv_tensor a = mat(A, n_cur), b = mat(B, n_cur), c = mat(C, n_cur);
    return kv_matmul(&a, &b, &c);
}

/* Elements of C that differ from the guest's own reference product. */
KV_EXPORT(gemm_check) int32_t gemm_check(void) {
    uint32_t n = n_cur;
    int32_t errors = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (uint32_t k = 0; k < n; k++) s += a_at(i, k) * b_at(k, j);
            if (C[i * n + j] != s) errors++;
        }
    return errors;
}

KV_EXPORT(gemm_ptr) uint32_t gemm_ptr(int32_t which) {
    return (uint32_t)(uintptr_t)(which == 0 ? A : which == 1 ? B : C);
}

/* The whole experiment in one call: 128x128, returns the error count. */
KV_EXPORT(run) int32_t run(void) {
    if (gemm_setup(128) != 0) return -1;
    if (gemm_run() != 0) return -1;
    int32_t errors = gemm_check();
    static const char ok[] = "gemm: 128x128 product verified by the guest";
    if (errors == 0) kv_log(KV_LOG_INFO, ok, sizeof ok - 1);
    return errors;
}

/* Grow memory and fill `nbytes` with a pattern; returns the region's offset or 0. */
KV_EXPORT(region_fill) uint32_t region_fill(uint32_t nbytes) {
    uint32_t pages = (nbytes + 65535) / 65536;
    int32_t old = __builtin_wasm_memory_grow(0, pages);
    if (old < 0) return 0;
    uint8_t *p = (uint8_t *)(uintptr_t)((uint32_t)old * 65536u);
    for (uint32_t i = 0; i < nbytes; i++) p[i] = (uint8_t)(i * 31u + 7u);
    return (uint32_t)(uintptr_t)p;
}
