/* Who the sidecar named (members.h). */
#define _GNU_SOURCE
#include "members.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct member members[MAX_MEMBERS];

static int nibble(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int from_hex(uint8_t *out, size_t n, const char *hex) {
    if (strlen(hex) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        int high = nibble(hex[2 * i]), low = nibble(hex[2 * i + 1]);
        if (high < 0 || low < 0) return -1;
        out[i] = (uint8_t)(high << 4 | low);
    }
    return 0;
}

struct member *find_member(const uint8_t *id) {
    for (int i = 0; i < MAX_MEMBERS; i++)
        if (members[i].used && !memcmp(members[i].id, id, NODE_ID_BYTES)) return &members[i];
    return NULL;
}

const char *member_endpoint(const struct member *m, uint32_t index) {
    return index < MAX_ENDPOINTS ? m->endpoints[index] : NULL;
}

int set_member_endpoint(struct member *m, uint32_t index, const char *endpoint) {
    char *copy = endpoint ? strdup(endpoint) : NULL;
    if (index >= MAX_ENDPOINTS || (endpoint && !copy)) {
        free(copy);
        return -1;
    }
    free(m->endpoints[index]);
    m->endpoints[index] = copy;
    return 0;
}

void forget_endpoints(struct member *m) {
    for (int i = 0; i < MAX_ENDPOINTS; i++) {
        free(m->endpoints[i]);
        m->endpoints[i] = NULL;
    }
}

static void mapped_v4(struct in6_addr *out, const struct in_addr *v4) {
    memset(out, 0, sizeof *out);
    out->s6_addr[10] = out->s6_addr[11] = 0xff;
    memcpy(&out->s6_addr[12], v4, 4);
}

int address_of(const struct sockaddr *sa, struct in6_addr *out) {
    if (sa->sa_family == AF_INET) {
        mapped_v4(out, &((const struct sockaddr_in *)sa)->sin_addr);
        return 0;
    }
    if (sa->sa_family != AF_INET6) return -1;
    *out = ((const struct sockaddr_in6 *)sa)->sin6_addr;
    return 0;
}

int parse_address(const char *text, struct in6_addr *out) {
    struct in_addr v4;
    if (inet_pton(AF_INET, text, &v4) == 1) {
        mapped_v4(out, &v4);
        return 0;
    }
    return inet_pton(AF_INET6, text, out) == 1 ? 0 : -1;
}

int address_allowed(const struct in6_addr *address) {
    for (int i = 0; i < MAX_MEMBERS; i++)
        for (int j = 0; members[i].used && j < members[i].n_addresses; j++)
            if (!memcmp(&members[i].addresses[j], address, sizeof *address)) return 1;
    return 0;
}
