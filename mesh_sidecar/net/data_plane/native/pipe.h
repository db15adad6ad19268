/* Pipes: one relayed connection each, its two sides, its buffers, and the pump between them. */
#ifndef MESH_PIPE_H
#define MESH_PIPE_H

#include <openssl/ssl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "judge.h"
#include "members.h"
#include "relay.h"
#include "rpc_watch.h"

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
    uint64_t deadline_ns, started_ns;
    uint8_t preamble[PREAMBLE_BYTES];
    size_t preamble_len;
    uint64_t from_client, from_server, reported_client, reported_server;
    uint64_t reported_frames, reported_activation, reported_alloc;
    uint64_t owing_since_ns, owed_ns;
    int is_probe;                  /* reports "probe", never "closed" */
    int handed_back;               /* reported as "fallback", never "closed" */
    int announced;                 /* inbound: reported "inbound", so its end is reported too */
    int stalled;                   /* epoll refused to watch a side: ended at the next tick */
    int holds_shake;               /* inbound: counted in n_handshakes until authenticated or freed */
    struct in6_addr source;        /* inbound: where it came from (members.h's form), and as accepted */
    struct sockaddr_storage peer;
    socklen_t peer_len;
    struct pipe *next;
};


extern struct pipe *pipes;
extern int n_pipes, n_handshakes;
extern int epoll_fd;
/* What the sidecar's `limits` and `dialect` lines said. */
extern struct rw_rules rules;
extern uint64_t handshake_timeout_ns;
extern int max_pipes, max_handshakes;

/* NULL when max_pipes are open. Its watch is set up at once (`check`: judge replies, `rewrite`:
 * REGISTER_PEER), so no byte can pass an unset one, whatever state the pipe is in. */
struct pipe *new_pipe(uint32_t id, int outbound, int check, int rewrite);
/* Closes both sides (an RST each when `reset`) and reports the end as the pipe's kind wants. */
void free_pipe(struct pipe *p, int reset, const char *why);
/* An inbound pipe's handshake slot, given back exactly once. */
void release_shake(struct pipe *p);
void set_events(struct side *s, uint32_t events);
/* Nonblocking (-1 if it cannot be: the one loop must never wait), and no Nagle delay. */
int tune_socket(int fd);
/* Closed, with an RST when `reset` (the peer sees an error, not a clean end). */
void close_socket(int fd, int reset);
/* >0 bytes, 0 nothing now, -1 EOF, -2 error. */
ssize_t side_read(struct side *s, uint8_t *to, size_t n);
/* >=0 bytes taken, -2 error. */
ssize_t side_write(struct side *s, const uint8_t *from, size_t n);
/* Move what can move, both ways, until nothing does. Returns 0 when the pipe was freed. */
int pump(struct pipe *p);
void report_stats(struct pipe *p);
/* The watch's events, as report lines. */
void watch_events(struct pipe *p);
/* The judge of a serving pipe's measured outputs (an rw_judge_fn). */
int judge_for_pipe(void *ctx, const struct rw_measured *t);
/* An inbound pipe's REGISTER_PEER index -> its endpoint here, through its own member's table only (an
 * rw_resolve_fn): another member's table never maps this member's indices. */
const char *endpoint_for_pipe(void *ctx, uint32_t index);

#endif
