/* hello.c — libwaste from C: open a model, chat-encode a prompt, stream a
 * greedy answer through the callback, read logits with waste_eval, decode
 * two sequences together (waste_step_many), answer in JSON held to a schema, save and reload the state, report an error.
 *
 *   cc hello.c -I ../include -L ../../target/release -lwaste -Wl,-rpath,../../target/release -o hello
 *   ./hello MODEL.waste "The city of Paris"
 *
 * With WASTE_TEMPLATE_HELPER set to the `waste` binary or to
 * `waste-render-template`, a container's chat_template.jinja renders in a
 * limited child process instead of this one (what a host that opens
 * containers it does not trust should do).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "waste.h"

static int check(waste_status s, const char *what) {
    if (s != WASTE_OK) {
        fprintf(stderr, "%s failed (%d): %s\n", what, (int)s, waste_last_error());
        exit(1);
    }
    return 0;
}

struct collected {
    uint32_t ids[256];
    size_t n;
    char text[4096];
    size_t len;
};

static int on_token(const waste_token_event *ev, void *user) {
    struct collected *c = (struct collected *)user;
    if (ev->token != UINT32_MAX && c->n < 256) c->ids[c->n++] = ev->token;
    if (c->len + ev->piece_len < sizeof c->text) {
        memcpy(c->text + c->len, ev->piece, ev->piece_len);
        c->len += ev->piece_len;
        c->text[c->len] = 0;
    }
    return 0; /* keep going */
}

static size_t argmax(const float *l, size_t n) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (l[i] > l[best]) best = i;
    return best;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.waste PROMPT [IMAGE]\n", argv[0]);
        return 2;
    }
    printf("version %s\n", waste_version());

    const char *helper = getenv("WASTE_TEMPLATE_HELPER");
    if (helper) {
        check(waste_use_template_sandbox(helper), "waste_use_template_sandbox");
        printf("templates render in %s\n", helper);
    }

    waste_options opt;
    waste_options_init(&opt);
    opt.ctx_tokens = 256;
    opt.threads = 1;
    opt.images = argc > 3; /* an image needs K3's vision tower */
    waste_model *m = NULL;
    check(waste_open(argv[1], &opt, &m), "waste_open");
    waste_info info;
    check(waste_model_info(m, &info), "waste_model_info");
    printf("layers %u experts %u top_k %u vocab %u params %llu\n", info.layers, info.experts, info.top_k, info.vocab,
           (unsigned long long)info.params_total);

    waste_message msg = {"user", argv[2]};
    uint32_t prompt[1024];
    size_t n_prompt = 0;
    check(waste_chat_encode(m, &msg, 1, 1, prompt, 1024, &n_prompt), "waste_chat_encode");

    waste_session *s = NULL;
    check(waste_session_new(m, &s), "waste_session_new");
    waste_generate_params p;
    waste_generate_params_init(&p);
    p.max_tokens = 8;
    struct collected c = {0};
    waste_generate_result r;
    check(waste_generate(s, prompt, n_prompt, &p, on_token, &c, &r), "waste_generate");
    printf("generated");
    for (size_t i = 0; i < c.n; i++) printf(" %u", c.ids[i]);
    printf("\nfinish %d tokens %zu position %zu\n", (int)r.finish, r.n_tokens, waste_session_position(s));

    /* the state survives a save and a load into a fresh session */
    const char *state = "waste-hello.state";
    check(waste_state_save(s, state), "waste_state_save");
    waste_session *s2 = NULL;
    check(waste_session_new(m, &s2), "waste_session_new");
    check(waste_state_load(s2, state), "waste_state_load");
    printf("state %s\n", waste_session_position(s2) == waste_session_position(s) ? "ok" : "MISMATCH");
    remove(state);

    /* logits for a host that samples itself */
    check(waste_session_reset(s2), "waste_session_reset");
    const float *logits = NULL;
    size_t n_logits = 0;
    check(waste_eval(s2, prompt, n_prompt, &logits, &n_logits), "waste_eval");
    printf("argmax %zu of %zu\n", argmax(logits, n_logits), n_logits);

    /* two sequences decoded together (the prompt, and the prompt less its
     * last two ids), greedy: each gets the tokens it would alone */
    {
        waste_session *pair[2] = {s2, NULL};
        check(waste_session_new(m, &pair[1]), "waste_session_new");
        check(waste_session_reset(s2), "waste_session_reset");
        size_t lens[2] = {n_prompt, n_prompt > 2 ? n_prompt - 2 : n_prompt};
        uint32_t next[2], got[2][6];
        for (int i = 0; i < 2; i++) {
            check(waste_eval(pair[i], prompt, lens[i], &logits, &n_logits), "waste_eval");
            next[i] = (uint32_t)argmax(logits, n_logits);
        }
        for (int t = 0; t < 6; t++) {
            for (int i = 0; i < 2; i++) got[i][t] = next[i];
            check(waste_step_many(pair, 2, next), "waste_step_many");
            for (int i = 0; i < 2; i++) {
                check(waste_session_logits(pair[i], &logits, &n_logits), "waste_session_logits");
                next[i] = (uint32_t)argmax(logits, n_logits);
            }
        }
        for (int i = 0; i < 2; i++) {
            printf("together %d", i);
            for (int t = 0; t < 6; t++) printf(" %u", got[i][t]);
            printf("\n");
        }
        printf("batch at most %zu\n", waste_max_batch(m));
        waste_session_free(pair[1]);
    }

    /* JSON held to a schema, sampled at temperature 1 */
    check(waste_session_reset(s2), "waste_session_reset");
    waste_generate_params j;
    waste_generate_params_init(&j);
    j.temperature = 1.0f;
    j.seed = 3;
    j.max_tokens = 64;
    j.json_schema = "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":9}},"
                    "\"required\":[\"n\"],\"additionalProperties\":false}";
    struct collected jc = {0};
    check(waste_generate(s2, prompt, n_prompt, &j, on_token, &jc, &r), "waste_generate (json)");
    printf("json %s\n", jc.text);

    /* an image: announced in the prompt, queued, spliced at its placeholder */
    if (argc > 3) {
        FILE *f = fopen(argv[3], "rb");
        if (!f) {
            fprintf(stderr, "cannot open %s\n", argv[3]);
            return 1;
        }
        static uint8_t img[1 << 20];
        size_t len = fread(img, 1, sizeof img, f);
        int more = fgetc(f) != EOF;
        fclose(f);
        if (more) {
            fprintf(stderr, "%s is larger than this example's %zu-byte buffer\n", argv[3], sizeof img);
            return 1;
        }
        uint32_t w = 0, h = 0;
        size_t positions = 0;
        check(waste_image_info(m, img, len, &w, &h, &positions), "waste_image_info");
        char markup[256];
        snprintf(markup, sizeof markup, "<|media_begin|>image %ux%u<|media_content|><|media_pad|><|media_end|>", w, h);
        uint32_t ids[256];
        size_t n_ids = 0;
        check(waste_tokenize(m, markup, 1, ids, 256, &n_ids), "waste_tokenize");
        check(waste_session_reset(s2), "waste_session_reset");
        size_t added = 0;
        check(waste_image_add(s2, img, len, &added), "waste_image_add");
        check(waste_eval(s2, ids, n_ids, &logits, &n_logits), "waste_eval (image)");
        printf("image %ux%u positions %zu ids %zu position %zu\n", w, h, added, n_ids, waste_session_position(s2));
    }

    waste_stats st;
    check(waste_session_stats(s, &st), "waste_session_stats");
    printf("experts hit %llu missed %llu\n", (unsigned long long)st.experts_hit, (unsigned long long)st.experts_missed);

    /* errors come back as a status and a message, never a crash */
    waste_model *bad = NULL;
    waste_status e = waste_open("/nonexistent/model.waste", &opt, &bad);
    printf("error %d %s\n", (int)e, waste_last_error());

    waste_session_free(s);
    waste_close(m); /* the second session still holds the model */
    waste_session_free(s2);
    return 0;
}
