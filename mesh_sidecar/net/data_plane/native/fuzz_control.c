/* Fuzz harness for the relay's control lines (commands.c) and the state they leave: any bytes, split at
 * newlines as read_control() splits them, parsed strictly; what parses is checked against the grammar's
 * ranges and applied to the relay's state (members and their addresses, endpoints, limits, the judge's
 * figures, dialects), all but identity, tunnel and probe (they reach OpenSSL's key parsing and the
 * network). Then the judge runs once per member over the histories and figures those lines left.
 * No crash, no read or write out of bounds, no leak (build with sanitizers).
 *
 *   cmake -DMESH_FUZZ=ON -DCMAKE_C_COMPILER=clang ... && ./fuzz_control fuzz/corpus/control
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"
#include "control.h"
#include "judge.h"
#include "members.h"
#include "pipe.h"

#define CHECK(x) do { if (!(x)) __builtin_trap(); } while (0)

static void check_ranges(const struct command *c) {
    switch (c->verb) {
    case C_LIMITS:
        CHECK(c->handshake_ms >= 1 && c->pipes >= 1 && c->shakes >= 1 && c->shakes <= c->pipes);
        CHECK(c->shakes_per_address >= 1 && c->shakes_per_address <= c->shakes);
        break;
    case C_GUARD:
        CHECK(c->history >= 1 && c->min_history >= 0 && c->min_history <= c->history);
        CHECK(c->norm_ratio > 0 && c->max_rms > 0 && c->max_abs > 0);
        break;
    case C_DIALECT:
        CHECK(memchr(c->dialect.name, 0, sizeof c->dialect.name) != NULL);
        CHECK(c->dialect.max_minor == -1 || c->dialect.max_minor >= c->dialect.min_minor);
        CHECK(c->dialect.hello_reply_bytes <= RW_MAX_HELLO_REPLY_BYTES);
        break;
    case C_ENDPOINT:
        CHECK(c->index < MAX_ENDPOINTS && (!c->endpoint || strlen(c->endpoint) < RW_REGISTER_ENDPOINT_BYTES));
        break;
    case C_MEMBER: CHECK(c->n_addresses <= MAX_MEMBER_ADDRESSES); break;
    case C_TUNNEL: CHECK(c->id < INBOUND_ID_BASE && c->check <= 1); /* fall through */
    case C_PROBE: CHECK(c->port >= 1 && c->port <= 65535 && c->host && c->port_text); break;
    default: break;
    }
}

static void judge_members(void) {
    struct rw_measured t = {.values = 4, .finite = 1, .rms = 1.5, .max_abs = 2.0};
    struct verdict v;
    for (int i = 0; i < MAX_MEMBERS; i++) {
        if (!members[i].used) continue;
        memcpy(t.name, members[i].hex, 8);
        for (int k = 0; k < 3; k++) judge_tensor(&members[i].judged, &t, &v);
    }
}

static void reset_state(void) {
    for (int i = 0; i < MAX_MEMBERS; i++) {
        forget_judged(&members[i].judged);
        forget_endpoints(&members[i]);
    }
    memset(members, 0, sizeof members);
    memset(&rules, 0, sizeof rules);
    guard_history = 64;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (control_fd < 0) control_fd = open("/dev/null", O_WRONLY | O_CLOEXEC); /* reports go nowhere */
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    for (char *line = text, *nl; line < text + size; line = nl + 1) {
        nl = memchr(line, '\n', (size_t)(text + size - line));
        if (!nl) nl = text + size;
        *nl = '\0';
        if (nl - line >= CONTROL_LINE_BYTES) continue; /* read_control() ends on a longer line */
        struct command c;
        const char *error;
        if (parse_command(line, &c, &error) < 0) {
            CHECK(error && *error);
            continue;
        }
        check_ranges(&c);
        if (c.verb != C_IDENTITY && c.verb != C_TUNNEL && c.verb != C_PROBE) apply_command(&c);
    }
    judge_members();
    reset_state();
    free(text);
    return 0;
}
