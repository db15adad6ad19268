/* Fuzz harness for a relayed pipe (pipe.c): an inbound connection past its preamble (a member's relay ->
 * our rpc-server, the watch rewriting REGISTER_PEER), its two sides plain socket pairs, driven by a
 * script of what each far end does: send bytes, read, half-close, close; the pump runs after each
 * step, the tick's stats now and then. No crash, no leak (sanitizers); rpc-server never gets more
 * bytes than the member sent, nor the member more than rpc-server sent (a rewrite keeps sizes).
 *
 *   cmake -DMESH_FUZZ=ON -DCMAKE_C_COMPILER=clang ... && ./fuzz_pipe fuzz/corpus/pipe
 *
 * Input: steps of [op u8] [length u8] [bytes, for a send].
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "commands.h"
#include "control.h"
#include "members.h"
#include "pipe.h"

#define CHECK(x) do { if (!(x)) __builtin_trap(); } while (0)

/* What the sidecar tells a relay at its start (net/data_plane/control_lines.py), as far as a pipe reads it. */
static const char *const setup_lines[] = {
    "limits 68719476736 65536 67108864 5000 256 16 4",
    "dialect mesh-b2b-7 7 0 - 24 28 1 18 19 22 4,5,6,10,12,16,17,20,21,22 20,21,22",
    "dialect upstream-7 7 0 - 24 28 0 - - 17 4,5,6,10,12,16,17 -",
    "member 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f 127.0.0.1",
    "endpoint 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f 0 127.0.0.1:40001",
};

static void set_up(void) {
    control_fd = open("/dev/null", O_WRONLY | O_CLOEXEC); /* reports go nowhere */
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    CHECK(control_fd >= 0 && epoll_fd >= 0);
    for (size_t i = 0; i < sizeof setup_lines / sizeof *setup_lines; i++) {
        char line[256];
        struct command c;
        const char *error;
        strcpy(line, setup_lines[i]);
        CHECK(parse_command(line, &c, &error) == 0);
        apply_command(&c);
    }
}

static uint64_t drain(int fd) {
    uint8_t buf[65536];
    uint64_t total = 0;
    for (ssize_t got; (got = recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0;) total += (uint64_t)got;
    return total;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (control_fd < 0) set_up();
    int member[2], server[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, member) < 0) return 0;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, server) < 0) {
        close(member[0]);
        close(member[1]);
        return 0;
    }
    struct pipe *p = new_pipe(INBOUND_ID_BASE, 0, 0, 1);
    CHECK(p);
    p->client.fd = member[0];
    p->server.fd = server[0];
    p->member = &members[0];
    p->state = P_RELAY;
    p->announced = 1;
    p->deadline_ns = 0;
    uint64_t from_member = 0, from_server = 0, to_member = 0, to_server = 0;
    int alive = 1;
    for (size_t i = 0; alive && i + 1 < size;) {
        uint8_t op = data[i] % 7, len = data[i + 1];
        i += 2;
        size_t n = len <= size - i ? len : size - i;
        ssize_t put;
        switch (op) {
        case 0: if ((put = send(member[1], data + i, n, MSG_DONTWAIT | MSG_NOSIGNAL)) > 0) from_member += (uint64_t)put; i += n; break;
        case 1: if ((put = send(server[1], data + i, n, MSG_DONTWAIT | MSG_NOSIGNAL)) > 0) from_server += (uint64_t)put; i += n; break;
        case 2: shutdown(member[1], SHUT_WR); break;
        case 3: shutdown(server[1], SHUT_WR); break;
        case 4: to_member += drain(member[1]); to_server += drain(server[1]); break;
        case 5: report_stats(p); break;
        default: /* the member's relay goes: its side sees an end, and its writes fail */
            shutdown(member[1], SHUT_RDWR);
            break;
        }
        p->client.readable = p->server.readable = 1; /* as epoll would say, after any change */
        if (p->stalled) {
            free_pipe(p, 1, "reset");
            alive = 0;
        } else {
            alive = pump(p);
        }
        to_member += drain(member[1]);
        to_server += drain(server[1]);
        CHECK(to_server <= from_member && to_member <= from_server);
    }
    if (alive) free_pipe(p, 1, "reset");
    CHECK(n_pipes == 0 && !pipes);
    close(member[1]);
    close(server[1]);
    return 0;
}
