/* chat: the default conversation guest.  It drives generation: asks the host to
 * prefill a turn and run decode steps, reads the step's logits from its own
 * memory, samples (greedy, temperature, top-k, top-p) with a seeded PRNG whose
 * state lives here, and applies stop rules (EOS, stop strings, max tokens). */
#include "kvferry.h"

#define MAX_VOCAB  262144
#define MAX_INPUT  32768
#define MAX_CAND   1024
#define TAIL       256

static float    logits[MAX_VOCAB];
static int32_t  cand_ids[MAX_CAND];
static float    cand_vals[MAX_CAND];
static int32_t  input[MAX_INPUT];
static uint8_t  scratch[MAX_INPUT * 4 + 4096];

static kv_sampling cfg = {0.0f, 1.0f, 0, 256, 0, 0, {0}, {0}, 0};
static char     stops[4][64];
static uint32_t stop_len[4];
static kv_model model;

static uint64_t rng[4];            /* xoshiro256** state */
static uint32_t n_input;
static int32_t  pending = -1;       /* sampled, streamed, not yet in the KV cache */
static int32_t  generated;
static int32_t  stop_hit;
static char     tail[TAIL];
static uint32_t tail_len;

KV_EXPORT(kvferry_abi_version) int32_t abi_version(void) { return KV_ABI_VERSION; }

KV_EXPORT(kvferry_buffer) void *buffer(uint32_t size) { return size <= sizeof scratch ? scratch : 0; }

/* ---- PRNG --------------------------------------------------------------- */
static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static uint64_t next_u64(void) {
    uint64_t r = rotl(rng[1] * 5, 7) * 9, t = rng[1] << 17;
    rng[2] ^= rng[0]; rng[3] ^= rng[1]; rng[1] ^= rng[2]; rng[0] ^= rng[3];
    rng[2] ^= t; rng[3] = rotl(rng[3], 45);
    return r;
}
static double uniform(void) { return (double)(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

/* ---- exp without libc: 2^(x log2 e), range-reduced, degree-6 polynomial ---- */
static double exp_(double x) {
    if (x < -700.0) return 0.0;
    double y = x * 1.4426950408889634;
    double n = (double)(int64_t)(y < 0 ? y - 0.5 : y + 0.5);
    double f = (y - n) * 0.6931471805599453;  /* |f| <= ln2/2 */
    double p = 1 + f * (1 + f * (0.5 + f * (1.0 / 6 + f * (1.0 / 24 + f * (1.0 / 120 + f * (1.0 / 720 + f / 5040))))));
    union { double d; uint64_t u; } s = {.u = (uint64_t)((int64_t)n + 1023) << 52};
    return p * s.d;
}

/* ---- configuration ------------------------------------------------------ */
KV_EXPORT(kvferry_chat_config) int32_t chat_config(const kv_sampling *c) {
    if (c->temperature < 0 || c->top_p <= 0 || c->top_p > 1 || c->top_k < 0 || c->max_tokens <= 0 || c->n_stop > 4)
        return -1;
    cfg = *c;
    for (uint32_t i = 0; i < c->n_stop; i++) {
        if (c->stop_len[i] == 0 || c->stop_len[i] > sizeof stops[i]) return -2;
        const char *s = (const char *)(uintptr_t)c->stop_offset[i];
        for (uint32_t j = 0; j < c->stop_len[i]; j++) stops[i][j] = s[j];
        stop_len[i] = c->stop_len[i];
    }
    uint64_t x = c->seed;
    for (int i = 0; i < 4; i++) rng[i] = splitmix(&x);
    kv_model_info(&model);
    return model.vocab_size <= MAX_VOCAB ? 0 : -3;
}

KV_EXPORT(kvferry_chat_begin) int32_t chat_begin(const int32_t *tokens, uint32_t n) {
    if (n > MAX_INPUT) return -1;
    for (uint32_t i = 0; i < n; i++) input[i] = tokens[i];
    n_input = n;
    pending = -1;  /* the host's new turn already contains it (see ABI.md) */
    generated = 0;
    stop_hit = 0;
    tail_len = 0;
    return 0;
}

/* ---- sampling ----------------------------------------------------------- */
static int32_t sample(void) {
    if (cfg.temperature <= 0.0f) {
        kv_logits_topk(1, cand_ids, cand_vals);
        return cand_ids[0];
    }
    double inv_t = 1.0 / cfg.temperature;
    if (cfg.top_k == 0 && cfg.top_p >= 1.0f) {  /* exact: the whole vocabulary */
        kv_tensor t = {(uint32_t)(uintptr_t)logits, KV_F32, 1, {model.vocab_size, 0, 0, 0}};
        kv_logits(&t);
        float m = logits[0];
        for (uint32_t i = 1; i < model.vocab_size; i++) if (logits[i] > m) m = logits[i];
        double z = 0;
        for (uint32_t i = 0; i < model.vocab_size; i++) z += exp_((logits[i] - m) * inv_t);
        double u = uniform() * z, acc = 0;
        for (uint32_t i = 0; i < model.vocab_size; i++) {
            acc += exp_((logits[i] - m) * inv_t);
            if (acc > u) return (int32_t)i;
        }
        return (int32_t)model.vocab_size - 1;
    }
    uint32_t k = cfg.top_k > 0 ? (uint32_t)cfg.top_k : MAX_CAND;
    if (k > MAX_CAND) k = MAX_CAND;
    if (k > model.vocab_size) k = model.vocab_size;
    kv_logits_topk(k, cand_ids, cand_vals);  /* descending */
    double p[MAX_CAND], z = 0;
    for (uint32_t i = 0; i < k; i++) z += (p[i] = exp_((cand_vals[i] - cand_vals[0]) * inv_t));
    uint32_t keep = k;
    if (cfg.top_p < 1.0f) {
        double acc = 0;
        for (uint32_t i = 0; i < k; i++) {
            acc += p[i] / z;
            if (acc >= cfg.top_p) { keep = i + 1; break; }
        }
    }
    double zk = 0;
    for (uint32_t i = 0; i < keep; i++) zk += p[i];
    double u = uniform() * zk, acc = 0;
    for (uint32_t i = 0; i < keep; i++) {
        acc += p[i];
        if (acc > u) return cand_ids[i];
    }
    return cand_ids[keep - 1];
}

static int is_eos(int32_t t) {
    for (uint32_t i = 0; i < model.n_eos && i < 8; i++) if (model.eos[i] == t) return 1;
    return 0;
}

static int stop_string_seen(int32_t token) {
    if (cfg.n_stop == 0) return 0;
    char buf[128];
    int32_t n = kv_token_text(token, buf, sizeof buf);
    if (n > (int32_t)sizeof buf) n = sizeof buf;
    for (int32_t i = 0; i < n; i++) {
        if (tail_len == TAIL) {  /* keep the last half */
            for (uint32_t j = 0; j < TAIL / 2; j++) tail[j] = tail[j + TAIL / 2];
            tail_len = TAIL / 2;
        }
        tail[tail_len++] = buf[i];
    }
    for (uint32_t s = 0; s < cfg.n_stop; s++) {
        uint32_t L = stop_len[s];
        /* the stop string may end anywhere inside this token's bytes */
        for (int32_t end = (int32_t)tail_len; end > (int32_t)tail_len - n && end >= (int32_t)L; end--) {
            uint32_t j = 0;
            while (j < L && tail[end - L + j] == stops[s][j]) j++;
            if (j == L) return 1;
        }
    }
    return 0;
}

/* One step: run the model over what is pending, then sample the next token. */
KV_EXPORT(kvferry_chat_step) int32_t chat_step(void) {
    if (stop_hit) return KV_STOP_STRING;
    if (generated >= cfg.max_tokens) return KV_STOP_MAX_TOKENS;
    if (n_input) {
        kv_prefill(input, n_input);
        n_input = 0;
    } else if (pending >= 0) {
        kv_decode(pending);
        pending = -1;
    } else {
        return KV_STOP_MAX_TOKENS;  /* nothing to run: the turn is over */
    }
    int32_t t = sample();
    if (is_eos(t) && !(cfg.flags & KV_FLAG_IGNORE_EOS)) return KV_STOP_EOS;
    generated++;
    pending = t;
    if (stop_string_seen(t)) stop_hit = 1;
    return t;
}
