/* Inbound pipes (accept.h). */
#define _GNU_SOURCE
#include "accept.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control.h"
#include "tls.h"

int rpc_port;
static uint32_t next_inbound_id = INBOUND_ID_BASE;

void refuse(struct pipe *p, const char *why) {
    struct sockaddr_storage addr;
    socklen_t len = sizeof addr;
    char host[INET6_ADDRSTRLEN + 8] = "?";
    if (getpeername(p->client.fd, (struct sockaddr *)&addr, &len) == 0)
        getnameinfo((struct sockaddr *)&addr, len, host, sizeof host, NULL, 0, NI_NUMERICHOST);
    report("refused %s %s", host, why);
    free_pipe(p, 1, why);
}

void inbound_ready(struct pipe *p) {
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

void rpc_connected(struct pipe *p) {
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

void accept_inbound(int listen_fd) {
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
