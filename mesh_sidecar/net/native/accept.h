/* Inbound: a member's relay dials ours; after TLS and the preamble, our rpc-server is connected. */
#ifndef MESH_ACCEPT_H
#define MESH_ACCEPT_H

#include "pipe.h"

extern int rpc_port; /* our rpc-server, on 127.0.0.1 (0: not known yet) */

/* Take every connection waiting on the data port (or reset it at once: caps, not ready). */
void accept_inbound(int listen_fd);
/* The member's side moved: TLS, then the preamble, then the pump. */
void inbound_ready(struct pipe *p);
/* Our rpc-server's connect finished (or failed). */
void rpc_connected(struct pipe *p);
/* Reported as "refused ADDRESS WHY", and reset. */
void refuse(struct pipe *p, const char *why);

#endif
