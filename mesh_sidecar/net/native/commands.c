/* The sidecar's command lines (commands.h). */
#include "commands.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "accept.h"
#include "control.h"
#include "dial.h"
#include "tls.h"

static void close_member_pipes(struct member *m, const char *why) {
    for (struct pipe *p = pipes, *next; p; p = next) {
        next = p->next;
        if (p->member == m) free_pipe(p, 1, why);
    }
}

static void parse_cmd_list(uint8_t *flags, const char *list) {
    memset(flags, 0, RW_CMD_LIMIT);
    if (!strcmp(list, "-")) return;
    for (const char *p = list; *p;) {
        int cmd = atoi(p);
        if (cmd >= 0 && cmd < RW_CMD_LIMIT) flags[cmd] = 1;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
}

static int opt_cmd(const char *s) { return strcmp(s, "-") ? atoi(s) : RW_NO_CMD; }

void control_line(char *line) {
    char *argv[16];
    int argc = 0;
    for (char *tok = strtok(line, " "); tok && argc < 16; tok = strtok(NULL, " ")) argv[argc++] = tok;
    if (!argc) return;
    const char *verb = argv[0];
    if (!strcmp(verb, "identity") && argc == 3) {
        size_t cl = strlen(argv[1]) / 2, kl = strlen(argv[2]) / 2;
        uint8_t *c = malloc(cl + 1), *k = malloc(kl + 1);
        if (c && k && !from_hex(c, cl, argv[1]) && !from_hex(k, kl, argv[2])) {
            if (tls) SSL_CTX_free(tls);
            tls = make_tls(c, cl, k, kl);
        }
        if (k) memset(k, 0, kl);
        free(c);
        free(k);
        if (!tls) report("error identity not usable");
        return;
    }
    if (!strcmp(verb, "limits") && argc == 8) {
        rules.max_frame_bytes = strtoull(argv[1], NULL, 10);
        rules.max_held_before_reply = strtoull(argv[2], NULL, 10);
        rules.max_checked_bytes = strtoull(argv[3], NULL, 10);
        handshake_timeout_ns = strtoull(argv[4], NULL, 10) * 1000000ull;
        max_pipes = atoi(argv[5]);
        max_handshakes = atoi(argv[6]);
        max_shakes_per_source = atoi(argv[7]);
        return;
    }
    if (!strcmp(verb, "guard") && argc == 6) {
        guard_history = atoi(argv[1]) > 0 ? atoi(argv[1]) : 1;
        guard_min_history = atoi(argv[2]);
        guard_norm_ratio = strtod(argv[3], NULL);
        guard_max_rms = strtod(argv[4], NULL);
        guard_max_abs = strtod(argv[5], NULL);
        return;
    }
    if (!strcmp(verb, "new-session") && argc == 1) {
        for (int i = 0; i < MAX_MEMBERS; i++) forget_judged(&members[i].judged);
        return;
    }
    if (!strcmp(verb, "dialect") && argc == 13 && rules.n_dialects < RW_MAX_DIALECTS) {
        struct rw_dialect *d = &rules.dialects[rules.n_dialects++];
        snprintf(d->name, sizeof d->name, "%s", argv[1]);
        d->major = atoi(argv[2]);
        d->min_minor = atoi(argv[3]);
        d->max_minor = strcmp(argv[4], "-") ? atoi(argv[4]) : -1;
        d->hello_request_bytes = strtoull(argv[5], NULL, 10);
        d->hello_reply_bytes = strtoull(argv[6], NULL, 10);
        d->required_flags = atoi(argv[7]);
        d->register_peer_cmd = opt_cmd(argv[8]);
        d->push_tensor_cmd = opt_cmd(argv[9]);
        d->last_cmd = opt_cmd(argv[10]);
        parse_cmd_list(d->no_reply, argv[11]);
        parse_cmd_list(d->async_push, argv[12]);
        return;
    }
    if (!strcmp(verb, "rpc-port") && argc == 2) {
        rpc_port = atoi(argv[1]);
        return;
    }
    if (!strcmp(verb, "endpoint") && argc == 3) {
        unsigned index = (unsigned)atoi(argv[1]);
        if (index < MAX_ENDPOINTS && strlen(argv[2]) < RW_REGISTER_ENDPOINT_BYTES) {
            free(endpoints[index]);
            endpoints[index] = strcmp(argv[2], "-") ? strdup(argv[2]) : NULL;
        }
        return;
    }
    if ((!strcmp(verb, "member") && argc >= 2) || (!strcmp(verb, "forget") && argc == 2)) {
        uint8_t id[NODE_ID_BYTES];
        if (from_hex(id, NODE_ID_BYTES, argv[1])) return;
        struct member *m = find_member(id);
        if (!strcmp(verb, "forget")) {
            if (!m) return;
            close_member_pipes(m, "forgotten");
            forget_judged(&m->judged);
            memset(m, 0, sizeof *m);
            return;
        }
        for (int i = 0; !m && i < MAX_MEMBERS; i++)
            if (!members[i].used) {
                m = &members[i];
                m->used = 1;
                memcpy(m->id, id, NODE_ID_BYTES);
                snprintf(m->hex, sizeof m->hex, "%s", argv[1]);
            }
        if (!m) { report("error no room for member %s", argv[1]); return; }
        if (argc == 2) return; /* the key alone: the addresses stay as they were */
        m->n_addresses = 0;
        for (int i = 2; i < argc && m->n_addresses < MAX_MEMBER_ADDRESSES; i++)
            if (parse_address(argv[i], &m->addresses[m->n_addresses]) == 0) m->n_addresses++;
            else report("error member %s: %s is no address", argv[1], argv[i]);
        return;
    }
    if ((!strcmp(verb, "tunnel") && argc == 6) || (!strcmp(verb, "probe") && argc == 4)) {
        int is_tunnel = verb[0] == 't';
        uint8_t id[NODE_ID_BYTES];
        int fd = -1;
        if (is_tunnel) {
            if ((fd = take_queued_fd()) < 0) { report("error tunnel %s without its socket", argv[1]); return; }
        }
        const char *node = argv[is_tunnel ? 2 : 1], *host = argv[is_tunnel ? 3 : 2], *port = argv[is_tunnel ? 4 : 3];
        struct member *m = from_hex(id, NODE_ID_BYTES, node) ? NULL : find_member(id);
        const char *why = !m ? "not-a-member" : !tls ? "not-ready" : n_pipes >= max_pipes ? "too-many-connections" : NULL;
        if (why) {
            if (is_tunnel) report("closed %s %s", argv[1], why);
            else report("probe %s fail %s", node, why);
            if (fd >= 0) close(fd);
            return;
        }
        if (is_tunnel && tune_socket(fd) < 0) {
            report("closed %s socket-unusable", argv[1]);
            close(fd);
            return;
        }
        struct pipe *p = new_pipe(is_tunnel ? (uint32_t)strtoul(argv[1], NULL, 10) : 0, 1,
                                  is_tunnel && atoi(argv[5]), 0);
        p->is_probe = !is_tunnel;
        p->member = m;
        p->client.fd = fd;
        start_dial(p, host, port, is_tunnel ? KIND_RPC : KIND_PROBE);
        if (p->server.fd < 0) dial_failed(p, "connect-failed");
        return;
    }
    report("error unknown control line %s", verb);
}
