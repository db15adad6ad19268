/* Inbound pipes (accept.h). */
#define _GNU_SOURCE
#include "accept.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control.h"
#include "tls.h"

int rpc_port;
int max_shakes_per_source = 4;
static uint32_t next_inbound_id = INBOUND_ID_BASE;
static int listen_fd = -1, listen_paused;
static enum handle_kind listen_handle = H_LISTEN;

/* Refusals are summed and reported as one line a second at most: a flood costs the sidecar one line. */
static const char *const refusal_names[] = {
    [R_NOT_READY] = "not-ready",
    [R_NOT_ALLOWED] = "not-allowed",
    [R_TOO_MANY] = "too-many-connections",
    [R_TOO_MANY_FROM_ADDRESS] = "too-many-from-address",
    [R_TLS_FAILED] = "tls-handshake-failed",
    [R_NOT_A_MEMBER] = "not-a-member",
    [R_CLOSED_BEFORE_PREAMBLE] = "closed-before-preamble",
    [R_BAD_PREAMBLE] = "bad-preamble",
    [R_RPC_UNREACHABLE] = "rpc-server-unreachable",
    [R_HANDSHAKE_TIMEOUT] = "handshake-timeout",
    [R_UNUSABLE] = "socket-unusable",
};
static struct {
    uint64_t count, by_why[R_COUNT];
    char last[INET6_ADDRSTRLEN];   /* the last one's source */
    uint64_t reported_ns;
} refusals;

void report_refusals(uint64_t now) {
    if (!refusals.count || (refusals.reported_ns && now - refusals.reported_ns < REFUSED_INTERVAL_NS)) return;
    char whys[R_COUNT * 48] = "";  /* a name (at most 24 characters), ':' and a count, each */
    size_t len = 0;
    for (int i = 0; i < R_COUNT; i++) {
        if (!refusals.by_why[i]) continue;
        int n = snprintf(whys + len, sizeof whys - len, "%s%s:%llu", len ? "," : "", refusal_names[i],
                         (unsigned long long)refusals.by_why[i]);
        if (n < 0 || (size_t)n >= sizeof whys - len) break;
        len += (size_t)n;
    }
    if (!report_summary("refused %llu %s %s", (unsigned long long)refusals.count, refusals.last, whys))
        return; /* counted on, for the next line */
    memset(&refusals, 0, sizeof refusals);
    refusals.reported_ns = now;
}

static void count_refusal(enum refusal why, const struct sockaddr_storage *from, socklen_t len) {
    refusals.count++;
    refusals.by_why[why]++;
    if (getnameinfo((const struct sockaddr *)from, len, refusals.last, sizeof refusals.last, NULL, 0,
                    NI_NUMERICHOST) != 0)
        snprintf(refusals.last, sizeof refusals.last, "?");
    report_refusals(now_ns());
}

void refuse(struct pipe *p, enum refusal why) {
    count_refusal(why, &p->peer, p->peer_len);
    free_pipe(p, 1, refusal_names[why]);
}

void inbound_ready(struct pipe *p) {
    struct side *s = &p->client;
    if (p->state == P_HANDSHAKE) {
        int done = step_handshake(s);
        if (done < 0) { refuse(p, R_TLS_FAILED); return; }
        if (!done) return;
        uint8_t id[NODE_ID_BYTES];
        if (peer_node_id(s->ssl, id) < 0 || !(p->member = find_member(id))) {
            refuse(p, R_NOT_A_MEMBER);
            return;
        }
        p->state = P_PREAMBLE;
    }
    if (p->state != P_PREAMBLE) return;
    ssize_t got = side_read(s, p->preamble + p->preamble_len, PREAMBLE_BYTES - p->preamble_len);
    if (got < 0) { refuse(p, R_CLOSED_BEFORE_PREAMBLE); return; }
    p->preamble_len += (size_t)got;
    if (p->preamble_len < PREAMBLE_BYTES) { set_events(s, EPOLLIN); return; }
    if (memcmp(p->preamble, PREAMBLE_MAGIC, 4) || p->preamble[4] != PREAMBLE_VERSION
        || (p->preamble[5] != KIND_RPC && p->preamble[5] != KIND_PROBE)) {
        refuse(p, R_BAD_PREAMBLE);
        return;
    }
    release_shake(p);
    if (p->preamble[5] == KIND_PROBE) {
        uint8_t answer = PROBE_ANSWER;
        /* One byte fits any socket buffer; a failed write is the prober's "no-answer". */
        if (side_write(s, &answer, 1) == 1) SSL_shutdown(s->ssl);
        free_pipe(p, 0, "probe");
        return;
    }
    struct sockaddr_in rpc = {.sin_family = AF_INET, .sin_port = htons((uint16_t)rpc_port),
                              .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = rpc_port ? socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0) : -1;
    if (fd >= 0 && (tune_socket(fd) < 0 || (connect(fd, (struct sockaddr *)&rpc, sizeof rpc) < 0
                                            && errno != EINPROGRESS))) {
        close(fd);
        fd = -1;
    }
    if (fd < 0) { refuse(p, R_RPC_UNREACHABLE); return; }
    p->server.fd = fd;
    p->state = P_RPC_CONNECTING;
    set_events(s, 0); /* the member's bytes wait in its socket until ours to rpc-server is up */
    set_events(&p->server, EPOLLOUT);
}

void rpc_connected(struct pipe *p) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(p->server.fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err) { refuse(p, R_RPC_UNREACHABLE); return; }
    p->state = P_RELAY;
    p->deadline_ns = 0;
    p->announced = 1;
    report("inbound %u %s", p->id, p->member->hex);
    pump(p);
}

static int shakes_from(const struct in6_addr *source) {
    int n = 0;
    for (struct pipe *p = pipes; p; p = p->next) n += p->holds_shake && !memcmp(&p->source, source, sizeof *source);
    return n;
}

static void watch_listener(uint32_t events) {
    struct epoll_event ev = {.events = events, .data.ptr = &listen_handle};
    if (epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev) == 0) listen_paused = !events;
}

int listen_on(int fd) {
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listen_handle};
    listen_fd = fd;
    return epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
}

void resume_listening(void) {
    if (listen_paused) watch_listener(EPOLLIN);
}

void accept_inbound(void) {
    for (;;) {
        struct sockaddr_storage from;
        socklen_t len = sizeof from;
        int fd = accept4(listen_fd, (struct sockaddr *)&from, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            /* Out of descriptors or memory: epoll (level-triggered) would wake us for ever, so the
             * port waits for the next tick; its backlog holds what comes meanwhile. */
            if (errno != EAGAIN && errno != EWOULDBLOCK) watch_listener(0);
            return;
        }
        /* Sources the sidecar never named are closed before any TLS: a stranger's flood costs an
         * accept and a close each, and holds nothing. */
        struct in6_addr source;
        int known = address_of((struct sockaddr *)&from, &source) == 0 && address_allowed(&source);
        enum refusal why = !tls ? R_NOT_READY : !known ? R_NOT_ALLOWED
                         : n_handshakes >= max_handshakes || n_pipes >= max_pipes ? R_TOO_MANY
                         : shakes_from(&source) >= max_shakes_per_source ? R_TOO_MANY_FROM_ADDRESS
                         : tune_socket(fd) < 0 ? R_UNUSABLE : R_COUNT;
        struct pipe *p = why == R_COUNT ? new_pipe(next_inbound_id, 0, 0, 1) : NULL;
        if (p && (!(p->client.ssl = SSL_new(tls)) || SSL_set_fd(p->client.ssl, fd) != 1)) {
            free_pipe(p, 1, "no-tls");
            p = NULL;
            why = R_UNUSABLE;
        }
        if (!p) {
            close_socket(fd, 1);
            count_refusal(why == R_COUNT ? R_TOO_MANY : why, &from, len);
            continue;
        }
        if (++next_inbound_id == 0) next_inbound_id = INBOUND_ID_BASE;
        p->client.fd = fd;
        p->source = source;
        p->peer = from;
        p->peer_len = len;
        SSL_set_accept_state(p->client.ssl);
        p->state = P_HANDSHAKE;
        p->holds_shake = 1;
        n_handshakes++;
        set_events(&p->client, EPOLLIN);
        inbound_ready(p);
    }
}
