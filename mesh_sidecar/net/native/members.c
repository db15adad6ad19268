/* Who the sidecar named (members.h). */
#include "members.h"

#include <stdio.h>
#include <string.h>

struct member members[MAX_MEMBERS];
char *endpoints[MAX_ENDPOINTS];

int from_hex(uint8_t *out, size_t n, const char *hex) {
    if (strlen(hex) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        out[i] = (uint8_t)v;
    }
    return 0;
}

struct member *find_member(const uint8_t *id) {
    for (int i = 0; i < MAX_MEMBERS; i++)
        if (members[i].used && !memcmp(members[i].id, id, NODE_ID_BYTES)) return &members[i];
    return NULL;
}

const char *resolve_endpoint(void *ctx, uint32_t index) {
    (void)ctx;
    return index < MAX_ENDPOINTS ? endpoints[index] : NULL;
}
