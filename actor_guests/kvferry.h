/* kvferry guest ABI, version 1.  See ABI.md for the contract in prose.
 *
 * Build a guest:
 *   python -m ziglang cc --target=wasm32-freestanding -nostdlib -O2 \
 *     -Wl,--no-entry -Wl,--max-memory=4194304 -Wl,-z,stack-size=65536 \
 *     -I actor_guests my_guest.c -o my_guest.wasm
 *
 * A guest's linear memory *is* an MLX array: tensors the guest describes with
 * kv_tensor are read by the host in place, with no copy.
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include <stdint.h>

#define KV_ABI_VERSION 1

#define KV_IMPORT(name) __attribute__((import_module("kvferry"), import_name(#name)))
#define KV_EXPORT(name) __attribute__((export_name(#name)))

/* ---- tensors in guest memory ---------------------------------------------- */

enum kv_dtype {
    KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I32 = 3, KV_U32 = 4, KV_U8 = 5, KV_I8 = 6,
};

/* A dense, row-major tensor at `offset` in this guest's memory.  The offset
 * must be aligned to the element size; 1 <= ndim <= 4; unused dims are 0.  */
typedef struct {
    uint32_t offset;
    uint32_t dtype;
    uint32_t ndim;
    uint32_t shape[4];
} kv_tensor;

/* ---- utilities ------------------------------------------------------------ */

enum { KV_LOG_DEBUG = 0, KV_LOG_INFO = 1, KV_LOG_WARN = 2, KV_LOG_ERROR = 3 };

KV_IMPORT(kv_log)      void     kv_log(int32_t level, const char *msg, uint32_t len);
KV_IMPORT(kv_clock_ns) uint64_t kv_clock_ns(void);                 /* monotonic */
KV_IMPORT(kv_random)   void     kv_random(void *buf, uint32_t len); /* host CSPRNG bytes */

/* ---- tensor work on guest memory (return 0; bad arguments trap) ------------ */

/* out = a @ b   (a: [..., M, K], b: [..., K, N], out: [..., M, N]; f32/f16/bf16).
 * out may overlap a or b: the result is computed before it is written.      */
KV_IMPORT(kv_matmul)  int32_t kv_matmul(const kv_tensor *a, const kv_tensor *b, const kv_tensor *out);
/* out = softmax(x / temperature) along the last axis (f32).                  */
KV_IMPORT(kv_softmax) int32_t kv_softmax(const kv_tensor *x, const kv_tensor *out, float temperature);
/* The k largest elements of 1-D f32 x, descending: ids[k] (int32), vals[k].   */
KV_IMPORT(kv_topk)    int32_t kv_topk(const kv_tensor *x, uint32_t k, int32_t *ids, float *vals);

/* ---- the model (chat guests; trap with "no model attached" elsewhere) ------ */

typedef struct {
    uint32_t vocab_size;     /* logits length */
    uint32_t context;        /* maximum tokens in the KV cache */
    uint32_t n_tokens;       /* tokens in the KV cache now */
    uint32_t n_eos;          /* number of valid entries in eos[] */
    int32_t  eos[8];         /* end-of-sequence token ids */
} kv_model;

KV_IMPORT(kv_model_info) int32_t kv_model_info(kv_model *out);
/* Append tokens to the KV cache and run the model over them (prefill).       */
KV_IMPORT(kv_prefill)    int32_t kv_prefill(const int32_t *tokens, uint32_t n);
/* Append one token and run one decode step.                                  */
KV_IMPORT(kv_decode)     int32_t kv_decode(int32_t token);
/* Write the f32 logits that follow the last appended token into `out`
 * (1-D, vocab_size elements).                                               */
KV_IMPORT(kv_logits)     int32_t kv_logits(const kv_tensor *out);
/* Top-k of those logits, descending (k=1 is greedy without copying logits). */
KV_IMPORT(kv_logits_topk) int32_t kv_logits_topk(uint32_t k, int32_t *ids, float *vals);
/* UTF-8 bytes of one token; returns the length (may exceed cap: truncated).  */
KV_IMPORT(kv_token_text) int32_t kv_token_text(int32_t token, char *buf, uint32_t cap);

/* ---- what a chat guest exports --------------------------------------------
 *   int32_t kvferry_abi_version(void);                 returns KV_ABI_VERSION
 *   void   *kvferry_buffer(uint32_t size);             scratch the host writes inputs to
 *   int32_t kvferry_chat_config(const kv_sampling *c); 0, or <0 if rejected
 *   int32_t kvferry_chat_begin(const int32_t *tokens, uint32_t n);  a new turn's tokens
 *   int32_t kvferry_chat_step(void);    next token id (>= 0), or a KV_STOP_* code
 */

enum { KV_STOP_EOS = -1, KV_STOP_STRING = -2, KV_STOP_MAX_TOKENS = -3 };

typedef struct {
    float    temperature;   /* 0 = greedy */
    float    top_p;         /* 1 = off */
    int32_t  top_k;         /* 0 = off */
    int32_t  max_tokens;    /* per turn */
    uint64_t seed;          /* PRNG seed; the PRNG state lives in guest memory */
    uint32_t n_stop;        /* stop strings, up to 4 */
    uint32_t stop_offset[4];
    uint32_t stop_len[4];
    uint32_t flags;         /* KV_FLAG_* */
} kv_sampling;              /* 64 bytes */

enum { KV_FLAG_IGNORE_EOS = 1 };  /* like llama.cpp --ignore-eos (benchmarks) */

#endif
