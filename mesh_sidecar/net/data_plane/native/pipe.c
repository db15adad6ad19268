/* Pipes: buffers, the pump, a pipe's life (pipe.h). */
#define _GNU_SOURCE
#include "pipe.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control.h"

struct pipe *pipes;
int n_pipes, n_handshakes;
int epoll_fd;
struct rw_rules rules;
uint64_t handshake_timeout_ns = 5000000000ull;
int max_pipes = 256, max_handshakes = 16;

void set_events(struct side *s, uint32_t events) {
    if (s->fd < 0 || (s->registered && s->events == events)) return;
    struct epoll_event ev = {.events = events, .data.ptr = s};
    if (epoll_ctl(epoll_fd, s->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s->fd, &ev) < 0) {
        s->pipe->stalled = 1; /* it would wait for ever: the tick ends it */
        return;
    }
    s->events = events;
    s->registered = 1;
}

static void close_side(struct side *s, int reset) {
    if (s->fd < 0) return;
    if (s->ssl) SSL_free(s->ssl);
    s->ssl = NULL;
    /* Not registered, or the DEL refused: close() takes it out of epoll all the same. */
    if (s->registered && epoll_ctl(epoll_fd, EPOLL_CTL_DEL, s->fd, NULL) < 0) s->registered = 0;
    close_socket(s->fd, reset); /* an RST, so llama-server or rpc-server sees an error, not a clean end */
    s->fd = -1;
}

void report_stats(struct pipe *p) {
    uint64_t now = now_ns();
    if (p->owing_since_ns) {
        p->owed_ns += now - p->owing_since_ns;
        p->owing_since_ns = now;
    }
    if (p->from_client == p->reported_client && p->from_server == p->reported_server && !p->owed_ns
        && p->watch.frames == p->reported_frames && p->watch.activation_bytes == p->reported_activation
        && p->watch.allocated_bytes == p->reported_alloc)
        return;
    if (!report_summary("stats %u %llu %llu %llu %llu %llu %llu", p->id,
           (unsigned long long)(p->from_client - p->reported_client),
           (unsigned long long)(p->from_server - p->reported_server),
           (unsigned long long)(p->watch.frames - p->reported_frames),
           (unsigned long long)(p->watch.activation_bytes - p->reported_activation),
           (unsigned long long)(p->watch.allocated_bytes - p->reported_alloc),
           (unsigned long long)(p->owed_ns / 1000)))
        return; /* the next one carries these counts too */
    p->reported_client = p->from_client;
    p->reported_server = p->from_server;
    p->reported_frames = p->watch.frames;
    p->reported_activation = p->watch.activation_bytes;
    p->reported_alloc = p->watch.allocated_bytes;
    p->owed_ns = 0;
}

/* An inbound connection gives its handshake slot back exactly once: when its preamble is read, or when
 * it is freed before that, whichever comes first. */
void release_shake(struct pipe *p) {
    if (!p->holds_shake) return;
    p->holds_shake = 0;
    n_handshakes--;
}

void free_pipe(struct pipe *p, int reset, const char *why) {
    if (p->state == P_RELAY) report_stats(p);
    release_shake(p);
    /* A probe reports its own end; an inbound connection refused before relaying was reported so. */
    if (!p->is_probe && !p->handed_back && (p->outbound || p->announced)) report("closed %u %s", p->id, why);
    close_side(&p->client, reset);
    close_side(&p->server, reset);
    free(p->up.data);
    free(p->down.data);
    for (struct pipe **q = &pipes; *q; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            break;
        }
    n_pipes--;
    free(p);
}

struct pipe *new_pipe(uint32_t id, int outbound, int check, int rewrite) {
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
    rw_init(&p->watch, &rules, check, rewrite, judge_for_pipe, endpoint_for_pipe, p);
    p->next = pipes;
    pipes = p;
    n_pipes++;
    return p;
}

int tune_socket(int fd) {
    int one = 1, flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return -1;
    /* RPC is strict request/response: Nagle would add a delay per command. Without it (not TCP, or
     * refused) bytes still flow, later. */
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) return 0;
    return 0;
}

void close_socket(int fd, int reset) {
    struct linger lg = {1, 0};
    /* The option refused: a clean end instead of an RST, the socket closed all the same. */
    if (reset && setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) < 0) reset = 0;
    close(fd);
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

ssize_t side_read(struct side *s, uint8_t *to, size_t n) {
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

ssize_t side_write(struct side *s, const uint8_t *from, size_t n) {
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
    else if (shutdown(s->fd, SHUT_WR) < 0) s->pipe->stalled = 1; /* its end would never arrive */
}

void watch_events(struct pipe *p) {
    const char *text;
    enum rw_event_kind kind;
    while ((kind = rw_next_event(&p->watch, &text)) != RW_EV_NONE) {
        switch (kind) {
        case RW_EV_DIALECT: report("event %u dialect %s", p->id, text); break;
        case RW_EV_OFF: report("event %u check-off %s", p->id, text); break;
        case RW_EV_REWRITTEN: report("event %u rewritten %s", p->id, text); break;
        case RW_EV_UNRESOLVED: report("event %u unresolved %s", p->id, text); break;
        case RW_EV_BROKEN: report("event %u broken %s", p->id, text); break;
        case RW_EV_DROPPED: report("event %u dropped %s", p->id, text); break;
        case RW_EV_VIOLATION: { /* "REASON DETAILS...": the worker's fault, as a rejected tensor is */
            size_t reason = strcspn(text, " ");
            report("event %u violation %s", p->id, text);
            report("rejected %u protocol %.*s 0 0 0 0 0", p->id, (int)reason, text);
            break;
        }
        default: break; /* RW_EV_REJECTED is reported by the judge, with its figures */
        }
    }
}

int pump(struct pipe *p) {
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

int judge_for_pipe(void *ctx, const struct rw_measured *t) {
    struct pipe *p = ctx;
    struct verdict v;
    if (!p->member || !judge_tensor(&p->member->judged, t, &v)) return 0;
    report("rejected %u %s %s %llu %.6g %.6g %.6g %d", p->id, v.kind, t->name[0] ? t->name : "-",
           (unsigned long long)t->values, t->finite ? t->rms : 0.0, v.low, v.high, v.count);
    return 1;
}

const char *endpoint_for_pipe(void *ctx, uint32_t index) {
    const struct pipe *p = ctx;
    return p->member ? member_endpoint(p->member, index) : NULL;
}
