/* mesh-data-relay: the native data path between members (README.md in this folder).
 *
 * One process per node, supervised by the sidecar (net/data_plane/process.py). One epoll loop, no threads.
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
#include <errno.h>
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
    if (p->state == P_RELAY) pump(p);
    else if (p->outbound) { if (s == &p->server) outbound_ready(p, events); }
    else if (p->state != P_RPC_CONNECTING) inbound_ready(p);
    else if (s == &p->server) rpc_connected(p);
    /* The member's side while ours to rpc-server connects: its bytes wait, but an end is reported
     * (level-triggered) until acted on. */
    else if (events & (EPOLLHUP | EPOLLERR)) free_pipe(p, 1, "reset");
}

static void tick(void) {
    uint64_t now = now_ns();
    for (struct pipe *p = pipes, *next; p; p = next) {
        next = p->next;
        if (p->stalled) free_pipe(p, 1, "reset");
        else if (p->state == P_RELAY) report_stats(p);
        else if (p->deadline_ns && now > p->deadline_ns) {
            if (p->outbound) dial_failed(p, "timeout");
            else refuse(p, R_HANDSHAKE_TIMEOUT);
        }
    }
    report_refusals(now);
    resume_listening();
}

static int set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    return flags < 0 ? -1 : fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

int main(int argc, char **argv) {
    int listen_fd = -1;
    /* The process holds the node's key: no core dump, no ptrace by other processes of this user. */
    if (prctl(PR_SET_DUMPABLE, 0) < 0) {
        perror("mesh-data-relay: prctl(PR_SET_DUMPABLE)");
        return 2;
    }
    if (argc == 2 && !strcmp(argv[1], "--replay")) return replay();
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--control-fd")) control_fd = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--listen-fd")) listen_fd = atoi(argv[i + 1]);
    }
    if (control_fd < 0 || listen_fd < 0) {
        fprintf(stderr, "usage: %s --control-fd FD --listen-fd FD (started by mesh-inference, not by hand)\n", argv[0]);
        return 2;
    }
    static enum handle_kind control_handle = H_CONTROL;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &control_handle};
    struct sockaddr_in addr;
    socklen_t len = sizeof addr;
    if (signal(SIGPIPE, SIG_IGN) == SIG_ERR || prctl(PR_SET_PDEATHSIG, SIGTERM) < 0 /* never outlive the sidecar */
        || set_nonblocking(control_fd) < 0 || set_nonblocking(listen_fd) < 0
        || (epoll_fd = epoll_create1(EPOLL_CLOEXEC)) < 0 || epoll_ctl(epoll_fd, EPOLL_CTL_ADD, control_fd, &ev) < 0
        || listen_on(listen_fd) < 0 || getsockname(listen_fd, (struct sockaddr *)&addr, &len) < 0
        || addr.sin_family != AF_INET) {
        perror("mesh-data-relay: setting up");
        return 2;
    }
    report("hello %s %d", RELAY_VERSION, ntohs(addr.sin_port));
    uint64_t next_tick = now_ns() + TICK_NS;
    uint32_t control_watched = EPOLLIN;
    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(epoll_fd, events, 64, 50);
        if (n < 0 && errno != EINTR) {
            perror("mesh-data-relay: epoll_wait");
            return 2;
        }
        /* The sidecar's lines first: what it said (a member forgotten) applies before the peers' bytes
         * that came in the same round. */
        for (int i = 0; i < n; i++) {
            if (*(enum handle_kind *)events[i].data.ptr != H_CONTROL) continue;
            if (events[i].events & EPOLLOUT) flush_control();
            if ((events[i].events & (EPOLLIN | EPOLLHUP)) && !read_control()) return 0;
        }
        for (int i = 0; i < n; i++) {
            enum handle_kind *kind = events[i].data.ptr;
            if (*kind == H_LISTEN) {
                accept_inbound();
            } else if (*kind == H_SIDE) {
                /* A pipe freed earlier in this batch may be named again: skip sides already closed. */
                struct side *s = (struct side *)kind;
                int alive = 0;
                for (struct pipe *p = pipes; p && !alive; p = p->next) alive = (&p->client == s || &p->server == s);
                if (alive && s->fd >= 0) side_ready(s, events[i].events);
            }
        }
        uint32_t control_events = EPOLLIN | (control_out_len ? EPOLLOUT : 0);
        struct epoll_event cev = {.events = control_events, .data.ptr = &control_handle};
        /* A syscall only when it changes; refused, it is tried again on the next round. */
        if (control_events != control_watched && epoll_ctl(epoll_fd, EPOLL_CTL_MOD, control_fd, &cev) == 0)
            control_watched = control_events;
        if (now_ns() >= next_tick) {
            tick();
            next_tick = now_ns() + TICK_NS;
        }
    }
}
