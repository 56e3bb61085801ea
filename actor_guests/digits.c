/* digits: a second chat guest, written to show guests decide what is said.
 * It only ever emits digit tokens: at each step it reads the full logits from
 * its own memory and picks the most likely token whose text is one digit. */
#include "kvferry.h"

#define MAX_VOCAB 262144

static float    logits[MAX_VOCAB];
static int32_t  digit_ids[64];
static uint32_t n_digits;
static uint8_t  scratch[32768 * 4 + 4096];
static int32_t  input[32768];
static uint32_t n_input;
static int32_t  pending = -1, generated, max_tokens = 16;
static kv_model model;

KV_EXPORT(kvferry_abi_version) int32_t abi_version(void) { return KV_ABI_VERSION; }
KV_EXPORT(kvferry_buffer) void *buffer(uint32_t size) { return size <= sizeof scratch ? scratch : 0; }

KV_EXPORT(kvferry_chat_config) int32_t chat_config(const kv_sampling *c) {
    max_tokens = c->max_tokens > 0 ? c->max_tokens : 16;
    kv_model_info(&model);
    if (model.vocab_size > MAX_VOCAB) return -3;
    n_digits = 0;
    char text[8];
    for (uint32_t id = 0; id < model.vocab_size && n_digits < 64; id++) {
        int32_t n = kv_token_text((int32_t)id, text, sizeof text);
        if (n == 1 && text[0] >= '0' && text[0] <= '9') digit_ids[n_digits++] = (int32_t)id;
    }
    return n_digits ? 0 : -4;
}

KV_EXPORT(kvferry_chat_begin) int32_t chat_begin(const int32_t *tokens, uint32_t n) {
    if (n > 32768) return -1;
    for (uint32_t i = 0; i < n; i++) input[i] = tokens[i];
    n_input = n;
    pending = -1;
    generated = 0;
    return 0;
}

KV_EXPORT(kvferry_chat_step) int32_t chat_step(void) {
    if (generated >= max_tokens) return KV_STOP_MAX_TOKENS;
    if (n_input) { kv_prefill(input, n_input); n_input = 0; }
    else if (pending >= 0) { kv_decode(pending); pending = -1; }
    else return KV_STOP_MAX_TOKENS;
    kv_tensor t = {(uint32_t)(uintptr_t)logits, KV_F32, 1, {model.vocab_size, 0, 0, 0}};
    kv_logits(&t);
    int32_t best = digit_ids[0];
    for (uint32_t i = 1; i < n_digits; i++)
        if (logits[digit_ids[i]] > logits[best]) best = digit_ids[i];
    generated++;
    pending = best;
    return best;
}
