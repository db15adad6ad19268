/* What every part of the relay shares: the wire constants of the data port, the sizes, the clock. */
#ifndef MESH_RELAY_H
#define MESH_RELAY_H

#include <stdint.h>
#include <time.h>

#define RELAY_VERSION "1"
#define PREAMBLE_MAGIC "MESH"
#define PREAMBLE_VERSION 1
#define PREAMBLE_BYTES 6          /* "MESH" | version u8 | kind u8 */
#define KIND_RPC 1
#define KIND_PROBE 2
#define PROBE_ANSWER 0x01
#define NODE_ID_BYTES 32
#define MAX_CERT_LIST_BYTES 8192   /* a node certificate is under 1 KiB */
#define BUF_BYTES (256 * 1024)    /* per direction; grown only to hold a checked reply whole */
#define CONTROL_LINE_BYTES 8192
#define CONTROL_OUT_MAX_BYTES (4 << 20) /* beyond it, summaries (stats, refused) wait: counted on */
#define CONTROL_OUT_HARD_MAX_BYTES (64 << 20) /* beyond it, the sidecar is not reading: the relay exits */
#define REFUSED_INTERVAL_NS 1000000000ull /* refusals: one summary line a second at most */
#define MAX_MEMBERS 256
#define MAX_ENDPOINTS 256
#define MAX_MEMBER_ADDRESSES 8
#define MAX_QUEUED_FDS 64
#define TICK_NS 100000000ull      /* stats and reply waits, every 100 ms */
#define INBOUND_ID_BASE 0x80000000u

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif
