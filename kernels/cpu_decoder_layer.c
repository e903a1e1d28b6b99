/* One whole decoder layer of a decode step, bfloat16 activations on CPU, in one call.
 *
 * A decode step of a small model on a CPU is mostly dispatch: per layer, two norms, three matrix products, a
 * rotary embedding, two cache writes, the attention call, a gated activation and two residual adds, each a torch
 * or ctypes call costing 5-20 us in Python, against 150-200 us of arithmetic for a 135M model's layer at batch 1.
 * This file runs the same steps from C, calling the very functions the eager path calls (cpu_linear.c,
 * cpu_elementwise.c, cpu_paged_attention.c are compiled into this one library), with every bfloat16 rounding at
 * the same point, so a fused step equals an eager one bit for bit. `decoder_layers_bf16` runs a whole stack in one
 * call: a worker's model thread shares the Python interpreter lock with its event loop, and each return to Python
 * between layers waited for that lock while the loop streamed tokens out. Built and loaded by
 * kernels/cpu_decoder_layer.py. Returns 0, or the failing step's code: 10 + the norm's, 20 + qkv's, 30 + the
 * rotary's, 40 + attention's, 50 + o's, 60 + gate/up's, 70 + the activation's, 80 + down's, -2 out of memory.
 */
#include "cpu_linear.c"
#include "cpu_elementwise.c"
#include "cpu_paged_attention.c"

/* What does not change from step to step: a layer's weights (packed by kernels/quant_linear.py) and its cache. */
typedef struct {
    const uint16_t *ln1, *ln2; /* [hidden] */
    const uint8_t *w_qkv, *w_o, *w_gu, *w_down;
    int32_t fmt_qkv, fmt_o, fmt_gu, fmt_down;
    const float *b_qkv; /* NULL, or the fused q/k/v bias */
    uint16_t *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
} Layer;

/* The model's shape and this step's rows: T single-token sequences. */
typedef struct {
    int32_t T, hidden, heads, kv_heads, head_dim, inter, block_size, max_len, threads;
    float eps, scale;
    const uint16_t *cos, *sin; /* [T, head_dim] at row stride cs_stride */
    int64_t cs_stride;
    const int64_t *slots;  /* [T] cache slot of each new token */
    const int64_t *tables; /* [T, table_stride] block ids */
    int64_t table_stride;
    const int32_t *lens; /* [T] context lengths, the new token included */
} Step;

/* x += y, each rounded to bfloat16 as torch's bfloat16 add does */
static void add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

/* x [T, hidden] (rows contiguous) in place: x += attn(norm(x)); x += mlp(norm(x)); this step's K/V written. */
int decoder_layer_bf16(const Layer *L, const Step *S, uint16_t *x) {
    const int T = S->T, n = S->hidden, H = S->heads, KVH = S->kv_heads, D = S->head_dim, I = S->inter;
    const int th = S->threads, nqkv = (H + 2 * KVH) * D;
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)T * (size_t)(2 * n + nqkv + H * D + 3 * I));
    if (!buf) return -2;
    uint16_t *h = buf, *y = h + (size_t)T * n, *qkv = y + (size_t)T * n, *att = qkv + (size_t)T * nqkv;
    uint16_t *gu = att + (size_t)T * H * D, *act = gu + (size_t)T * 2 * I;
    int rc = 0;
#define STEP(call, base)                                                                                               \
    if ((rc = (call)) != 0) {                                                                                          \
        rc = rc == -2 ? -2 : (base) + (rc < 0 ? -rc : rc);                                                             \
        goto done;                                                                                                     \
    }
    STEP(rms_norm_bf16(x, n, L->ln1, h, T, n, S->eps, th), 10);
    STEP(linear(h, n, 1, T, n, L->w_qkv, L->fmt_qkv, nqkv, L->b_qkv, qkv, nqkv, 1, th), 20);
    STEP(rope_bf16(qkv, nqkv, S->cos, S->sin, S->cs_stride, T, H + KVH, D, th), 30);
    for (int t = 0; t < T; t++) {
        const uint16_t *row = qkv + (size_t)t * nqkv;
        memcpy(L->k_cache + S->slots[t] * KVH * D, row + H * D, sizeof(uint16_t) * KVH * D);
        memcpy(L->v_cache + S->slots[t] * KVH * D, row + (H + KVH) * D, sizeof(uint16_t) * KVH * D);
    }
    STEP(decode_attention_bf16(qkv, nqkv, D, L->k_cache, L->v_cache, S->tables, S->table_stride, S->lens, att, T,
                               H, KVH, D, S->block_size, S->scale, S->max_len, th),
         40);
    STEP(linear(att, H * D, 1, T, H * D, L->w_o, L->fmt_o, n, NULL, y, n, 1, th), 50);
    add_bf16(x, y, (int64_t)T * n);
    STEP(rms_norm_bf16(x, n, L->ln2, h, T, n, S->eps, th), 10);
    STEP(linear(h, n, 1, T, n, L->w_gu, L->fmt_gu, 2 * I, NULL, gu, 2 * I, 1, th), 60);
    STEP(silu_and_mul_bf16(gu, 2 * I, act, T, I, th), 70);
    STEP(linear(act, I, 1, T, I, L->w_down, L->fmt_down, n, NULL, y, n, 1, th), 80);
    add_bf16(x, y, (int64_t)T * n);
#undef STEP
done:
    free(buf);
    return rc;
}

/* Layers 0..n-1 in turn; on a failure, its code, with the layer's index in *failed. */
int decoder_layers_bf16(const Layer *layers, int n, const Step *S, uint16_t *x, int32_t *failed) {
    for (int i = 0; i < n; i++) {
        const int rc = decoder_layer_bf16(layers + i, S, x);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}
