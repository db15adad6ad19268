/* Fuzz harness for rpc_watch.c: any bytes, any split, both roles; no crash, no read or write out
 * of bounds (build with sanitizers), the watch never releases more than it was shown, and every
 * event text is one line of printable ASCII.
 *
 *   libFuzzer:  cmake -DMESH_FUZZ=ON -DCMAKE_C_COMPILER=clang ... && ./fuzz_rpc_watch CORPUS
 *   standalone: cc -DMESH_FUZZ_STANDALONE -fsanitize=address,undefined fuzz_rpc_watch.c rpc_watch.c -lm
 *               ./a.out ITERATIONS SEED   (random inputs and mutations of a valid stream; the tests run it)
 *
 * Input: byte 0 picks the role (bit 0 check, bit 1 rewrite); then chunks of
 * [side u8 (bit 0: server)] [length u8] [bytes]. The dialect rows below are a fixed sample of
 * what the sidecar tells the relay (net/data_plane/control_lines.py): enough to reach every state.
 */
#include <assert.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_watch.h"

static struct rw_rules rules;

static void init_rules(void) {
    static const int no_reply[] = {4, 5, 6, 10, 12, 16, 17};
    for (int i = 0; i < 2; i++) {
        struct rw_dialect *d = &rules.dialects[i];
        snprintf(d->name, sizeof d->name, i ? "upstream-7" : "mesh-b2b-7");
        d->major = 7;
        d->max_minor = -1;
        d->hello_request_bytes = 24;
        d->hello_reply_bytes = 28;
        d->required_flags = i ? 0 : 1;
        d->register_peer_cmd = i ? RW_NO_CMD : 18;
        d->push_tensor_cmd = i ? RW_NO_CMD : 19;
        d->last_cmd = i ? 17 : 22;
        for (size_t k = 0; k < sizeof no_reply / sizeof no_reply[0]; k++) d->no_reply[no_reply[k]] = 1;
        if (!i) d->no_reply[20] = d->no_reply[21] = d->no_reply[22] = d->async_push[20] = d->async_push[21] = 1;
    }
    rules.n_dialects = 2;
    rules.max_frame_bytes = 1ull << 36;
    rules.max_held_before_reply = 64 * 1024;
    rules.max_checked_bytes = 1 << 20;
}

static int judge(void *ctx, const struct rw_measured *t) { (void)ctx; return !t->finite || t->rms > 1e6 || t->max_abs > 1e8; }
static const char *resolve(void *ctx, uint32_t index) { (void)ctx; return index == 0 ? "127.0.0.1:40001" : NULL; }

struct held { uint8_t *data; uint64_t len; };

static void feed(struct rpc_watch *w, struct held *h, int server, const uint8_t *bytes, size_t n) {
    uint8_t *grown = realloc(h->data, h->len + n + 1);
    assert(grown);
    h->data = grown;
    memcpy(h->data + h->len, bytes, n);
    h->len += n;
    uint64_t release = server ? rw_from_server(w, h->data, h->len) : rw_from_client(w, h->data, h->len);
    assert(release <= h->len);
    memmove(h->data, h->data + release, h->len - release);
    h->len -= release;
    const char *text;
    while (rw_next_event(w, &text) != RW_EV_NONE) {
        assert(strlen(text) < 192);
        /* one line of printable ASCII: event texts become report lines, whatever the peer sent */
        for (const char *c = text; *c; c++) assert(*c >= 0x20 && *c <= 0x7e);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!rules.n_dialects) init_rules();
    if (size < 1) return 0;
    struct rpc_watch *w = malloc(sizeof *w);
    assert(w);
    rw_init(w, &rules, data[0] & 1, (data[0] >> 1) & 1, judge, resolve, NULL);
    struct held up = {0}, down = {0};
    for (size_t i = 1; i + 2 <= size;) {
        int server = data[i] & 1;
        size_t n = data[i + 1];
        i += 2;
        if (n > size - i) n = size - i;
        feed(w, server ? &down : &up, server, data + i, n);
        i += n;
        (void)rw_replies_owed(w);
    }
    free(up.data);
    free(down.data);
    free(w);
    return 0;
}

#ifdef MESH_FUZZ_STANDALONE
static uint64_t state;
static uint64_t next_random(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

/* A valid exchange to mutate: HELLO, its b2b reply, a REGISTER_PEER and a checked GET_TENSOR. */
static size_t seed_stream(uint8_t *out) {
    size_t n = 0;
    uint8_t hello[9 + 24] = {14, 24};
    uint8_t reply[8 + 28] = {28, 0, 0, 0, 0, 0, 0, 0, 7, 0, 2, 1};
    uint8_t reg[9 + 132] = {18, 132};
    uint8_t get[9 + 312] = {8, 56, 1};
    uint8_t tensor_reply[8 + 16] = {16};
    const struct { int server; const uint8_t *bytes; size_t len; } parts[] = {
        {0, hello, sizeof hello}, {1, reply, sizeof reply}, {0, reg, sizeof reg},
        {0, get, sizeof get}, {1, tensor_reply, sizeof tensor_reply}};
    get[9 + 296 + 8] = 16; /* size asked: 16 bytes of F32 */
    out[n++] = 3;
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++)
        for (size_t i = 0; i < parts[p].len; i += 200) {
            size_t len = parts[p].len - i < 200 ? parts[p].len - i : 200;
            out[n++] = (uint8_t)parts[p].server;
            out[n++] = (uint8_t)len;
            memcpy(out + n, parts[p].bytes + i, len);
            n += len;
        }
    return n;
}

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 10000;
    state = argc > 2 ? strtoull(argv[2], NULL, 10) | 1 : 88172645463325252ull;
    uint8_t seed[2048], input[2048];
    size_t seed_len = seed_stream(seed);
    for (long it = 0; it < iterations; it++) {
        size_t len;
        if (it % 2) { /* a mutated valid stream */
            memcpy(input, seed, seed_len);
            len = seed_len;
            for (int k = (int)(next_random() % 8) + 1; k; k--) input[next_random() % len] = (uint8_t)next_random();
        } else { /* random bytes */
            len = next_random() % sizeof input;
            for (size_t i = 0; i < len; i++) input[i] = (uint8_t)next_random();
        }
        LLVMFuzzerTestOneInput(input, len);
    }
    printf("ok %ld inputs\n", iterations);
    return 0;
}
#endif
