/* mesh-data-relay: the native data path between members (README.md in this folder).
 *
 * One process per node, supervised by the sidecar (net/data_path.py). One epoll loop, no threads.
 * It relays each RPC tunnel connection over TLS 1.3 on TCP to the peer's relay, which connects it
 * to its own rpc-server; both ends are authenticated by their node keys (the certificate the node
 * already presents over QUIC) and only members the sidecar named are accepted. What passes is read
 * by rpc_watch.c: the serving side checks float layer outputs, the worker side rewrites b2b's
 * REGISTER_PEER, both count. No per-message work leaves this process.
 *
 *   serving node                                               worker
 *   llama-server -TCP-> sidecar's tunnel port                  relay's data port (network)
 *                        | accepted, uid checked, fd passed     | TLS 1.3, member keys only
 *                        v                                      v
 *                       relay ===== TLS over TCP ==========>  relay -TCP-> 127.0.0.1 rpc-server
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "rpc_watch.h"

#define RELAY_VERSION "1"
#define PREAMBLE_MAGIC "MESH"
#define PREAMBLE_VERSION 1
#define PREAMBLE_BYTES 6          /* "MESH" | version u8 | kind u8 */
#define KIND_RPC 1
#define KIND_PROBE 2
#define PROBE_ANSWER 0x01
#define NODE_ID_BYTES 32
#define BUF_BYTES (256 * 1024)    /* per direction; grown only to hold a checked reply whole */
#define CONTROL_LINE_BYTES 8192
#define CONTROL_OUT_MAX_BYTES (4 << 20) /* a sidecar that stops reading loses stats, not data */
#define MAX_MEMBERS 256
#define MAX_ENDPOINTS 256
#define MAX_QUEUED_FDS 64
#define TICK_NS 100000000ull      /* stats and reply waits, every 100 ms */
#define INBOUND_ID_BASE 0x80000000u

/* --- time, logging ------------------------------------------------------------------------- */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* --- the control channel: lines to the sidecar ----------------------------------------------- */

static int control_fd = -1;
static char *control_out;
static size_t control_out_len, control_out_cap;

static void flush_control(void) {
    while (control_out_len) {
        ssize_t n = write(control_fd, control_out, control_out_len); /* nonblocking; SIGPIPE ignored */
        if (n <= 0) return; /* EAGAIN: epoll says when; an error: the read side sees EOF and exits */
        memmove(control_out, control_out + n, control_out_len - (size_t)n);
        control_out_len -= (size_t)n;
    }
}

static void report(const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    /* One call, one line: bytes a peer chose (an endpoint, a tensor name) can neither end it nor start
     * another, whoever formatted them. */
    for (int i = 0; i < n; i++)
        if ((unsigned char)line[i] < 0x20 || (unsigned char)line[i] > 0x7e) line[i] = '?';
    line[n++] = '\n';
    if (control_out_len + (size_t)n > CONTROL_OUT_MAX_BYTES) return;
    if (control_out_len + (size_t)n > control_out_cap) {
        control_out_cap = (control_out_len + (size_t)n) * 2;
        control_out = realloc(control_out, control_out_cap);
        if (!control_out) abort();
    }
    memcpy(control_out + control_out_len, line, (size_t)n);
    control_out_len += (size_t)n;
    flush_control();
}

/* --- what the sidecar told us ---------------------------------------------------------------- */

struct history {                   /* recent healthy RMS of one tensor name (serve/output_guard.py) */
    char name[RW_TENSOR_NAME_BYTES + 1];
    double *rms;
    int count, next;
};

/* One connection's histories: a llama-server session's own, so a new one (its warm-up's outputs are
 * far from a running session's) starts unjudged, as the sidecar's guard does at each start. */
struct judged {
    struct history *items;
    size_t n;
};

struct member {
    int used;
    uint8_t id[NODE_ID_BYTES];
    char hex[2 * NODE_ID_BYTES + 1];
};

static struct member members[MAX_MEMBERS];
static char *endpoints[MAX_ENDPOINTS];          /* REGISTER_PEER peer index -> "127.0.0.1:port" */
static struct rw_rules rules;
static int guard_history = 64, guard_min_history = 8;
static double guard_norm_ratio = 64.0;
static uint64_t handshake_timeout_ns = 5000000000ull;
static int max_pipes = 256, max_handshakes = 16;
static int rpc_port;
static SSL_CTX *tls;
static uint8_t own_id[NODE_ID_BYTES];

static int from_hex(uint8_t *out, size_t n, const char *hex) {
    if (strlen(hex) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        out[i] = (uint8_t)v;
    }
    return 0;
}

static struct member *find_member(const uint8_t *id) {
    for (int i = 0; i < MAX_MEMBERS; i++)
        if (members[i].used && !memcmp(members[i].id, id, NODE_ID_BYTES)) return &members[i];
    return NULL;
}

/* --- the output judge: serve/output_guard.py's rule, with the sidecar's figures ------------- */

struct verdict { const char *kind; double low, high; int count; };

static void forget_judged(struct judged *j) {
    for (size_t i = 0; i < j->n; i++) free(j->items[i].rms);
    free(j->items);
    memset(j, 0, sizeof *j);
}

static int judge_tensor(struct judged *j, const struct rw_measured *t, struct verdict *v) {
    if (!t->finite) {
        *v = (struct verdict){"non_finite", 0, 0, 0};
        return 1;
    }
    struct history *h = NULL;
    for (size_t i = 0; i < j->n; i++)
        if (!strcmp(j->items[i].name, t->name)) h = &j->items[i];
    if (!h) {
        struct history *grown = realloc(j->items, (j->n + 1) * sizeof *grown);
        if (!grown) abort();
        j->items = grown;
        h = &j->items[j->n++];
        memset(h, 0, sizeof *h);
        snprintf(h->name, sizeof h->name, "%s", t->name);
        h->rms = calloc((size_t)guard_history, sizeof *h->rms);
        if (!h->rms) abort();
    }
    if (h->count >= guard_min_history) {
        double low = h->rms[0], high = h->rms[0];
        for (int i = 1; i < h->count; i++) {
            if (h->rms[i] < low) low = h->rms[i];
            if (h->rms[i] > high) high = h->rms[i];
        }
        if (t->rms > high * guard_norm_ratio || t->rms < low / guard_norm_ratio) {
            *v = (struct verdict){"norm_outlier", low, high, h->count};
            return 1;
        }
    }
    h->rms[h->next] = t->rms;
    h->next = (h->next + 1) % guard_history;
    if (h->count < guard_history) h->count++;
    return 0;
}

/* --- pipes: one relayed connection ----------------------------------------------------------- */

enum handle_kind { H_CONTROL, H_LISTEN, H_SIDE };
enum pipe_state { P_CONNECTING, P_HANDSHAKE, P_PREAMBLE, P_RPC_CONNECTING, P_RELAY, P_PROBE };

struct buf { uint8_t *data; size_t cap, start, ok, end; }; /* [start,ok) may go, [ok,end) is the watch's */

struct pipe;
struct side {
    enum handle_kind kind;         /* first: epoll's data.ptr points at it */
    struct pipe *pipe;
    int fd;
    SSL *ssl;                      /* NULL: a plain local socket */
    int eof, shut;                 /* read EOF seen; our write half closed */
    size_t retry_len;              /* an SSL_write to repeat with this length */
    uint32_t events;               /* what epoll watches now */
    int registered;                /* added to epoll (events may be 0) */
    int readable;                  /* epoll said so and no read has come back empty since: saves a
                                      syscall per hop that would only say EAGAIN */
};

struct pipe {
    uint32_t id;
    int outbound;                  /* 1: llama-server -> peer (client side plain); 0: peer -> rpc-server */
    struct member *member;
    enum pipe_state state;
    struct side client, server;    /* who sends commands, who answers them */
    struct buf up, down;           /* client -> server, server -> client */
    struct rpc_watch watch;
    struct judged judged;          /* the outputs this connection's replies carried (judge_tensor) */
    uint64_t deadline_ns, started_ns;
    uint8_t preamble[PREAMBLE_BYTES];
    size_t preamble_len;
    uint64_t from_client, from_server, reported_client, reported_server;
    uint64_t reported_frames, reported_activation, reported_alloc;
    uint64_t owing_since_ns, owed_ns;
    int is_probe;                  /* reports "probe", never "closed" */
    int handed_back;               /* reported as "fallback", never "closed" */
    int announced;                 /* inbound: reported "inbound", so its end is reported too */
    int holds_shake;               /* inbound: counted in n_handshakes until authenticated or freed */
    struct pipe *next;
};

static struct pipe *pipes;
static int n_pipes, n_handshakes;
static int epoll_fd;
static uint32_t next_inbound_id = INBOUND_ID_BASE;

static const char *resolve_endpoint(void *ctx, uint32_t index) {
    (void)ctx;
    return index < MAX_ENDPOINTS ? endpoints[index] : NULL;
}

static int judge_for_pipe(void *ctx, const struct rw_measured *t);

static void set_events(struct side *s, uint32_t events) {
    if (s->fd < 0 || (s->registered && s->events == events)) return;
    struct epoll_event ev = {.events = events, .data.ptr = s};
    epoll_ctl(epoll_fd, s->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s->fd, &ev);
    s->events = events;
    s->registered = 1;
}

static void close_side(struct side *s, int reset) {
    if (s->fd < 0) return;
    if (reset) { /* an RST, so llama-server or rpc-server sees an error, not a clean end */
        struct linger lg = {1, 0};
        setsockopt(s->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    if (s->ssl) SSL_free(s->ssl);
    s->ssl = NULL;
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, s->fd, NULL);
    close(s->fd);
    s->fd = -1;
}

static void report_stats(struct pipe *p) {
    uint64_t now = now_ns();
    if (p->owing_since_ns) {
        p->owed_ns += now - p->owing_since_ns;
        p->owing_since_ns = now;
    }
    if (p->from_client == p->reported_client && p->from_server == p->reported_server && !p->owed_ns
        && p->watch.frames == p->reported_frames && p->watch.activation_bytes == p->reported_activation
        && p->watch.allocated_bytes == p->reported_alloc)
        return;
    report("stats %u %llu %llu %llu %llu %llu %llu", p->id,
           (unsigned long long)(p->from_client - p->reported_client),
           (unsigned long long)(p->from_server - p->reported_server),
           (unsigned long long)(p->watch.frames - p->reported_frames),
           (unsigned long long)(p->watch.activation_bytes - p->reported_activation),
           (unsigned long long)(p->watch.allocated_bytes - p->reported_alloc),
           (unsigned long long)(p->owed_ns / 1000));
    p->reported_client = p->from_client;
    p->reported_server = p->from_server;
    p->reported_frames = p->watch.frames;
    p->reported_activation = p->watch.activation_bytes;
    p->reported_alloc = p->watch.allocated_bytes;
    p->owed_ns = 0;
}

/* An inbound connection gives its handshake slot back exactly once: when its preamble is read, or when
 * it is freed before that, whichever comes first. */
static void release_shake(struct pipe *p) {
    if (!p->holds_shake) return;
    p->holds_shake = 0;
    n_handshakes--;
}

static void free_pipe(struct pipe *p, int reset, const char *why) {
    if (p->state == P_RELAY) report_stats(p);
    release_shake(p);
    /* A probe reports its own end; an inbound connection refused before relaying was reported so. */
    if (!p->is_probe && !p->handed_back && (p->outbound || p->announced)) report("closed %u %s", p->id, why);
    close_side(&p->client, reset);
    close_side(&p->server, reset);
    free(p->up.data);
    free(p->down.data);
    forget_judged(&p->judged);
    for (struct pipe **q = &pipes; *q; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            break;
        }
    n_pipes--;
    free(p);
}

static struct pipe *new_pipe(uint32_t id, int outbound) {
    if (n_pipes >= max_pipes) return NULL;
    struct pipe *p = calloc(1, sizeof *p);
    if (!p) abort();
    p->id = id;
    p->outbound = outbound;
    p->client = (struct side){.kind = H_SIDE, .pipe = p, .fd = -1, .readable = 1};
    p->server = (struct side){.kind = H_SIDE, .pipe = p, .fd = -1, .readable = 1};
    p->up.data = malloc(BUF_BYTES);
    p->down.data = malloc(BUF_BYTES);
    if (!p->up.data || !p->down.data) abort();
    p->up.cap = p->down.cap = BUF_BYTES;
    p->started_ns = now_ns();
    p->deadline_ns = p->started_ns + handshake_timeout_ns;
    p->next = pipes;
    pipes = p;
    n_pipes++;
    return p;
}

static void tune_socket(int fd) {
    int one = 1;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    /* RPC is strict request/response: Nagle would add a delay per command. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Room at the end of a buffer: compacted first, grown only while the watch holds a whole reply. */
static size_t room(struct buf *b, size_t limit) {
    if (b->end == b->cap && b->start) {
        memmove(b->data, b->data + b->start, b->end - b->start);
        b->ok -= b->start;
        b->end -= b->start;
        b->start = 0;
    }
    if (b->end == b->cap && b->ok == b->start && b->cap < limit) {
        size_t cap = b->cap * 2 > limit ? limit : b->cap * 2;
        uint8_t *grown = realloc(b->data, cap);
        if (!grown) abort();
        b->data = grown;
        b->cap = cap;
    }
    return b->cap - b->end;
}

/* >0 bytes, 0 nothing now, -1 EOF, -2 error. */
static ssize_t side_read(struct side *s, uint8_t *to, size_t n) {
    if (!s->ssl) {
        ssize_t got = recv(s->fd, to, n, 0);
        if (got > 0) return got;
        if (got == 0) return -1;
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -2;
    }
    int got = SSL_read(s->ssl, to, (int)(n > INT32_MAX ? INT32_MAX : n));
    if (got > 0) return got;
    switch (SSL_get_error(s->ssl, got)) {
    case SSL_ERROR_WANT_READ: case SSL_ERROR_WANT_WRITE: return 0;
    case SSL_ERROR_ZERO_RETURN: return -1;
    default: ERR_clear_error(); return -2;
    }
}

static ssize_t side_write(struct side *s, const uint8_t *from, size_t n) {
    if (!s->ssl) {
        ssize_t put = send(s->fd, from, n, MSG_NOSIGNAL);
        if (put >= 0) return put;
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -2;
    }
    if (s->retry_len) n = s->retry_len; /* OpenSSL wants a retried write no shorter than before */
    int put = SSL_write(s->ssl, from, (int)(n > INT32_MAX ? INT32_MAX : n));
    if (put > 0) {
        s->retry_len = 0;
        return put;
    }
    switch (SSL_get_error(s->ssl, put)) {
    case SSL_ERROR_WANT_READ: case SSL_ERROR_WANT_WRITE: s->retry_len = n; return 0;
    default: ERR_clear_error(); return -2;
    }
}

static void shut_write(struct side *s) {
    if (s->shut) return;
    s->shut = 1;
    if (s->ssl) SSL_shutdown(s->ssl); /* close_notify; TLS 1.3 reads on after it */
    else shutdown(s->fd, SHUT_WR);
}

static void watch_events(struct pipe *p) {
    const char *text;
    enum rw_event_kind kind;
    while ((kind = rw_next_event(&p->watch, &text)) != RW_EV_NONE) {
        switch (kind) {
        case RW_EV_DIALECT: report("event %u dialect %s", p->id, text); break;
        case RW_EV_OFF: report("event %u check-off %s", p->id, text); break;
        case RW_EV_REWRITTEN: report("event %u rewritten %s", p->id, text); break;
        case RW_EV_UNRESOLVED: report("event %u unresolved %s", p->id, text); break;
        case RW_EV_BROKEN: report("event %u broken %s", p->id, text); break;
        default: break; /* RW_EV_REJECTED is reported by the judge, with its figures */
        }
    }
}

/* Move what can move, both ways, until nothing does. Returns 0 when the pipe was freed. */
static int pump(struct pipe *p) {
    uint64_t limit = rules.max_checked_bytes + BUF_BYTES;
    for (int progress = 1; progress;) {
        progress = 0;
        struct { struct side *from, *to; struct buf *b; uint64_t *count; int up; } dirs[2] = {
            {&p->client, &p->server, &p->up, &p->from_client, 1},
            {&p->server, &p->client, &p->down, &p->from_server, 0},
        };
        for (int i = 0; i < 2; i++) {
            struct side *from = dirs[i].from, *to = dirs[i].to;
            struct buf *b = dirs[i].b;
            if (!from->eof && (from->readable || (from->ssl && SSL_has_pending(from->ssl)))) {
                size_t space = room(b, dirs[i].up ? BUF_BYTES : limit);
                if (space) {
                    ssize_t got = side_read(from, b->data + b->end, space);
                    if (got == -2) goto reset;
                    if (got == -1) from->eof = 1;
                    /* Drained until epoll (level-triggered) says otherwise: nothing came, a plain socket
                     * gave less than asked, or TLS holds nothing more it has read ahead. */
                    if (got == 0 || (!from->ssl && (size_t)got < space) || (from->ssl && !SSL_has_pending(from->ssl)))
                        from->readable = 0;
                    if (got > 0) {
                        b->end += (size_t)got;
                        *dirs[i].count += (uint64_t)got;
                        progress = 1;
                        if (!dirs[i].up && p->owing_since_ns) { /* the peer answered: its wait ends */
                            p->owed_ns += now_ns() - p->owing_since_ns;
                            p->owing_since_ns = 0;
                        }
                    }
                }
            }
            uint64_t release = dirs[i].up ? rw_from_client(&p->watch, b->data + b->ok, b->end - b->ok)
                                          : rw_from_server(&p->watch, b->data + b->ok, b->end - b->ok);
            b->ok += release;
            watch_events(p);
            if (p->watch.phase == RW_REJECTED || p->watch.phase == RW_BROKEN) goto reset;
            if (b->ok > b->start && !to->shut) {
                ssize_t put = side_write(to, b->data + b->start, b->ok - b->start);
                if (put == -2) goto reset;
                if (put > 0) {
                    b->start += (size_t)put;
                    progress = 1;
                    if (dirs[i].up && p->outbound && !p->owing_since_ns && rw_replies_owed(&p->watch))
                        p->owing_since_ns = now_ns();
                }
            }
            if (b->start == b->end) b->start = b->ok = b->end = 0;
            if (from->eof && b->start == b->ok) shut_write(to); /* bytes still held can never complete */
        }
    }
    if (p->client.eof && p->server.eof && p->up.start == p->up.ok && p->down.start == p->down.ok) {
        free_pipe(p, 0, "ended");
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        struct side *s = i ? &p->server : &p->client;
        struct buf *in = i ? &p->down : &p->up, *out = i ? &p->up : &p->down;
        uint32_t ev = 0;
        /* Watched whenever a read could take bytes, room() making it (compacting, or growing a held
         * reply): a read that filled the buffer leaves `readable` cleared when TLS had nothing more read
         * ahead, and the rest of a held reply may wait in the socket; only epoll can say so then. */
        if (!s->eof && room(in, i ? limit : BUF_BYTES)) ev |= EPOLLIN;
        if (out->ok > out->start || s->retry_len) ev |= EPOLLOUT;
        set_events(s, ev);
    }
    return 1;
reset:
    free_pipe(p, 1, p->watch.phase == RW_BROKEN ? "broken-frame" : p->watch.phase == RW_REJECTED ? "rejected" : "reset");
    return 0;
}

static int judge_for_pipe(void *ctx, const struct rw_measured *t) {
    struct pipe *p = ctx;
    struct verdict v;
    if (!p->member || !judge_tensor(&p->judged, t, &v)) return 0;
    report("rejected %u %s %s %llu %.6g %.6g %.6g %d", p->id, v.kind, t->name[0] ? t->name : "-",
           (unsigned long long)t->values, t->finite ? t->rms : 0.0, v.low, v.high, v.count);
    return 1;
}

/* --- TLS ----------------------------------------------------------------------------------- */

static int accept_any_certificate(int ok, X509_STORE_CTX *ctx) {
    (void)ok;
    (void)ctx;
    return 1; /* self-signed node certificates: the key is checked against the members after the handshake */
}

static int peer_node_id(SSL *ssl, uint8_t out[NODE_ID_BYTES]) {
    X509 *cert = SSL_get1_peer_certificate(ssl);
    if (!cert) return -1;
    EVP_PKEY *key = X509_get0_pubkey(cert);
    size_t len = NODE_ID_BYTES;
    int ok = key && EVP_PKEY_id(key) == EVP_PKEY_ED25519 && EVP_PKEY_get_raw_public_key(key, out, &len) == 1
             && len == NODE_ID_BYTES;
    X509_free(cert);
    return ok ? 0 : -1;
}

static SSL_CTX *make_tls(const uint8_t *cert_der, size_t cert_len, const uint8_t *key_der, size_t key_len) {
    SSL_CTX *ctx = SSL_CTX_new(TLS_method());
    if (!ctx) return NULL;
    SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, accept_any_certificate);
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    SSL_CTX_set_num_tickets(ctx, 0);
    SSL_CTX_set_read_ahead(ctx, 1); /* one read() per record, not two (header, then body) */
    SSL_CTX_set_default_read_buffer_len(ctx, BUF_BYTES); /* ...and many records per read() in bulk */
    const uint8_t *c = cert_der, *k = key_der;
    X509 *cert = d2i_X509(NULL, &c, (long)cert_len);
    EVP_PKEY *key = d2i_AutoPrivateKey(NULL, &k, (long)key_len);
    int ok = cert && key && SSL_CTX_use_certificate(ctx, cert) == 1 && SSL_CTX_use_PrivateKey(ctx, key) == 1
             && SSL_CTX_check_private_key(ctx) == 1;
    size_t len = NODE_ID_BYTES;
    ok = ok && EVP_PKEY_get_raw_public_key(key, own_id, &len) == 1;
    X509_free(cert);
    EVP_PKEY_free(key);
    if (!ok) {
        SSL_CTX_free(ctx);
        return NULL;
    }
    return ctx;
}

/* The handshake went on; 1 done, 0 not yet, -1 failed. */
static int step_handshake(struct side *s) {
    int r = SSL_do_handshake(s->ssl);
    if (r == 1) return 1;
    int err = SSL_get_error(s->ssl, r);
    if (err == SSL_ERROR_WANT_READ) set_events(s, EPOLLIN);
    else if (err == SSL_ERROR_WANT_WRITE) set_events(s, EPOLLOUT);
    else {
        ERR_clear_error();
        return -1;
    }
    return 0;
}

/* --- outbound: llama-server's connection, or a probe, to a member's relay -------------------- */

static void start_dial(struct pipe *p, const char *host, const char *port, int kind) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV}, *ai;
    memcpy(p->up.data, PREAMBLE_MAGIC, 4);
    p->up.data[4] = PREAMBLE_VERSION;
    p->up.data[5] = (uint8_t)kind;
    p->up.ok = p->up.end = PREAMBLE_BYTES;
    p->state = P_CONNECTING;
    if (getaddrinfo(host, port, &hints, &ai) != 0) return; /* the deadline ends it */
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        tune_socket(fd);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    p->server.fd = fd;
    if (fd >= 0) set_events(&p->server, EPOLLOUT);
}

/* A tunnel whose peer's relay did not take it goes back to the sidecar, unread (the client side is
 * read only once relaying), so it can carry it over QUIC: "fallback ID WHY" with the socket beside it.
 * Returns 0 when it could not be sent whole now (the caller then closes the connection). */
static int hand_back(struct pipe *p, const char *why) {
    char line[256];
    int n = snprintf(line, sizeof line, "fallback %u %s\n", p->id, why);
    flush_control();
    if (n <= 0 || n >= (int)sizeof line || control_out_len || p->client.fd < 0) return 0;
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {line, (size_t)n};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &p->client.fd, sizeof(int));
    return sendmsg(control_fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) == n;
}

static void dial_failed(struct pipe *p, const char *why) {
    if (p->is_probe) report("probe %s fail %s", p->member->hex, why);
    else p->handed_back = hand_back(p, why);
    free_pipe(p, !p->handed_back, why); /* no RST on a socket the sidecar now holds */
}

static void outbound_ready(struct pipe *p, uint32_t events) {
    struct side *s = &p->server;
    if (p->state == P_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            dial_failed(p, strerror(err));
            return;
        }
        s->ssl = SSL_new(tls);
        SSL_set_fd(s->ssl, s->fd);
        SSL_set_connect_state(s->ssl);
        p->state = P_HANDSHAKE;
    }
    if (p->state == P_HANDSHAKE) {
        int done = step_handshake(s);
        if (done < 0) {
            dial_failed(p, "tls-handshake-failed");
            return;
        }
        if (!done) return;
        uint8_t id[NODE_ID_BYTES];
        if (peer_node_id(s->ssl, id) < 0 || !p->member || memcmp(id, p->member->id, NODE_ID_BYTES)) {
            dial_failed(p, "wrong-peer-key");
            return;
        }
        if (p->is_probe) { /* its preamble goes, one byte comes back */
            p->state = P_PROBE;
        } else {
            p->state = P_RELAY;
            report("opened %u", p->id);
        }
    }
    if (p->state == P_PROBE) {
        if (p->up.start < p->up.end) {
            ssize_t put = side_write(s, p->up.data + p->up.start, p->up.end - p->up.start);
            if (put == -2) { dial_failed(p, "write-failed"); return; }
            if (put > 0) p->up.start += (size_t)put;
        }
        uint8_t answer;
        ssize_t got = side_read(s, &answer, 1);
        if (got == 1 && answer == PROBE_ANSWER) {
            report("probe %s ok %llu", p->member->hex, (unsigned long long)((now_ns() - p->started_ns) / 1000));
            free_pipe(p, 0, "probe-done");
            return;
        }
        if (got < 0) { dial_failed(p, "no-answer"); return; }
        set_events(s, EPOLLIN | (p->up.start < p->up.end ? EPOLLOUT : 0));
        return;
    }
    pump(p);
}

/* --- inbound: a member's relay dials ours -------------------------------------------------- */

static void refuse(struct pipe *p, const char *why) {
    struct sockaddr_storage addr;
    socklen_t len = sizeof addr;
    char host[INET6_ADDRSTRLEN + 8] = "?";
    if (getpeername(p->client.fd, (struct sockaddr *)&addr, &len) == 0)
        getnameinfo((struct sockaddr *)&addr, len, host, sizeof host, NULL, 0, NI_NUMERICHOST);
    report("refused %s %s", host, why);
    free_pipe(p, 1, why);
}

static void inbound_ready(struct pipe *p) {
    struct side *s = &p->client;
    if (p->state == P_HANDSHAKE) {
        int done = step_handshake(s);
        if (done < 0) { refuse(p, "tls-handshake-failed"); return; }
        if (!done) return;
        uint8_t id[NODE_ID_BYTES];
        if (peer_node_id(s->ssl, id) < 0 || !(p->member = find_member(id))) {
            refuse(p, "not-a-member");
            return;
        }
        p->state = P_PREAMBLE;
    }
    if (p->state == P_PREAMBLE) {
        ssize_t got = side_read(s, p->preamble + p->preamble_len, PREAMBLE_BYTES - p->preamble_len);
        if (got < 0) { refuse(p, "closed-before-preamble"); return; }
        p->preamble_len += (size_t)got;
        if (p->preamble_len < PREAMBLE_BYTES) { set_events(s, EPOLLIN); return; }
        if (memcmp(p->preamble, PREAMBLE_MAGIC, 4) || p->preamble[4] != PREAMBLE_VERSION
            || (p->preamble[5] != KIND_RPC && p->preamble[5] != KIND_PROBE)) {
            refuse(p, "bad-preamble");
            return;
        }
        release_shake(p);
        if (p->preamble[5] == KIND_PROBE) {
            uint8_t answer = PROBE_ANSWER;
            side_write(s, &answer, 1); /* fits any socket buffer */
            SSL_shutdown(s->ssl);
            free_pipe(p, 0, "probe");
            return;
        }
        struct sockaddr_in rpc = {.sin_family = AF_INET, .sin_port = htons((uint16_t)rpc_port),
                                  .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int fd = rpc_port ? socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
        if (fd >= 0) {
            tune_socket(fd);
            if (connect(fd, (struct sockaddr *)&rpc, sizeof rpc) < 0 && errno != EINPROGRESS) {
                close(fd);
                fd = -1;
            }
        }
        if (fd < 0) { refuse(p, "rpc-server-unreachable"); return; }
        p->server.fd = fd;
        p->state = P_RPC_CONNECTING;
        set_events(s, 0);
        set_events(&p->server, EPOLLOUT);
        return;
    }
    pump(p);
}

static void rpc_connected(struct pipe *p) {
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(p->server.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) { refuse(p, "rpc-server-unreachable"); return; }
    p->state = P_RELAY;
    p->deadline_ns = 0;
    p->announced = 1;
    rw_init(&p->watch, &rules, 0, 1, NULL, resolve_endpoint, p);
    report("inbound %u %s", p->id, p->member->hex);
    pump(p);
}

static void accept_inbound(int listen_fd) {
    for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) return;
        if (!tls || n_handshakes >= max_handshakes || n_pipes >= max_pipes) {
            struct linger lg = {1, 0}; /* caps: a flood of half-open handshakes costs us nothing */
            setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
            close(fd);
            report("refused - %s", !tls ? "not-ready" : "too-many-connections");
            continue;
        }
        struct pipe *p = new_pipe(next_inbound_id++, 0);
        if (next_inbound_id == 0) next_inbound_id = INBOUND_ID_BASE;
        tune_socket(fd);
        p->client.fd = fd;
        p->client.ssl = SSL_new(tls);
        SSL_set_fd(p->client.ssl, fd);
        SSL_set_accept_state(p->client.ssl);
        p->state = P_HANDSHAKE;
        p->holds_shake = 1;
        n_handshakes++;
        set_events(&p->client, EPOLLIN);
        inbound_ready(p);
    }
}

/* --- control lines --------------------------------------------------------------------------- */

static int queued_fds[MAX_QUEUED_FDS], n_queued_fds;

static void close_member_pipes(struct member *m, const char *why) {
    for (struct pipe *p = pipes, *next; p; p = next) {
        next = p->next;
        if (p->member == m) free_pipe(p, 1, why);
    }
}

static void parse_cmd_list(uint8_t *flags, const char *list) {
    memset(flags, 0, RW_CMD_LIMIT);
    if (!strcmp(list, "-")) return;
    for (const char *p = list; *p;) {
        int cmd = atoi(p);
        if (cmd >= 0 && cmd < RW_CMD_LIMIT) flags[cmd] = 1;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
}

static int opt_cmd(const char *s) { return strcmp(s, "-") ? atoi(s) : RW_NO_CMD; }

static void control_line(char *line) {
    char *argv[16];
    int argc = 0;
    for (char *tok = strtok(line, " "); tok && argc < 16; tok = strtok(NULL, " ")) argv[argc++] = tok;
    if (!argc) return;
    const char *verb = argv[0];
    if (!strcmp(verb, "identity") && argc == 3) {
        size_t cl = strlen(argv[1]) / 2, kl = strlen(argv[2]) / 2;
        uint8_t *c = malloc(cl + 1), *k = malloc(kl + 1);
        if (c && k && !from_hex(c, cl, argv[1]) && !from_hex(k, kl, argv[2])) {
            if (tls) SSL_CTX_free(tls);
            tls = make_tls(c, cl, k, kl);
        }
        if (k) memset(k, 0, kl);
        free(c);
        free(k);
        if (!tls) report("error identity not usable");
        return;
    }
    if (!strcmp(verb, "limits") && argc == 7) {
        rules.max_frame_bytes = strtoull(argv[1], NULL, 10);
        rules.max_held_before_reply = strtoull(argv[2], NULL, 10);
        rules.max_checked_bytes = strtoull(argv[3], NULL, 10);
        handshake_timeout_ns = strtoull(argv[4], NULL, 10) * 1000000ull;
        max_pipes = atoi(argv[5]);
        max_handshakes = atoi(argv[6]);
        return;
    }
    if (!strcmp(verb, "guard") && argc == 4) {
        guard_history = atoi(argv[1]) > 0 ? atoi(argv[1]) : 1;
        guard_min_history = atoi(argv[2]);
        guard_norm_ratio = strtod(argv[3], NULL);
        return;
    }
    if (!strcmp(verb, "dialect") && argc == 13 && rules.n_dialects < RW_MAX_DIALECTS) {
        struct rw_dialect *d = &rules.dialects[rules.n_dialects++];
        snprintf(d->name, sizeof d->name, "%s", argv[1]);
        d->major = atoi(argv[2]);
        d->min_minor = atoi(argv[3]);
        d->max_minor = strcmp(argv[4], "-") ? atoi(argv[4]) : -1;
        d->hello_request_bytes = strtoull(argv[5], NULL, 10);
        d->hello_reply_bytes = strtoull(argv[6], NULL, 10);
        d->required_flags = atoi(argv[7]);
        d->register_peer_cmd = opt_cmd(argv[8]);
        d->push_tensor_cmd = opt_cmd(argv[9]);
        d->last_cmd = opt_cmd(argv[10]);
        parse_cmd_list(d->no_reply, argv[11]);
        parse_cmd_list(d->async_push, argv[12]);
        return;
    }
    if (!strcmp(verb, "rpc-port") && argc == 2) {
        rpc_port = atoi(argv[1]);
        return;
    }
    if (!strcmp(verb, "endpoint") && argc == 3) {
        unsigned index = (unsigned)atoi(argv[1]);
        if (index < MAX_ENDPOINTS && strlen(argv[2]) < RW_REGISTER_ENDPOINT_BYTES) {
            free(endpoints[index]);
            endpoints[index] = strcmp(argv[2], "-") ? strdup(argv[2]) : NULL;
        }
        return;
    }
    if ((!strcmp(verb, "member") || !strcmp(verb, "forget")) && argc == 2) {
        uint8_t id[NODE_ID_BYTES];
        if (from_hex(id, NODE_ID_BYTES, argv[1])) return;
        struct member *m = find_member(id);
        if (!strcmp(verb, "forget")) {
            if (!m) return;
            close_member_pipes(m, "forgotten");
            memset(m, 0, sizeof *m);
            return;
        }
        for (int i = 0; !m && i < MAX_MEMBERS; i++)
            if (!members[i].used) {
                m = &members[i];
                m->used = 1;
                memcpy(m->id, id, NODE_ID_BYTES);
                snprintf(m->hex, sizeof m->hex, "%s", argv[1]);
            }
        return;
    }
    if ((!strcmp(verb, "tunnel") && argc == 6) || (!strcmp(verb, "probe") && argc == 4)) {
        int is_tunnel = verb[0] == 't';
        uint8_t id[NODE_ID_BYTES];
        int fd = -1;
        if (is_tunnel) {
            if (!n_queued_fds) { report("error tunnel %s without its socket", argv[1]); return; }
            fd = queued_fds[0];
            memmove(queued_fds, queued_fds + 1, (size_t)--n_queued_fds * sizeof *queued_fds);
        }
        const char *node = argv[is_tunnel ? 2 : 1], *host = argv[is_tunnel ? 3 : 2], *port = argv[is_tunnel ? 4 : 3];
        struct member *m = from_hex(id, NODE_ID_BYTES, node) ? NULL : find_member(id);
        const char *why = !m ? "not-a-member" : !tls ? "not-ready" : n_pipes >= max_pipes ? "too-many-connections" : NULL;
        if (why) {
            if (is_tunnel) report("closed %s %s", argv[1], why);
            else report("probe %s fail %s", node, why);
            if (fd >= 0) close(fd);
            return;
        }
        struct pipe *p = new_pipe(is_tunnel ? (uint32_t)strtoul(argv[1], NULL, 10) : 0, 1);
        p->is_probe = !is_tunnel;
        p->member = m;
        if (is_tunnel) {
            tune_socket(fd);
            p->client.fd = fd;
            rw_init(&p->watch, &rules, atoi(argv[5]), 0, judge_for_pipe, NULL, p);
        }
        start_dial(p, host, port, is_tunnel ? KIND_RPC : KIND_PROBE);
        if (p->server.fd < 0) dial_failed(p, "connect-failed");
        return;
    }
    report("error unknown control line %s", verb);
}

static char control_in[CONTROL_LINE_BYTES];
static size_t control_in_len;

/* Lines, and the sockets passed beside them (SCM_RIGHTS). Returns 0 when the sidecar has gone. */
static int read_control(void) {
    for (;;) {
        char cbuf[CMSG_SPACE(sizeof(int) * 8)];
        struct iovec iov = {control_in + control_in_len, sizeof control_in - control_in_len};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        ssize_t got = recvmsg(control_fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (got == 0) return 0;
        if (got < 0) return errno == EAGAIN || errno == EINTR;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *fds = (int *)CMSG_DATA(c);
            for (int i = 0; i < n; i++) {
                if (n_queued_fds < MAX_QUEUED_FDS) queued_fds[n_queued_fds++] = fds[i];
                else close(fds[i]);
            }
        }
        control_in_len += (size_t)got;
        char *start = control_in, *nl;
        while ((nl = memchr(start, '\n', control_in_len - (size_t)(start - control_in)))) {
            *nl = '\0';
            control_line(start);
            start = nl + 1;
        }
        control_in_len -= (size_t)(start - control_in);
        memmove(control_in, start, control_in_len);
        if (control_in_len == sizeof control_in) return 0; /* a line too long: the sidecar is broken */
    }
}

/* --- the loop ------------------------------------------------------------------------------- */

static void side_ready(struct side *s, uint32_t events) {
    struct pipe *p = s->pipe;
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) s->readable = 1;
    if (p->outbound && s == &p->server && p->state != P_RELAY) outbound_ready(p, events);
    else if (!p->outbound && p->state == P_RPC_CONNECTING && s == &p->server) rpc_connected(p);
    else if (!p->outbound && p->state != P_RELAY) inbound_ready(p);
    else if (p->state == P_RELAY) pump(p);
}

static void tick(void) {
    uint64_t now = now_ns();
    for (struct pipe *p = pipes, *next; p; p = next) {
        next = p->next;
        if (p->state == P_RELAY) report_stats(p);
        else if (p->deadline_ns && now > p->deadline_ns) {
            if (p->outbound) dial_failed(p, "timeout");
            else refuse(p, "handshake-timeout");
        }
    }
}

/* --replay: the watch and the judge driven by lines on stdin, for tests (README.md, "Testing").
 * Control lines configure; "watch CHECK REWRITE NODE" starts a connection; "c HEX" and "s HEX" are
 * client and server bytes; it prints "up HEX" and "down HEX" for what the watch released. */
static int replay(void) {
    static struct pipe p;
    char *line = NULL;
    size_t cap = 0;
    control_fd = STDOUT_FILENO;
    p.id = 1;
    p.up.data = malloc(1);
    p.down.data = malloc(1);
    while (getline(&line, &cap, stdin) > 0) {
        line[strcspn(line, "\n")] = '\0';
        int client = line[0] == 'c' && line[1] == ' ';
        if (!strncmp(line, "watch ", 6)) {
            char node[2 * NODE_ID_BYTES + 1] = "";
            int check = 0, rewrite = 0;
            uint8_t id[NODE_ID_BYTES];
            sscanf(line + 6, "%d %d %64s", &check, &rewrite, node);
            p.member = from_hex(id, NODE_ID_BYTES, node) ? NULL : find_member(id);
            rw_init(&p.watch, &rules, check, rewrite, judge_for_pipe, resolve_endpoint, &p);
            p.up.start = p.up.ok = p.up.end = p.down.start = p.down.ok = p.down.end = 0;
        } else if (client || (line[0] == 's' && line[1] == ' ')) {
            struct buf *b = client ? &p.up : &p.down;
            size_t n = strlen(line + 2) / 2;
            uint8_t *grown = realloc(b->data, b->end + n + 1);
            if (!grown || from_hex(grown + b->end, n, line + 2)) return 2;
            b->data = grown;
            b->end += n;
            b->ok += client ? rw_from_client(&p.watch, b->data + b->ok, b->end - b->ok)
                            : rw_from_server(&p.watch, b->data + b->ok, b->end - b->ok);
            watch_events(&p);
            char *hex = malloc(2 * (b->ok - b->start) + 1);
            for (size_t i = b->start; i < b->ok; i++) sprintf(hex + 2 * (i - b->start), "%02x", b->data[i]);
            hex[2 * (b->ok - b->start)] = '\0';
            printf("%s %s\n", client ? "up" : "down", hex); /* may be longer than a report line */
            fflush(stdout);
            free(hex);
            b->start = b->ok;
        } else {
            control_line(line);
        }
    }
    free(line);
    return 0;
}

int main(int argc, char **argv) {
    int listen_fd = -1;
    if (argc == 2 && !strcmp(argv[1], "--replay")) return replay();
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--control-fd")) control_fd = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--listen-fd")) listen_fd = atoi(argv[i + 1]);
    }
    if (control_fd < 0 || listen_fd < 0) {
        fprintf(stderr, "usage: %s --control-fd FD --listen-fd FD (started by mesh-inference, not by hand)\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* never outlive the sidecar */
    fcntl(control_fd, F_SETFL, fcntl(control_fd, F_GETFL) | O_NONBLOCK);
    fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    static enum handle_kind control_handle = H_CONTROL, listen_handle = H_LISTEN;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &control_handle};
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, control_fd, &ev);
    ev.data.ptr = &listen_handle;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &ev);
    struct sockaddr_storage addr;
    socklen_t len = sizeof addr;
    getsockname(listen_fd, (struct sockaddr *)&addr, &len);
    report("hello %s %d", RELAY_VERSION, ntohs(((struct sockaddr_in *)&addr)->sin_port));
    uint64_t next_tick = now_ns() + TICK_NS;
    uint32_t control_watched = EPOLLIN;
    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(epoll_fd, events, 64, 50);
        for (int i = 0; i < n; i++) {
            enum handle_kind *kind = events[i].data.ptr;
            if (*kind == H_CONTROL) {
                if (events[i].events & EPOLLOUT) flush_control();
                if ((events[i].events & (EPOLLIN | EPOLLHUP)) && !read_control()) return 0;
            } else if (*kind == H_LISTEN) {
                accept_inbound(listen_fd);
            } else {
                /* A pipe freed earlier in this batch may be named again: skip sides already closed. */
                struct side *s = (struct side *)kind;
                int alive = 0;
                for (struct pipe *p = pipes; p && !alive; p = p->next) alive = (&p->client == s || &p->server == s);
                if (alive && s->fd >= 0) side_ready(s, events[i].events);
            }
        }
        uint32_t control_events = EPOLLIN | (control_out_len ? EPOLLOUT : 0);
        if (control_events != control_watched) { /* a syscall only when it changes */
            struct epoll_event cev = {.events = control_events, .data.ptr = &control_handle};
            epoll_ctl(epoll_fd, EPOLL_CTL_MOD, control_fd, &cev);
            control_watched = control_events;
        }
        if (now_ns() >= next_tick) {
            tick();
            next_tick = now_ns() + TICK_NS;
        }
    }
}
