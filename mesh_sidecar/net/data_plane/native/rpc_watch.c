/* rpc_watch: see rpc_watch.h. Mirrors wire/rpc_framing.py and wire/rpc_outputs.py rule for rule;
 * tests/integration/test_native_watch.py feeds both the same streams, split at every boundary. */
#include "rpc_watch.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define NO_HOLD UINT64_MAX
#define WORD_CHARS 80 /* a word of peer bytes in an event text: a real endpoint is far shorter */
#define EVENT_SLOTS (sizeof ((struct rpc_watch *)0)->events / sizeof ((struct rpc_watch *)0)->events[0])

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

static void push_event(struct rpc_watch *w, enum rw_event_kind kind, const char *text) {
    if (w->events_count == EVENT_SLOTS) { /* events are rare; a full queue drops the newest, counted */
        w->events_dropped++;
        return;
    }
    size_t slot = (w->events_head + w->events_count++) % EVENT_SLOTS;
    w->events[slot] = kind;
    snprintf(w->event_text[slot], sizeof w->event_text[slot], "%s", text);
}

enum rw_event_kind rw_next_event(struct rpc_watch *w, const char **text) {
    if (!w->events_count && w->events_dropped) {
        snprintf(w->dropped_text, sizeof w->dropped_text, "%llu", (unsigned long long)w->events_dropped);
        w->events_dropped = 0;
        *text = w->dropped_text;
        return RW_EV_DROPPED;
    }
    if (!w->events_count) return RW_EV_NONE;
    size_t slot = w->events_head;
    w->events_head = (w->events_head + 1) % EVENT_SLOTS;
    w->events_count--;
    *text = w->event_text[slot];
    return w->events[slot];
}

static void go_off(struct rpc_watch *w, const char *why) {
    w->phase = RW_OFF;
    push_event(w, RW_EV_OFF, why);
}

static void go_broken(struct rpc_watch *w, const char *why) {
    w->phase = RW_BROKEN;
    push_event(w, RW_EV_BROKEN, why);
}

/* The server broke the protocol where the check reads it: as for a rejected tensor, nothing more goes
 * on and the relay resets the connection. Only the client (llama-server, trusted) may switch the check
 * off; a worker that could would send garbage unchecked from then on. `why` starts with its reason. */
static void go_violated(struct rpc_watch *w, const char *why) {
    w->phase = RW_REJECTED;
    push_event(w, RW_EV_VIOLATION, why);
}

static int plain_byte(uint8_t b) { return b > 0x20 && b < 0x7f && b != '\\'; }

/* Bytes from the wire as one word of an event text (event texts are one line of printable ASCII:
 * they end up in the sidecar's reports and logs). 0x21-0x7e pass, but for the backslash; every other
 * byte is written \xNN; an empty input is "-"; over max_chars, the whole escapes that fit in
 * max_chars - 3, then "...". `out` holds max_chars + 1. rpc_framing.py's printable_word is the same. */
static void printable_word(char *out, size_t max_chars, const uint8_t *in, size_t len) {
    size_t total = 0, n = 0;
    for (size_t i = 0; i < len; i++) total += plain_byte(in[i]) ? 1 : 4;
    size_t room = total > max_chars ? max_chars - 3 : max_chars;
    for (size_t i = 0; i < len && n + (plain_byte(in[i]) ? 1 : 4) <= room; i++) {
        if (plain_byte(in[i])) out[n++] = (char)in[i];
        else n += (size_t)snprintf(out + n, 5, "\\x%02x", in[i]);
    }
    if (total > max_chars) {
        memcpy(out + n, "...", 3);
        n += 3;
    }
    if (!len) out[n++] = '-';
    out[n] = '\0';
}

void rw_init(struct rpc_watch *w, const struct rw_rules *rules, int check, int rewrite,
             rw_judge_fn judge, rw_resolve_fn resolve, void *ctx) {
    memset(w, 0, sizeof *w);
    w->rules = rules;
    w->check = check;
    w->rewrite = rewrite;
    w->judge = judge;
    w->resolve = resolve;
    w->ctx = ctx;
    w->phase = (check || rewrite) ? RW_HELLO : RW_OFF;
    w->hello_request_bytes = -1;
    w->tap_cmd = RW_NO_CMD;
    w->up_hold = w->down_hold = NO_HOLD;
}

/* --- measuring ---------------------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) value = ldexpf((float)mantissa, -24);
    else if (exponent == 31) value = mantissa ? NAN : INFINITY;
    else value = ldexpf((float)(mantissa | 0x400), exponent - 25);
    return (h & 0x8000) ? -value : value;
}

void rw_measure(struct rw_measured *out, const uint8_t *data, uint64_t bytes, int ggml_type) {
    /* One pass in double: the sum of squares is NaN or Inf exactly when a value is (no float
     * squares past double's range), so finiteness costs no second pass; the largest |value| rides
     * along (a NaN never wins a comparison, and then it is not read). */
    double sum = 0.0, max_abs = 0.0;
    uint64_t n = 0;
    if (ggml_type == RW_GGML_TYPE_F32) {
        n = bytes / 4;
        for (uint64_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, data + 4 * i, 4);
            double d = f;
            sum += d * d;
            max_abs = fabs(d) > max_abs ? fabs(d) : max_abs;
        }
    } else {
        static float table[65536];
        static int table_ready;
        if (!table_ready) {
            for (uint32_t h = 0; h < 65536; h++) table[h] = half_to_float((uint16_t)h);
            table_ready = 1;
        }
        n = bytes / 2;
        for (uint64_t i = 0; i < n; i++) {
            double d = table[data[2 * i] | data[2 * i + 1] << 8];
            sum += d * d;
            max_abs = fabs(d) > max_abs ? fabs(d) : max_abs;
        }
    }
    out->values = n;
    out->finite = isfinite(sum);
    out->rms = (n && out->finite) ? sqrt(sum / (double)n) : 0.0;
    out->max_abs = out->finite ? max_abs : 0.0;
}

/* --- client -> server ----------------------------------------------------------------------- */

/* llama.cpp names every layer's output l_out-N (a copy on another device: <dev>#l_out-N#<k>). */
static int is_layer_output(const char *name) {
    for (const char *p = strstr(name, "l_out-"); p; p = strstr(p + 1, "l_out-")) {
        if (p != name && p[-1] != '#') continue;
        const char *q = p + 6;
        if (*q < '0' || *q > '9') continue;
        while (*q >= '0' && *q <= '9') q++;
        if (*q == '\0' || *q == '#') return 1;
    }
    return 0;
}

static void tensor_name(char out[RW_TENSOR_NAME_BYTES + 1], const uint8_t *tensor) {
    memcpy(out, tensor + RW_TENSOR_NAME_OFFSET, RW_TENSOR_NAME_BYTES);
    out[RW_TENSOR_NAME_BYTES] = '\0';
}

static void expect_reply(struct rpc_watch *w, const struct rw_expected *expected) {
    if (w->pending_count == RW_MAX_PENDING) {
        go_off(w, "more replies owed than the check follows");
        return;
    }
    w->pending[(w->pending_head + w->pending_count++) % RW_MAX_PENDING] = *expected;
}

/* A GET_TENSOR's head is read: what its reply will be. */
static void on_get_tensor_head(struct rpc_watch *w, const uint8_t *head) {
    struct rw_expected e = {0};
    uint32_t type = le32(head + RW_TENSOR_TYPE_OFFSET);
    uint64_t size = le64(head + RW_TENSOR_BYTES + 8);
    uint64_t width = type == RW_GGML_TYPE_F32 ? 4 : type == RW_GGML_TYPE_F16 ? 2 : 0;
    if (width && size <= w->rules->max_checked_bytes && size % width == 0) {
        e.checked = 1;
        e.ggml_type = (int)type;
        e.size = size;
        tensor_name(e.name, head);
    }
    expect_reply(w, &e);
}

static void on_tap(struct rpc_watch *w) {
    const uint8_t *tap = w->tap;
    int cmd = w->tap_cmd;
    w->tap_cmd = RW_NO_CMD;
    if (cmd == RW_ALLOC_BUFFER_CMD) {
        w->allocated_bytes += le64(tap + 4);
        return;
    }
    if (cmd == w->dialect->push_tensor_cmd) {
        w->activation_bytes += w->tap_frame_bytes + RW_REPLY_SIZE_BYTES + 1;
        return;
    }
    if (w->rewrite) {
        char name[RW_TENSOR_NAME_BYTES + 1];
        tensor_name(name, tap);
        if (is_layer_output(name)) {
            w->activation_bytes += w->tap_frame_bytes;
            if (cmd == RW_GET_TENSOR_CMD) w->activation_bytes += RW_REPLY_SIZE_BYTES + le64(tap + RW_TENSOR_BYTES + 8);
        }
    }
    if (cmd == RW_GET_TENSOR_CMD && w->check) on_get_tensor_head(w, tap);
}

static void start_tap(struct rpc_watch *w, int cmd, uint64_t size) {
    const struct rw_dialect *d = w->dialect;
    uint64_t need;
    if (w->rewrite && d->async_push[cmd]) {
        w->activation_bytes += RW_HEADER_BYTES + size;
        return;
    }
    if (cmd == RW_ALLOC_BUFFER_CMD && d->major == 7 && w->rewrite) need = 12;
    else if (cmd == RW_SET_TENSOR_CMD && w->rewrite) need = RW_TENSOR_NAME_OFFSET + RW_TENSOR_NAME_BYTES;
    else if (cmd == RW_GET_TENSOR_CMD) need = RW_GET_TENSOR_HEAD_BYTES;
    else if (cmd == d->push_tensor_cmd && w->rewrite) need = 4 + RW_TENSOR_NAME_OFFSET + RW_TENSOR_NAME_BYTES;
    else return;
    if (size < need) {
        if (cmd == RW_GET_TENSOR_CMD && w->check) {
            char why[64];
            snprintf(why, sizeof why, "a GET_TENSOR of %llu bytes", (unsigned long long)size);
            go_off(w, why); /* rpc-server closes the connection on it */
        }
        return; /* malformed: rpc-server will close the connection */
    }
    w->tap_cmd = cmd;
    w->tap_len = 0;
    w->tap_need = need;
    w->tap_frame_bytes = RW_HEADER_BYTES + size;
}

static int hello_request_size_known(const struct rw_rules *rules, uint64_t size) {
    for (int i = 0; i < rules->n_dialects; i++)
        if (rules->dialects[i].hello_request_bytes == size) return 1;
    return 0;
}

static void on_header(struct rpc_watch *w) {
    int cmd = w->header[0];
    uint64_t size = le64(w->header + 1);
    char why[128];
    w->frames++;
    if (w->phase == RW_HELLO) {
        if (cmd != RW_HELLO_CMD || w->hello_request_bytes >= 0) {
            snprintf(why, sizeof why, w->check ? "command %d before the HELLO reply"
                                               : "the first command is %d, not HELLO (14)", cmd);
            go_off(w, why);
            return;
        }
        if (!hello_request_size_known(w->rules, size)) { /* the client's choice: no dialect to read */
            snprintf(why, sizeof why, "the HELLO request has %llu bytes, no known dialect's size",
                     (unsigned long long)size);
            go_off(w, why);
            return;
        }
        w->hello_request_bytes = (int64_t)size;
        w->skip = size;
        if (w->check) {
            struct rw_expected hello = {.hello = 1};
            expect_reply(w, &hello);
        }
        return;
    }
    if (w->rewrite && size > w->rules->max_frame_bytes) {
        snprintf(why, sizeof why, "RPC command %d declares a %llu-byte payload, over the %llu-byte limit",
                 cmd, (unsigned long long)size, (unsigned long long)w->rules->max_frame_bytes);
        go_broken(w, why);
        return;
    }
    const struct rw_dialect *d = w->dialect;
    if (w->check && cmd > d->last_cmd) {
        snprintf(why, sizeof why, "unknown command %d", cmd);
        go_off(w, why);
        return;
    }
    w->skip = size;
    if (w->rewrite && cmd == d->register_peer_cmd && size == RW_REGISTER_PAYLOAD_BYTES) {
        w->registering = 1; /* held from its header on, rewritten whole */
        return;
    }
    start_tap(w, cmd, size);
    if (w->check && cmd != RW_GET_TENSOR_CMD && !d->no_reply[cmd]) {
        struct rw_expected unchecked = {0};
        expect_reply(w, &unchecked);
    }
}

static void rewrite_register_peer(struct rpc_watch *w, uint8_t *frame) {
    uint8_t *field = frame + RW_HEADER_BYTES + 4;
    uint32_t peer = le32(frame + RW_HEADER_BYTES);
    char original[WORD_CHARS + 1], text[192];
    /* the member's bytes, up to the NUL: escaped, as they go into a report line */
    const uint8_t *nul = memchr(field, 0, RW_REGISTER_ENDPOINT_BYTES);
    printable_word(original, WORD_CHARS, field, nul ? (size_t)(nul - field) : RW_REGISTER_ENDPOINT_BYTES);
    const char *endpoint = w->resolve ? w->resolve(w->ctx, peer) : NULL;
    /* An endpoint we cannot map is cleared, never passed on: it means nothing on this machine.
     * The server answers an empty endpoint with 0 and the client copies through the serving node. */
    memset(field, 0, RW_REGISTER_ENDPOINT_BYTES);
    if (endpoint == NULL || strlen(endpoint) >= RW_REGISTER_ENDPOINT_BYTES) {
        snprintf(text, sizeof text, "%u", peer);
        push_event(w, RW_EV_UNRESOLVED, text);
        return;
    }
    memcpy(field, endpoint, strlen(endpoint));
    snprintf(text, sizeof text, "%u %s %.80s", peer, original, endpoint);
    push_event(w, RW_EV_REWRITTEN, text);
}

uint64_t rw_from_client(struct rpc_watch *w, uint8_t *data, uint64_t len) {
    uint64_t pos = w->up_parsed, hold = w->up_hold;
    while (pos < len) {
        if (w->phase == RW_OFF || w->phase == RW_BROKEN) {
            hold = NO_HOLD;
            pos = len;
            break;
        }
        if (w->phase == RW_REJECTED) break; /* the caller closes; nothing more is read */
        if (w->skip) {
            uint64_t take = min64(w->skip, len - pos);
            if (w->tap_cmd != RW_NO_CMD) {
                uint64_t copy = min64(take, w->tap_need - w->tap_len);
                memcpy(w->tap + w->tap_len, data + pos, copy);
                w->tap_len += copy;
                if (w->tap_len == w->tap_need) on_tap(w);
            }
            w->skip -= take;
            pos += take;
            if (!w->skip && w->registering) {
                rewrite_register_peer(w, data + hold);
                w->registering = 0;
                hold = NO_HOLD;
            }
            continue;
        }
        if (w->phase == RW_HELLO && w->hello_request_bytes >= 0 && w->rewrite) {
            /* A conforming client waits for the HELLO reply; hold what it sends meanwhile (the
             * dialect decides how to read it), bounded. Read once the reply has come. */
            if (hold == NO_HOLD) hold = pos;
            if (len - hold > w->rules->max_held_before_reply) {
                char why[128];
                snprintf(why, sizeof why, "the RPC client sent over %llu bytes before the server's HELLO reply",
                         (unsigned long long)w->rules->max_held_before_reply);
                go_broken(w, why);
            }
            break;
        }
        /* A header is held until whole: a REGISTER_PEER is rewritten in place from its first byte. */
        if (w->header_len == 0 && hold == NO_HOLD) hold = pos;
        uint64_t take = min64(RW_HEADER_BYTES - w->header_len, len - pos);
        memcpy(w->header + w->header_len, data + pos, take);
        w->header_len += take;
        pos += take;
        if (w->header_len == RW_HEADER_BYTES) {
            w->header_len = 0;
            on_header(w);
            if (!w->registering) hold = NO_HOLD;
        }
    }
    uint64_t release = hold == NO_HOLD ? pos : hold;
    if (w->phase == RW_REJECTED) release = 0;
    w->up_parsed = pos - release;
    w->up_hold = hold == NO_HOLD ? NO_HOLD : hold - release;
    return release;
}

/* --- server -> client ----------------------------------------------------------------------- */

static const struct rw_dialect *match_dialect(const struct rpc_watch *w, const uint8_t *reply, size_t len) {
    for (int i = 0; i < w->rules->n_dialects; i++) {
        const struct rw_dialect *d = &w->rules->dialects[i];
        int flags = len > 3 ? reply[3] : 0;
        if (len >= 3 && reply[0] == d->major && reply[1] >= d->min_minor
            && (d->max_minor < 0 || reply[1] <= d->max_minor)
            && (uint64_t)w->hello_request_bytes == d->hello_request_bytes && len == d->hello_reply_bytes
            && (flags & d->required_flags) == d->required_flags)
            return d;
    }
    return NULL;
}

static void on_hello_reply(struct rpc_watch *w) {
    char text[160];
    const struct rw_dialect *d = w->hello_request_bytes >= 0
        ? match_dialect(w, w->hello_reply, w->hello_reply_len) : NULL;
    if (d == NULL) { /* checking, the request named dialects (on_header): the server's fault */
        snprintf(text, sizeof text, "%sthe HELLO exchange (%lld-byte request, %zu-byte reply) matches no known dialect",
                 w->check ? "unknown-dialect " : "", (long long)w->hello_request_bytes, w->hello_reply_len);
        (w->check ? go_violated : go_off)(w, text);
        return;
    }
    w->dialect = d;
    snprintf(text, sizeof text, "%s %d.%d.%d", d->name, w->hello_reply[0], w->hello_reply[1],
             w->hello_reply_len > 2 ? w->hello_reply[2] : 0);
    push_event(w, RW_EV_DIALECT, text);
    if (w->check && d->last_cmd == RW_NO_CMD) {
        snprintf(text, sizeof text, "RPC dialect %s is not checked", d->name);
        go_off(w, text);
        return;
    }
    w->phase = RW_FRAMES;
}

/* A whole reply has been read; `reply` points at its size field. Returns 0 when it was rejected. */
static int on_reply_done(struct rpc_watch *w, const uint8_t *reply) {
    struct rw_expected e = w->reply;
    memset(&w->reply, 0, sizeof w->reply);
    if (e.hello) {
        on_hello_reply(w);
        return w->phase != RW_REJECTED;
    }
    if (!e.checked) return 1;
    struct rw_measured m;
    rw_measure(&m, reply + RW_REPLY_SIZE_BYTES, e.size, e.ggml_type);
    memcpy(m.name, e.name, sizeof m.name);
    w->checked++;
    if (w->judge && w->judge(w->ctx, &m)) {
        w->phase = RW_REJECTED;
        w->rejected = m;
        char name[WORD_CHARS + 1]; /* the client's bytes, but one line all the same */
        printable_word(name, WORD_CHARS, (const uint8_t *)m.name, strlen(m.name));
        push_event(w, RW_EV_REJECTED, name);
        return 0;
    }
    return 1;
}

static void on_reply_header(struct rpc_watch *w) {
    uint64_t size = le64(w->reply_header);
    char why[128];
    if (!w->pending_count && w->check) {
        snprintf(why, sizeof why, "unsolicited-reply a reply of %llu bytes to no command", (unsigned long long)size);
        go_violated(w, why);
        return;
    }
    if (w->phase == RW_HELLO) {
        /* The first reply answers HELLO. */
        if (w->check) {
            w->pending_head = (w->pending_head + 1) % RW_MAX_PENDING;
            w->pending_count--;
        }
        if (size > RW_MAX_HELLO_REPLY_BYTES) {
            snprintf(why, sizeof why, "%sa first reply of %llu bytes is no HELLO reply",
                     w->check ? "bad-hello-reply " : "", (unsigned long long)size);
            (w->check ? go_violated : go_off)(w, why);
            return;
        }
        w->reply = (struct rw_expected){.hello = 1};
        w->reply_left = size;
        return;
    }
    /* Past the HELLO reply, only the check reads replies (rw_from_server). */
    struct rw_expected e = w->pending[w->pending_head];
    w->pending_head = (w->pending_head + 1) % RW_MAX_PENDING;
    w->pending_count--;
    if (e.checked && size != e.size) {
        snprintf(why, sizeof why, "wrong-reply-size a reply of %llu bytes to a GET_TENSOR of %llu",
                 (unsigned long long)size, (unsigned long long)e.size);
        go_violated(w, why);
        return;
    }
    w->reply = e;
    w->reply_left = size;
}

uint64_t rw_from_server(struct rpc_watch *w, uint8_t *data, uint64_t len) {
    uint64_t pos = w->down_parsed, hold = w->down_hold;
    while (pos < len) {
        if (w->phase == RW_OFF || w->phase == RW_BROKEN
            || (w->phase == RW_FRAMES && !w->check)) { /* the worker side reads only the HELLO reply */
            hold = NO_HOLD;
            pos = len;
            break;
        }
        if (w->phase == RW_REJECTED) break;
        if (w->reply_left) {
            uint64_t take = min64(w->reply_left, len - pos);
            if (w->reply.hello) {
                memcpy(w->hello_reply + w->hello_reply_len, data + pos, take); /* size <= 64, checked */
                w->hello_reply_len += take;
            }
            w->reply_left -= take;
            pos += take;
            if (!w->reply_left) {
                if (!on_reply_done(w, hold == NO_HOLD ? NULL : data + hold)) break;
                hold = NO_HOLD;
            }
            continue;
        }
        /* The check holds a size field until it is read (a reply it condemns goes nowhere), and a reply
         * to measure from there until it is judged. */
        if (w->reply_header_len == 0 && w->check) hold = pos;
        uint64_t take = min64(RW_REPLY_SIZE_BYTES - w->reply_header_len, len - pos);
        memcpy(w->reply_header + w->reply_header_len, data + pos, take);
        w->reply_header_len += take;
        pos += take;
        if (w->reply_header_len < RW_REPLY_SIZE_BYTES) continue;
        w->reply_header_len = 0;
        on_reply_header(w);
        if (!w->reply.checked) hold = NO_HOLD;
        if (!w->reply_left && (w->phase == RW_HELLO || w->phase == RW_FRAMES)) {
            if (!on_reply_done(w, hold == NO_HOLD ? NULL : data + hold)) break;
            hold = NO_HOLD;
        }
    }
    uint64_t release = hold == NO_HOLD ? pos : hold;
    if (w->phase == RW_REJECTED) release = 0;
    w->down_parsed = pos - release;
    w->down_hold = hold == NO_HOLD ? NO_HOLD : hold - release;
    return release;
}

int rw_replies_owed(const struct rpc_watch *w) {
    return !w->check || w->phase != RW_FRAMES || w->pending_count > 0 || w->tap_cmd == RW_GET_TENSOR_CMD;
}
