/* Inbound: a member's relay dials ours; after TLS and the preamble, our rpc-server is connected. */
#ifndef MESH_ACCEPT_H
#define MESH_ACCEPT_H

#include <stdint.h>

#include "pipe.h"

extern int rpc_port;              /* our rpc-server, on 127.0.0.1 (0: not known yet) */
extern int max_shakes_per_source; /* connections in steps 1-3 (README.md) from one address */

/* Why a connection to the data port was refused (README.md, "What faces the network"). */
enum refusal {
    R_NOT_READY, R_NOT_ALLOWED, R_TOO_MANY, R_TOO_MANY_FROM_ADDRESS, R_TLS_FAILED, R_NOT_A_MEMBER,
    R_CLOSED_BEFORE_PREAMBLE, R_BAD_PREAMBLE, R_RPC_UNREACHABLE, R_HANDSHAKE_TIMEOUT, R_UNUSABLE, R_COUNT
};

/* The data port `fd` (bound by the sidecar), watched from now on; -1 if epoll refuses it. */
int listen_on(int fd);
/* Take every connection waiting on the data port, or reset it at once (not a member's address, caps). */
void accept_inbound(void);
/* The data port watched again, if running out of descriptors paused it (each tick). */
void resume_listening(void);
/* The member's side moved: TLS, then the preamble. */
void inbound_ready(struct pipe *p);
/* Our rpc-server's connect finished (or failed). */
void rpc_connected(struct pipe *p);
/* Counted for the next "refused" line, and reset. */
void refuse(struct pipe *p, enum refusal why);
/* The refusals since the last line, as one "refused COUNT ADDRESS WHY:N,..." line, at most once a
 * REFUSED_INTERVAL_NS. */
void report_refusals(uint64_t now);

#endif
