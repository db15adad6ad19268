/* --replay (replay.h). */
#define _GNU_SOURCE
#include "replay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"
#include "control.h"
#include "pipe.h"

int replay(void) {
    static struct pipe p;
    char *line = NULL;
    size_t cap = 0;
    control_fd = STDOUT_FILENO;
    p.id = 1;
    p.up.data = malloc(1);
    p.down.data = malloc(1);
    if (!p.up.data || !p.down.data) return 2;
    while (getline(&line, &cap, stdin) > 0) {
        line[strcspn(line, "\n")] = '\0';
        int client = line[0] == 'c' && line[1] == ' ';
        if (!strncmp(line, "watch ", 6)) {
            char node[2 * NODE_ID_BYTES + 1] = "";
            int check = 0, rewrite = 0;
            uint8_t id[NODE_ID_BYTES];
            sscanf(line + 6, "%d %d %64s", &check, &rewrite, node);
            p.member = from_hex(id, NODE_ID_BYTES, node) ? NULL : find_member(id);
            rw_init(&p.watch, &rules, check, rewrite, judge_for_pipe, endpoint_for_pipe, &p);
            p.up.start = p.up.ok = p.up.end = p.down.start = p.down.ok = p.down.end = 0;
        } else if (client || (line[0] == 's' && line[1] == ' ')) {
            struct buf *b = client ? &p.up : &p.down;
            size_t n = strlen(line + 2) / 2;
            uint8_t *grown = realloc(b->data, b->end + n + 1);
            if (!grown) return 2;
            b->data = grown;
            if (from_hex(b->data + b->end, n, line + 2)) return 2;
            b->end += n;
            b->ok += client ? rw_from_client(&p.watch, b->data + b->ok, b->end - b->ok)
                            : rw_from_server(&p.watch, b->data + b->ok, b->end - b->ok);
            watch_events(&p);
            char *hex = malloc(2 * (b->ok - b->start) + 1);
            if (!hex) return 2;
            for (size_t i = b->start; i < b->ok; i++) sprintf(hex + 2 * (i - b->start), "%02x", b->data[i]);
            hex[2 * (b->ok - b->start)] = '\0';
            /* may be longer than a report line */
            int written = printf("%s %s\n", client ? "up" : "down", hex) >= 0 && fflush(stdout) == 0;
            free(hex);
            if (!written) return 2;
            b->start = b->ok;
        } else {
            control_line(line);
        }
    }
    free(line);
    return 0;
}
