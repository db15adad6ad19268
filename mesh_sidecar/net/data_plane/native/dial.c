/* Outbound pipes (dial.h). */
#define _GNU_SOURCE
#include "dial.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control.h"
#include "tls.h"

void start_dial(struct pipe *p, const char *host, const char *port, int kind) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV}, *ai;
    memcpy(p->up.data, PREAMBLE_MAGIC, 4);
    p->up.data[4] = PREAMBLE_VERSION;
    p->up.data[5] = (uint8_t)kind;
    p->up.ok = p->up.end = PREAMBLE_BYTES;
    p->state = P_CONNECTING;
    if (getaddrinfo(host, port, &hints, &ai) != 0) return; /* the deadline ends it */
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd >= 0 && (tune_socket(fd) < 0 || (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS))) {
        close(fd);
        fd = -1;
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

void dial_failed(struct pipe *p, const char *why) {
    if (p->is_probe) report("probe %s fail %s", p->member->hex, why);
    else p->handed_back = hand_back(p, why);
    free_pipe(p, !p->handed_back, why); /* no RST on a socket the sidecar now holds */
}

void outbound_ready(struct pipe *p, uint32_t events) {
    struct side *s = &p->server;
    if (p->state == P_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
        if (err) {
            dial_failed(p, strerror(err));
            return;
        }
        if (!(s->ssl = SSL_new(tls)) || SSL_set_fd(s->ssl, s->fd) != 1) {
            dial_failed(p, "no-tls");
            return;
        }
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
