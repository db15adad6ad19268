/* mesh-data-relay: the native data path between members (README.md in this folder).
 *
 * One process per node, supervised by the sidecar (net/data_relay.py). One epoll loop, no threads.
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
 *
 * The files, one job each: main.c (the loop), control.c (the channel to the sidecar), commands.c
 * (what it says), members.c, judge.c (the output judge), pipe.c (buffers, the pump), tls.c, dial.c
 * (outbound), accept.c (inbound), replay.c (--replay), rpc_watch.c (the RPC reader).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "accept.h"
#include "control.h"
#include "dial.h"
#include "pipe.h"
#include "replay.h"

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
