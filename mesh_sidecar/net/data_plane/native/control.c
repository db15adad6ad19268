/* The control channel: lines to the sidecar, lines and sockets from it (control.h). */
#define _GNU_SOURCE
#include "control.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "commands.h"
#include "relay.h"

int control_fd = -1;
static char *control_out;
size_t control_out_len;
static size_t control_out_cap;

void flush_control(void) {
    while (control_out_len) {
        ssize_t n = write(control_fd, control_out, control_out_len); /* nonblocking; SIGPIPE ignored */
        if (n <= 0) return; /* EAGAIN: epoll says when; an error: the read side sees EOF and exits */
        memmove(control_out, control_out + n, control_out_len - (size_t)n);
        control_out_len -= (size_t)n;
    }
}

static int queue_line(int summary, const char *fmt, va_list ap) {
    char line[1024];
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    if (n < 0) return 0;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    /* One call, one line: bytes a peer chose (an endpoint, a tensor name) can neither end it nor start
     * another, whoever formatted them. */
    for (int i = 0; i < n; i++)
        if ((unsigned char)line[i] < 0x20 || (unsigned char)line[i] > 0x7e) line[i] = '?';
    line[n++] = '\n';
    if (summary && control_out_len + (size_t)n > CONTROL_OUT_MAX_BYTES) return 0;
    if (control_out_len + (size_t)n > CONTROL_OUT_HARD_MAX_BYTES) {
        /* 60 MiB of state lines unread: a sidecar that stopped reading. It starts a new relay once it
         * reads again; carrying on without telling it what happened would leave it wrong for good. */
        fprintf(stderr, "mesh-data-relay: the sidecar reads no reports; exiting\n");
        exit(3);
    }
    if (control_out_len + (size_t)n > control_out_cap) {
        control_out_cap = (control_out_len + (size_t)n) * 2;
        control_out = realloc(control_out, control_out_cap);
        if (!control_out) abort();
    }
    memcpy(control_out + control_out_len, line, (size_t)n);
    control_out_len += (size_t)n;
    flush_control();
    return 1;
}

void report(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    queue_line(0, fmt, ap);
    va_end(ap);
}

int report_summary(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int queued = queue_line(1, fmt, ap);
    va_end(ap);
    return queued;
}

static int queued_fds[MAX_QUEUED_FDS], n_queued_fds;

int take_queued_fd(void) {
    if (!n_queued_fds) return -1;
    int fd = queued_fds[0];
    memmove(queued_fds, queued_fds + 1, (size_t)--n_queued_fds * sizeof *queued_fds);
    return fd;
}

static char control_in[CONTROL_LINE_BYTES];
static size_t control_in_len;

/* Lines, and the sockets passed beside them (SCM_RIGHTS). Returns 0 when the sidecar has gone. */
int read_control(void) {
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
        size_t had = control_in_len;
        control_in_len -= (size_t)(start - control_in);
        memmove(control_in, start, control_in_len);
        explicit_bzero(control_in + control_in_len, had - control_in_len); /* what was moved, and the lines */
        if (control_in_len == sizeof control_in) return 0; /* a line too long: the sidecar is broken */
    }
}
