/* The sidecar's command lines (commands.h). */
#define _GNU_SOURCE
#include "commands.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accept.h"
#include "control.h"
#include "dial.h"
#include "members.h"
#include "tls.h"

/* --- parsing (pure) ---------------------------------------------------------------------------- */

/* A decimal number of at most `max`: digits only, no sign, no spaces, no overflow. */
static int number(const char *s, uint64_t max, uint64_t *out) {
    uint64_t v = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        uint64_t digit = (uint64_t)(*s - '0');
        if (*s < '0' || *s > '9' || digit > max || v > (max - digit) / 10) return -1;
        v = v * 10 + digit;
    }
    *out = v;
    return 0;
}

static int small(const char *s, int min, int max, int *out) {
    uint64_t v;
    if (number(s, (uint64_t)max, &v) || v < (uint64_t)min) return -1;
    *out = (int)v;
    return 0;
}

/* A command number, or "-" for none. */
static int command_or_none(const char *s, int *out) {
    if (!strcmp(s, "-")) {
        *out = RW_NO_CMD;
        return 0;
    }
    return small(s, 0, RW_CMD_LIMIT - 1, out);
}

/* A positive finite number, as Python's repr() writes floats. */
static int positive(const char *s, double *out) {
    char *end;
    if (!*s || strspn(s, "0123456789.e+-") != strlen(s)) return -1;
    double v = strtod(s, &end);
    if (*end || !isfinite(v) || v <= 0) return -1;
    *out = v;
    return 0;
}

/* "-", or commands separated by commas. */
static int command_set(const char *list, uint8_t flags[RW_CMD_LIMIT]) {
    memset(flags, 0, RW_CMD_LIMIT);
    if (!strcmp(list, "-")) return 0;
    char word[8];
    for (const char *p = list;;) {
        size_t n = strcspn(p, ",");
        int cmd;
        if (!n || n >= sizeof word) return -1;
        memcpy(word, p, n);
        word[n] = '\0';
        if (small(word, 0, RW_CMD_LIMIT - 1, &cmd)) return -1;
        flags[cmd] = 1;
        if (!p[n]) return 0;
        p += n + 1;
    }
}

static int even_hex(const char *s) {
    size_t n = strlen(s);
    return n && n % 2 == 0 && strspn(s, "0123456789abcdefABCDEF") == n;
}

static int printable(const char *s) {
    for (; *s; s++)
        if (*s < 0x21 || *s > 0x7e) return 0;
    return 1;
}

/* A numeric address and a port, where a tunnel or a probe dials. */
static int peer_relay(const char *host, const char *port, struct command *c) {
    struct in6_addr ignored;
    if (parse_address(host, &ignored) || small(port, 1, 65535, &c->port)) return -1;
    c->host = host;
    c->port_text = port;
    return 0;
}

static int parse_dialect(char **argv, struct rw_dialect *d) {
    uint64_t request, reply;
    if (strlen(argv[1]) >= sizeof d->name || !printable(argv[1])) return -1;
    snprintf(d->name, sizeof d->name, "%s", argv[1]);
    if (small(argv[2], 0, 255, &d->major) || small(argv[3], 0, 255, &d->min_minor)) return -1;
    d->max_minor = -1; /* "-": every later minor */
    if (strcmp(argv[4], "-") && small(argv[4], d->min_minor, 255, &d->max_minor)) return -1;
    if (number(argv[5], 1 << 20, &request) || number(argv[6], RW_MAX_HELLO_REPLY_BYTES, &reply)) return -1;
    d->hello_request_bytes = request;
    d->hello_reply_bytes = reply;
    return small(argv[7], 0, 255, &d->required_flags) || command_or_none(argv[8], &d->register_peer_cmd)
           || command_or_none(argv[9], &d->push_tensor_cmd) || command_or_none(argv[10], &d->last_cmd)
           || command_set(argv[11], d->no_reply) || command_set(argv[12], d->async_push) ? -1 : 0;
}

int parse_command(char *line, struct command *out, const char **error) {
    char *argv[MAX_COMMAND_WORDS], *save = NULL;
    int argc = 0;
    memset(out, 0, sizeof *out);
    for (char *tok = strtok_r(line, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        if (argc == MAX_COMMAND_WORDS) { *error = "too many words"; return -1; }
        argv[argc++] = tok;
    }
    *error = "malformed";
    if (!argc) { *error = "empty"; return -1; }
    const char *verb = argv[0];
    uint64_t v;
    if (!strcmp(verb, "identity") && argc == 3) {
        out->verb = C_IDENTITY;
        out->cert_hex = argv[1];
        out->key_hex = argv[2];
        return even_hex(argv[1]) && even_hex(argv[2]) ? 0 : -1;
    }
    if (!strcmp(verb, "limits") && argc == 8) {
        out->verb = C_LIMITS;
        if (number(argv[1], UINT64_MAX, &out->max_frame) || number(argv[2], UINT64_MAX, &out->max_held)
            || number(argv[3], UINT64_MAX, &out->max_checked) || number(argv[4], 3600000, &out->handshake_ms)
            || out->handshake_ms == 0 || small(argv[5], 1, 65536, &out->pipes)
            || small(argv[6], 1, out->pipes, &out->shakes) || small(argv[7], 1, out->shakes, &out->shakes_per_address))
            return -1;
        return 0;
    }
    if (!strcmp(verb, "guard") && argc == 6) {
        out->verb = C_GUARD;
        return small(argv[1], 1, 65536, &out->history) || small(argv[2], 0, out->history, &out->min_history)
               || positive(argv[3], &out->norm_ratio) || positive(argv[4], &out->max_rms)
               || positive(argv[5], &out->max_abs) ? -1 : 0;
    }
    if (!strcmp(verb, "dialect") && argc == 13) {
        out->verb = C_DIALECT;
        return parse_dialect(argv, &out->dialect);
    }
    if (!strcmp(verb, "rpc-port") && argc == 2) {
        out->verb = C_RPC_PORT;
        return small(argv[1], 1, 65535, &out->port);
    }
    if (!strcmp(verb, "new-session") && argc == 1) {
        out->verb = C_NEW_SESSION;
        return 0;
    }
    int node_at = !strcmp(verb, "tunnel") ? 2 : 1;
    if (argc <= node_at || from_hex(out->node, NODE_ID_BYTES, argv[node_at])) return -1;
    out->node_hex = argv[node_at];
    if (!strcmp(verb, "member") && argc <= 2 + MAX_MEMBER_ADDRESSES) {
        out->verb = C_MEMBER;
        for (int i = 2; i < argc; i++)
            if (parse_address(argv[i], &out->addresses[out->n_addresses++])) return -1;
        return 0;
    }
    if (!strcmp(verb, "endpoint") && argc == 4) { /* the member whose REGISTER_PEERs it resolves */
        out->verb = C_ENDPOINT;
        if (number(argv[2], MAX_ENDPOINTS - 1, &v)) return -1;
        out->index = (uint32_t)v;
        out->endpoint = strcmp(argv[3], "-") ? argv[3] : NULL;
        return !out->endpoint || (strlen(argv[3]) < RW_REGISTER_ENDPOINT_BYTES && printable(argv[3])) ? 0 : -1;
    }
    if (!strcmp(verb, "forget") && argc == 2) {
        out->verb = C_FORGET;
        return 0;
    }
    if (!strcmp(verb, "probe") && argc == 4) {
        out->verb = C_PROBE;
        return peer_relay(argv[2], argv[3], out);
    }
    if (!strcmp(verb, "tunnel") && argc == 6) {
        out->verb = C_TUNNEL;
        if (number(argv[1], INBOUND_ID_BASE - 1, &v) || small(argv[5], 0, 1, &out->check)) return -1;
        out->id = (uint32_t)v;
        return peer_relay(argv[3], argv[4], out);
    }
    *error = "unknown";
    return -1;
}

/* --- acting on it -------------------------------------------------------------------------------- */

static void close_member_pipes(struct member *m, const char *why) {
    for (struct pipe *p = pipes, *next; p; p = next) {
        next = p->next;
        if (p->member == m) free_pipe(p, 1, why);
    }
}

static void use_identity(const char *cert_hex, const char *key_hex) {
    size_t cl = strlen(cert_hex) / 2, kl = strlen(key_hex) / 2;
    uint8_t *c = malloc(cl), *k = malloc(kl);
    if (c && k && !from_hex(c, cl, cert_hex) && !from_hex(k, kl, key_hex)) {
        SSL_CTX *made = make_tls(c, cl, k, kl);
        if (made) {
            if (tls) SSL_CTX_free(tls);
            tls = made;
        }
    }
    if (k) explicit_bzero(k, kl);
    free(c);
    free(k);
    if (!tls) report("error identity not usable");
}

static void add_member(const struct command *c) {
    struct member *m = find_member(c->node);
    for (int i = 0; !m && i < MAX_MEMBERS; i++)
        if (!members[i].used) {
            m = &members[i];
            m->used = 1;
            memcpy(m->id, c->node, NODE_ID_BYTES);
            snprintf(m->hex, sizeof m->hex, "%s", c->node_hex);
        }
    if (!m) {
        report("error no room for member %s", c->node_hex);
        return;
    }
    if (!c->n_addresses) return; /* the key alone: its addresses stay as they were */
    memcpy(m->addresses, c->addresses, sizeof m->addresses);
    m->n_addresses = c->n_addresses;
}

static void dial(const struct command *c, int fd) {
    char id[16];
    snprintf(id, sizeof id, "%u", c->id);
    struct member *m = find_member(c->node);
    const char *why = !m ? "not-a-member" : !tls ? "not-ready" : n_pipes >= max_pipes ? "too-many-connections"
                      : c->verb == C_TUNNEL && tune_socket(fd) < 0 ? "socket-unusable" : NULL;
    if (why) {
        if (c->verb == C_TUNNEL) report("closed %s %s", id, why);
        else report("probe %s fail %s", c->node_hex, why);
        if (fd >= 0) close(fd);
        return;
    }
    struct pipe *p = new_pipe(c->verb == C_TUNNEL ? c->id : 0, 1, c->check, 0);
    p->is_probe = c->verb == C_PROBE;
    p->member = m;
    p->client.fd = fd;
    start_dial(p, c->host, c->port_text, c->verb == C_TUNNEL ? KIND_RPC : KIND_PROBE);
    if (p->server.fd < 0) dial_failed(p, "connect-failed");
}

void apply_command(const struct command *c) {
    struct member *m;
    switch (c->verb) {
    case C_IDENTITY: use_identity(c->cert_hex, c->key_hex); break;
    case C_LIMITS:
        rules.max_frame_bytes = c->max_frame;
        rules.max_held_before_reply = c->max_held;
        rules.max_checked_bytes = c->max_checked;
        handshake_timeout_ns = c->handshake_ms * 1000000ull;
        max_pipes = c->pipes;
        max_handshakes = c->shakes;
        max_shakes_per_source = c->shakes_per_address;
        break;
    case C_GUARD:
        guard_history = c->history;
        guard_min_history = c->min_history;
        guard_norm_ratio = c->norm_ratio;
        guard_max_rms = c->max_rms;
        guard_max_abs = c->max_abs;
        break;
    case C_DIALECT:
        if (rules.n_dialects < RW_MAX_DIALECTS) rules.dialects[rules.n_dialects++] = c->dialect;
        else report("error more than %d dialects", RW_MAX_DIALECTS);
        break;
    case C_RPC_PORT: rpc_port = c->port; break;
    case C_ENDPOINT:
        /* A member's table only: the sidecar names the member before its endpoints, and again after a forget. */
        if (!(m = find_member(c->node))) report("error endpoint for no member %s", c->node_hex);
        else if (set_member_endpoint(m, c->index, c->endpoint) < 0) report("error endpoint %u: out of memory", c->index);
        break;
    case C_MEMBER: add_member(c); break;
    case C_FORGET:
        if (!(m = find_member(c->node))) break;
        close_member_pipes(m, "forgotten");
        forget_judged(&m->judged);
        forget_endpoints(m);
        memset(m, 0, sizeof *m);
        break;
    case C_NEW_SESSION:
        for (int i = 0; i < MAX_MEMBERS; i++) forget_judged(&members[i].judged);
        break;
    case C_TUNNEL: case C_PROBE: break; /* control_line: they take a socket, or dial */
    }
}

void control_line(char *line) {
    size_t len = strlen(line);
    int tunnel = !strncmp(line, "tunnel ", 7);
    char verb[16];
    snprintf(verb, sizeof verb, "%.*s", (int)strcspn(line, " "), line);
    struct command c;
    const char *error;
    int fd = tunnel ? take_queued_fd() : -1;
    if (parse_command(line, &c, &error) < 0) {
        report("error %s control line %s", error, verb);
        if (fd >= 0) close(fd);
    } else if (c.verb == C_TUNNEL && fd < 0) {
        report("error tunnel %u without its socket", c.id);
    } else if (c.verb == C_TUNNEL || c.verb == C_PROBE) {
        dial(&c, fd);
    } else {
        apply_command(&c);
    }
    explicit_bzero(line, len); /* the only copy of an identity's key left in this process is OpenSSL's */
}
