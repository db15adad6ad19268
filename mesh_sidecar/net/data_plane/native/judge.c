/* The output judge (judge.h). Pure: no I/O, no clock. */
#include "judge.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int guard_history = 64, guard_min_history = 8;
double guard_norm_ratio = 64.0;
double guard_max_rms = 1e6, guard_max_abs = 1e8;

void forget_judged(struct judged *j) {
    for (size_t i = 0; i < j->n; i++) free(j->items[i].rms);
    free(j->items);
    memset(j, 0, sizeof *j);
}

int judge_tensor(struct judged *j, const struct rw_measured *t, struct verdict *v) {
    if (!t->finite) {
        *v = (struct verdict){"non_finite", 0, 0, 0};
        return 1;
    }
    if (t->rms > guard_max_rms || t->max_abs > guard_max_abs) {
        *v = (struct verdict){"absolute_outlier", t->max_abs, 0, 0};
        return 1;
    }
    struct history *h = NULL;
    for (size_t i = 0; i < j->n; i++)
        if (!strcmp(j->items[i].name, t->name)) h = &j->items[i];
    if (!h) {
        struct history *grown = realloc(j->items, (j->n + 1) * sizeof *grown);
        if (!grown) abort();
        j->items = grown;
        h = &j->items[j->n++];
        memset(h, 0, sizeof *h);
        snprintf(h->name, sizeof h->name, "%s", t->name);
        h->cap = guard_history;
        h->rms = calloc((size_t)h->cap, sizeof *h->rms);
        if (!h->rms) abort();
    }
    if (h->count >= guard_min_history) {
        double low = h->rms[0], high = h->rms[0];
        for (int i = 1; i < h->count; i++) {
            if (h->rms[i] < low) low = h->rms[i];
            if (h->rms[i] > high) high = h->rms[i];
        }
        if (t->rms > high * guard_norm_ratio || t->rms < low / guard_norm_ratio) {
            *v = (struct verdict){"norm_outlier", low, high, h->count};
            return 1;
        }
    }
    h->rms[h->next] = t->rms;
    h->next = (h->next + 1) % h->cap;
    if (h->count < h->cap) h->count++;
    return 0;
}
