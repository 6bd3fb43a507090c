/* waste.h — the C ABI of WASTE-rs (libwaste).
 *
 * Opaque handles, status codes, and waste_last_error() for the message of
 * the last failure on the calling thread. Nothing prints, nothing exits.
 * Strings are UTF-8, NUL-terminated. Buffers follow the two-call pattern:
 * a function that fills (buf, cap) sets *len to the size it needs and
 * returns WASTE_E_ARG when cap is too small.
 *
 * Lifetimes: a session keeps its model alive; free sessions and close
 * models in any order. A handle must not be used from two threads at once.
 */
#ifndef WASTE_H
#define WASTE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum waste_status {
    WASTE_OK = 0,
    WASTE_E_IO = 1,          /* file or device error */
    WASTE_E_FORMAT = 2,      /* malformed or damaged container / state / usage file */
    WASTE_E_BUDGET = 3,      /* the RAM budget is below the model's floor */
    WASTE_E_OOM = 4,         /* an allocation failed */
    WASTE_E_ARG = 5,         /* a bad argument: a buffer too small, more tokens or text than
                              * the context holds, a grammar or an image that cannot be used */
    WASTE_E_UNSUPPORTED = 6, /* not implemented by the engine */
    WASTE_E_CANCELLED = 7,   /* the caller cancelled */
    WASTE_E_INTERNAL = 8,    /* an engine bug (a caught panic) */
    WASTE_E_INCOMPLETE = 9   /* the session is partly updated after a failed step:
                              * waste_session_reset or waste_state_load first */
} waste_status;

typedef enum waste_finish {
    WASTE_FINISH_STOP = 0,         /* an end token or a stop string */
    WASTE_FINISH_LENGTH = 1,       /* max_tokens reached */
    WASTE_FINISH_CONTEXT_FULL = 2, /* the context bound filled first */
    WASTE_FINISH_CANCELLED = 3     /* the callback asked to stop */
} waste_finish;

typedef struct waste_model waste_model;
typedef struct waste_session waste_session;

typedef struct waste_options {
    uint64_t budget_bytes;  /* 0 = pick from the machine's RAM */
    uint32_t ctx_tokens;    /* hard context bound */
    uint32_t threads;       /* 0 = all cores */
    uint32_t io_threads;    /* 0 = default */
    int32_t direct_io;      /* 1 = bypass the page cache for experts */
    int32_t verify_records; /* 1 = CRC every expert read */
    const char *usage_path; /* usage hotlist to preload, or NULL */
    int32_t images;         /* 1 = load K3's vision tower (images in prompts) */
    int32_t fast;           /* 1 = the fast numeric mode: 8-bit activations for Q8G/Q4G
                               products, 8-bit VQ lookup tables (issue 50's quality
                               contract), 0 = exact, -1 = the engine's default
                               (waste_options_init's: WASTE_NUMERIC if set, else fast
                               on AVX2 and AVX-512 with VNNI and VBMI, exact elsewhere);
                               in what was tail padding, so the size is unchanged */
} waste_options;

typedef struct waste_plan {
    uint64_t trunk_bytes, state_bytes, scratch_bytes, min_expert_cache_bytes;
    uint64_t floor_bytes, working_set_bytes, recommended_bytes, record_bytes, ctx;
} waste_plan;

typedef struct waste_info {
    uint32_t layers, moe_layers, experts, top_k, shared_experts, hidden, vocab;
    uint64_t params_total, params_active;
    uint64_t expert_record_bytes;
} waste_info;

typedef struct waste_stats {
    uint64_t tokens, experts_hit, experts_missed, bytes_read, prefetch_issued;
    double io_seconds, trunk_seconds, attn_seconds, expert_seconds;
} waste_stats;

typedef struct waste_message {
    const char *role;    /* "system", "user", "assistant", "tool" */
    const char *content; /* plain text: can never become control tokens */
} waste_message;

typedef struct waste_generate_params {
    float temperature;   /* 0 = greedy */
    float top_p;         /* 1 = off */
    float min_p;         /* 0 = off */
    uint32_t top_k;      /* 0 = off */
    uint64_t seed;
    uint32_t max_tokens;
    const char *const *stop_strings; /* never emitted; matched across tokens */
    size_t n_stop_strings;
    const uint32_t *stop_tokens;     /* in addition to the model's end tokens */
    size_t n_stop_tokens;
    const char *json_schema;         /* constrain the output to this JSON schema, or NULL */
    uint32_t top_logprobs;           /* alternatives per token in the event (0..20) */
} waste_generate_params;

typedef struct waste_token_event {
    uint32_t token;       /* UINT32_MAX for a final flush of held-back text */
    const char *piece;    /* text that became final with this token (not NUL-terminated) */
    size_t piece_len;
    float logprob;
    const uint32_t *top_ids; /* top_logprobs alternatives */
    const float *top_logprobs;
    size_t n_top;
    uint64_t experts_hit, experts_missed, bytes_read;
    double seconds, io_seconds;
} waste_token_event;

/* Return non-zero to cancel the generation. */
typedef int (*waste_token_callback)(const waste_token_event *event, void *user);

typedef struct waste_generate_result {
    waste_finish finish;
    uint32_t stop_token;   /* with WASTE_FINISH_STOP by a token */
    size_t n_tokens;       /* tokens generated */
    size_t prompt_tokens;
} waste_generate_result;

/* Library */
const char *waste_version(void);          /* "0.1.0 (avx2)" */
const char *waste_last_error(void);       /* "" when the last call succeeded */
uint64_t waste_physical_ram(void);
uint64_t waste_usable_ram(void);          /* cgroup-aware */
void waste_options_init(waste_options *options);
waste_status waste_plan_for(const char *path, uint32_t ctx_tokens, waste_plan *out);

/* Models */
waste_status waste_open(const char *path, const waste_options *options, waste_model **out);
void waste_close(waste_model *model);
waste_status waste_model_info(const waste_model *model, waste_info *out);
uint64_t waste_memory_used(const waste_model *model);
/* waste_save_usage and waste_state_save replace a file at path only when it
 * is empty or one they wrote (a usage hotlist / a state file): anything
 * else is left as it was and the call fails with WASTE_E_FORMAT. */
waste_status waste_save_usage(const waste_model *model, const char *path, uint64_t tokens);

/* Text */
waste_status waste_tokenize(const waste_model *model, const char *text, int32_t markup, uint32_t *ids, size_t cap, size_t *n);
waste_status waste_detokenize(const waste_model *model, const uint32_t *ids, size_t n_ids, char *buf, size_t cap, size_t *len);
/* The messages in the model's chat template, as token ids (BOS first when
 * the model has one; template text as markup, contents as plain text).
 * open = 1: end with the assistant's generation prefix, the prompt a
 * waste_generate answers; open = 0: the messages alone (a finished exchange
 * to evaluate into a session, or to count its tokens). ids has room for
 * cap ids; *n is the count needed (WASTE_E_ARG when cap is smaller). */
waste_status waste_chat_encode(const waste_model *model, const waste_message *messages, size_t n_messages, int32_t open, uint32_t *ids, size_t cap, size_t *n);
/* waste_chat_encode, which renders thinking off, with thinking set: think =
 * 0 off, 1 low, 2 medium, 3 high, 4 max (K3's tagged format: the prompt
 * opens the reasoning channel, after a thinking_effort notice; the server's
 * reasoning_effort levels). A model whose chat format has no thinking mode
 * takes only 0 (else WASTE_E_ARG, as another value is). */
waste_status waste_chat_encode_think(const waste_model *model, const waste_message *messages, size_t n_messages, int32_t open, int32_t think, uint32_t *ids, size_t cap, size_t *n);
/* A container's chat_template.jinja is code: rendered in this process, a
 * hostile one can exhaust its memory. After this call every rendering runs
 * in a child process limited in memory and CPU time: helper is the path of
 * the `waste` binary or of `waste-render-template`; it is tried once here
 * (WASTE_E_ARG if it does not render). Once per process (the same helper
 * again is WASTE_OK). */
waste_status waste_use_template_sandbox(const char *helper);

/* Images (K3 with a vision tower; open with images = 1). An image is
 * announced in the prompt as the markup
 * "<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>"
 * (tokenized with markup = 1, W x H the file's size); waste_image_add queues
 * it for the next <|media_pad|>, which then stands for its positions. */
waste_status waste_image_info(const waste_model *model, const uint8_t *data, size_t len, uint32_t *width, uint32_t *height, size_t *positions);
waste_status waste_image_add(waste_session *session, const uint8_t *data, size_t len, size_t *positions);

/* Sessions. A waste_eval or waste_generate that fails in the computation
 * (an I/O error, a damaged record, non-finite logits) may leave the
 * session's state partly updated: every later eval, generate or
 * waste_state_save then returns WASTE_E_INCOMPLETE until waste_session_reset
 * or waste_state_load. */
waste_status waste_session_new(waste_model *model, waste_session **out);
void waste_session_free(waste_session *session);
waste_status waste_session_reset(waste_session *session);
size_t waste_session_position(const waste_session *session);
waste_status waste_session_stats(const waste_session *session, waste_stats *out);
waste_status waste_eval(waste_session *session, const uint32_t *ids, size_t n_ids, const float **logits, size_t *n_logits);
/* The logits of the session's last evaluated position, valid until its next call. */
waste_status waste_session_logits(const waste_session *session, const float **logits, size_t *n_logits);

/* Several sequences decoded together: waste_step_many advances n sessions
 * of one model by one token each (ids[i] for sessions[i]), reading each
 * layer's weights and each routed expert once for all of them; each
 * session's logits are bit-identical to a waste_eval of its token alone.
 * At most waste_max_batch(model) sessions, each listed once. A failure in
 * the computation leaves every listed session WASTE_E_INCOMPLETE.
 *
 *     waste_session *s[2]; uint32_t next[2];   // prompts evaluated, next tokens sampled
 *     for (int t = 0; t < 16; t++) {
 *         if (waste_step_many(s, 2, next) != WASTE_OK) break;
 *         for (int i = 0; i < 2; i++) {
 *             const float *l; size_t nl;
 *             waste_session_logits(s[i], &l, &nl);
 *             next[i] = argmax(l, nl);
 *         }
 *     }
 */
waste_status waste_step_many(waste_session *const *sessions, size_t n, const uint32_t *ids);
size_t waste_max_batch(const waste_model *model);
void waste_generate_params_init(waste_generate_params *params);
waste_status waste_generate(waste_session *session, const uint32_t *prompt, size_t n_prompt, const waste_generate_params *params,
                            waste_token_callback callback, void *user, waste_generate_result *out);
waste_status waste_state_save(const waste_session *session, const char *path);
waste_status waste_state_load(waste_session *session, const char *path);

#ifdef __cplusplus
}
#endif
#endif /* WASTE_H */
