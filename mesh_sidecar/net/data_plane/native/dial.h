/* Outbound: llama-server's connection (a tunnel), or a probe, to a member's relay. */
#ifndef MESH_DIAL_H
#define MESH_DIAL_H

#include <stdint.h>

#include "pipe.h"

/* Connect `p`'s server side to HOST:PORT, its preamble (of `kind`) queued. server.fd < 0: it failed. */
void start_dial(struct pipe *p, const char *host, const char *port, int kind);
/* A dial that did not reach the member's relay: a probe fails, a tunnel goes back to the sidecar. */
void dial_failed(struct pipe *p, const char *why);
/* The dialed side moved (connect, handshake, probe answer), until the pipe relays. */
void outbound_ready(struct pipe *p, uint32_t events);

#endif
