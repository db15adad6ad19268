/* The output judge: wire/rpc_outputs.py's rule (OutputGuard), with the sidecar's figures (the `guard` line).
 * Every place the output check acts: docs/architecture.md, "The output check". */
#ifndef MESH_JUDGE_H
#define MESH_JUDGE_H

#include <stddef.h>

#include "rpc_watch.h"

struct history {                   /* recent healthy RMS of one tensor name (OutputGuard) */
    char name[RW_TENSOR_NAME_BYTES + 1];
    double *rms;
    int cap, count, next;
};

/* One worker's histories, over all its connections (a worker cannot start afresh by reconnecting):
 * cleared when the sidecar says a llama-server session starts (`new-session`: its warm-up's outputs
 * are far from a running session's), as the sidecar's guard is. */
struct judged {
    struct history *items;
    size_t n;
};

struct verdict { const char *kind; double low, high; int count; };

extern int guard_history, guard_min_history;
extern double guard_norm_ratio;
extern double guard_max_rms, guard_max_abs; /* absolute bounds, judged before any history */

void forget_judged(struct judged *j);
/* 1 and `v` filled when `t` is a fault (absolute_outlier: `low` is its largest |value|); 0 when it
 * passes (and joins its name's history). */
int judge_tensor(struct judged *j, const struct rw_measured *t, struct verdict *v);

#endif
