/* The sidecar's command lines (net/data_plane/control_lines.py's grammar): parsed once, strictly, then acted on.
 *
 * Parsing is pure (no I/O, no state: fuzz_control.c drives it): every word is checked for its form and
 * range, and a line that does not fit is refused whole, never half applied. */
#ifndef MESH_COMMANDS_H
#define MESH_COMMANDS_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "relay.h"
#include "rpc_watch.h"

#define MAX_COMMAND_WORDS 16

enum command_verb {
    C_IDENTITY, C_LIMITS, C_GUARD, C_DIALECT, C_RPC_PORT, C_ENDPOINT, C_MEMBER, C_FORGET, C_NEW_SESSION,
    C_TUNNEL, C_PROBE
};

/* One parsed line; strings point into the line it was parsed from. */
struct command {
    enum command_verb verb;
    const char *cert_hex, *key_hex;                      /* identity */
    uint64_t max_frame, max_held, max_checked, handshake_ms; /* limits */
    int pipes, shakes, shakes_per_address;
    int history, min_history;                            /* guard */
    double norm_ratio, max_rms, max_abs;
    struct rw_dialect dialect;                           /* dialect */
    int port;                                            /* rpc-port; tunnel and probe: the peer's relay */
    uint32_t index;                                      /* endpoint */
    const char *endpoint;                                /* NULL: "-" */
    uint8_t node[NODE_ID_BYTES];                         /* member, forget, endpoint, tunnel, probe */
    const char *node_hex;
    struct in6_addr addresses[MAX_MEMBER_ADDRESSES];     /* member */
    int n_addresses;
    uint32_t id;                                         /* tunnel */
    const char *host, *port_text;                        /* tunnel, probe: numeric */
    int check;                                           /* tunnel */
};

/* One line without its newline, split at spaces in place. 0 and `out` filled, or -1 and `*error`
 * saying what is wrong. */
int parse_command(char *line, struct command *out, const char **error);
/* What a parsed line says, done. */
void apply_command(const struct command *c);
/* A line from the sidecar: parsed and applied, or reported as an error. A tunnel line takes the
 * socket passed beside it either way. The line is wiped afterwards (an identity carries the key). */
void control_line(char *line);

#endif
