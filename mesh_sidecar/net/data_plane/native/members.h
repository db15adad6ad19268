/* Who the sidecar named: members (node keys), and each one's REGISTER_PEER endpoints on this machine. */
#ifndef MESH_MEMBERS_H
#define MESH_MEMBERS_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "judge.h"
#include "relay.h"

struct member {
    int used;
    uint8_t id[NODE_ID_BYTES];
    char hex[2 * NODE_ID_BYTES + 1];
    struct judged judged;          /* the outputs its replies carried, over all its connections */
    struct in6_addr addresses[MAX_MEMBER_ADDRESSES]; /* where its relay dials from (IPv4 as ::ffff:a.b.c.d) */
    int n_addresses;
    /* Its REGISTER_PEERs' peer index (in its own rpc order) -> "127.0.0.1:port" here, or NULL. Only its own
     * connections resolve through it: no member can remap the indices another's REGISTER_PEER uses. */
    char *endpoints[MAX_ENDPOINTS];
};

extern struct member members[MAX_MEMBERS];

/* `hex`, exactly 2n digits, into `out`; -1 if it is not that. */
int from_hex(uint8_t *out, size_t n, const char *hex);
struct member *find_member(const uint8_t *id);
/* Member `m`'s REGISTER_PEER index -> its endpoint here, or NULL. */
const char *member_endpoint(const struct member *m, uint32_t index);
/* Sets (NULL: clears) one of `m`'s endpoints; -1 out of memory, the old one kept. */
int set_member_endpoint(struct member *m, uint32_t index, const char *endpoint);
/* Clears all of `m`'s endpoints (it is forgotten). */
void forget_endpoints(struct member *m);
/* A socket's address as member addresses are kept; -1 for a family that has none. */
int address_of(const struct sockaddr *sa, struct in6_addr *out);
/* A numeric IPv4 or IPv6 address as member addresses are kept; -1 if it is none. */
int parse_address(const char *text, struct in6_addr *out);
/* Whether the sidecar named a member at this address: no other source is even answered. */
int address_allowed(const struct in6_addr *address);

#endif
