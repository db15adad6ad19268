/* The output judge: serve/output_guard.py's rule, with the sidecar's figures (the `guard` line). */
#ifndef MESH_JUDGE_H
#define MESH_JUDGE_H

#include <stddef.h>

#include "rpc_watch.h"

struct history {                   /* recent healthy RMS of one tensor name (serve/output_guard.py) */
    char name[RW_TENSOR_NAME_BYTES + 1];
    double *rms;
    int count, next;
};

/* One connection's histories: a llama-server session's own, so a new one (its warm-up's outputs are
 * far from a running session's) starts unjudged, as the sidecar's guard does at each start. */
struct judged {
    struct history *items;
    size_t n;
};


struct verdict { const char *kind; double low, high; int count; };

extern int guard_history, guard_min_history;
extern double guard_norm_ratio;

void forget_judged(struct judged *j);
/* 1 and `v` filled when `t` is a fault; 0 when it passes (and joins its name's history). */
int judge_tensor(struct judged *j, const struct rw_measured *t, struct verdict *v);

#endif
