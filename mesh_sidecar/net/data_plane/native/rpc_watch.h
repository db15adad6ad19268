/* rpc_watch: one llama.cpp RPC connection read as it passes through the data relay.
 *
 * Pure: bytes in, a count of releasable bytes and events out; no sockets, no clock, no
 * allocation per message. It is the native twin of wire/rpc_framing.py (the worker side's
 * REGISTER_PEER rewrite and counters) and wire/rpc_outputs.py (the serving side's output check),
 * and knows no llama.cpp constant of its own: the dialect table and the guard's figures come from
 * the sidecar (see README.md, "What it is told"), so Python names each of them once.
 *
 * Framing, as in ggml-rpc.cpp (little-endian, packed):
 *
 *     client -> server   | cmd u8 | size u64 | payload[size] |
 *     server -> client   | size u64 | payload[size] |          one per command that answers, in order
 *
 * Holding model: each direction's bytes sit in the caller's buffer; the watch is shown every
 * unreleased byte (the same bytes again, plus new ones, until it releases them) and answers how
 * many of them, from the front, may go on. It holds bytes only to rewrite a REGISTER_PEER frame
 * (141 bytes), client bytes sent before the HELLO reply (bounded), a reply's size field until it
 * is read (check mode), and a checked GET_TENSOR reply until it is whole and judged (at most
 * max_checked_bytes).
 *
 * Who may stop the check (check mode): the client (llama-server, our own) may lead it where it
 * cannot follow, and the watch goes RW_OFF. The server (a member's rpc-server) may not: a reply to
 * no command, a first reply too big for a HELLO reply, a HELLO reply fitting no dialect of the
 * request, or a checked reply of another size than asked is RW_EV_VIOLATION, handled as a rejected
 * tensor. Event texts are one line of printable ASCII: wire bytes in them are escaped.
 */
#ifndef MESH_RPC_WATCH_H
#define MESH_RPC_WATCH_H

#include <stddef.h>
#include <stdint.h>

#define RW_HEADER_BYTES 9          /* cmd u8 | size u64 */
#define RW_REPLY_SIZE_BYTES 8      /* size u64 */
#define RW_TENSOR_BYTES 296        /* rpc_tensor */
#define RW_TENSOR_TYPE_OFFSET 8    /* id u64 | type u32 */
#define RW_TENSOR_NAME_OFFSET 228  /* char name[64] */
#define RW_TENSOR_NAME_BYTES 64
#define RW_GET_TENSOR_HEAD_BYTES (RW_TENSOR_BYTES + 8 + 8) /* rpc_tensor | offset u64 | size u64 */
#define RW_REGISTER_ENDPOINT_BYTES 128
#define RW_REGISTER_PAYLOAD_BYTES (4 + RW_REGISTER_ENDPOINT_BYTES)
#define RW_REGISTER_FRAME_BYTES (RW_HEADER_BYTES + RW_REGISTER_PAYLOAD_BYTES)
#define RW_MAX_HELLO_REPLY_BYTES 64
#define RW_MAX_PENDING 256         /* replies owed at once; llama.cpp waits for each, so 1 or 2 */
#define RW_MAX_DIALECTS 8
#define RW_NO_CMD (-1)
#define RW_CMD_LIMIT 256           /* commands are u8 */
#define RW_ALLOC_BUFFER_CMD 0
#define RW_SET_TENSOR_CMD 6
#define RW_GET_TENSOR_CMD 8
#define RW_HELLO_CMD 14
#define RW_GGML_TYPE_F32 0
#define RW_GGML_TYPE_F16 1

/* One row of the sidecar's dialect table (wire/rpc_framing.py DIALECTS, rpc_outputs.py's sets). */
struct rw_dialect {
    char name[32];
    int major, min_minor, max_minor;   /* max_minor -1: every later minor */
    uint64_t hello_request_bytes, hello_reply_bytes;
    int required_flags;                /* bits of the reply's 4th byte */
    int register_peer_cmd;             /* RW_NO_CMD: none */
    int push_tensor_cmd;               /* RW_NO_CMD: none */
    int last_cmd;                      /* RW_NO_CMD: replies cannot be paired (the check goes off) */
    uint8_t no_reply[RW_CMD_LIMIT];    /* 1: the command sends no reply */
    uint8_t async_push[RW_CMD_LIMIT];  /* 1: b2b's pushes: activation bytes, no reply */
};

struct rw_rules {
    struct rw_dialect dialects[RW_MAX_DIALECTS]; /* first match wins */
    int n_dialects;
    uint64_t max_frame_bytes;        /* a bigger client frame closes the connection */
    uint64_t max_held_before_reply;  /* client bytes held before the HELLO reply */
    uint64_t max_checked_bytes;      /* bigger float replies pass unchecked */
};

/* A float tensor measured whole, as rpc_outputs.TensorMeasured. */
struct rw_measured {
    char name[RW_TENSOR_NAME_BYTES + 1];
    uint64_t values;
    int finite;
    double rms;     /* meaningful when finite */
    double max_abs; /* the largest |value|, meaningful when finite */
};

/* What the owner of a watch decides about a measured tensor: 0 pass, else a fault. */
typedef int (*rw_judge_fn)(void *ctx, const struct rw_measured *tensor);
/* REGISTER_PEER's peer index -> the endpoint on this machine, or NULL. */
typedef const char *(*rw_resolve_fn)(void *ctx, uint32_t peer_index);

enum rw_phase { RW_HELLO, RW_FRAMES, RW_OFF, RW_REJECTED, RW_BROKEN };

enum rw_event_kind {
    RW_EV_NONE,
    RW_EV_DIALECT,     /* text: "<name> <major.minor.patch>" */
    RW_EV_OFF,         /* text: why the watch stopped reading (bytes pass untouched) */
    RW_EV_REWRITTEN,   /* text: "<peer> <original> <rewritten>"; original: the member's bytes, escaped
                          as rpc_framing.printable_word does ("-": empty) */
    RW_EV_UNRESOLVED,  /* text: "<peer>": the endpoint was cleared */
    RW_EV_REJECTED,    /* a checked reply failed its judge; `rejected` says which; text: its name, escaped */
    RW_EV_BROKEN,      /* text: a frame over max_frame_bytes or too much sent before the HELLO reply */
    RW_EV_VIOLATION,   /* text: "<reason> <details...>": the worker broke the protocol (check mode);
                          reason: unsolicited-reply, wrong-reply-size, unknown-dialect or bad-hello-reply.
                          The watch is RW_REJECTED after it, as for a rejected tensor */
    RW_EV_DROPPED,     /* text: "<count>": events lost to a full queue since the last one taken; comes
                          after the events kept, so the log says some are missing */
};

struct rw_expected {
    int checked;                    /* a float reply to measure */
    int hello;
    int ggml_type;
    uint64_t size;
    char name[RW_TENSOR_NAME_BYTES + 1];
};

struct rpc_watch {
    const struct rw_rules *rules;
    int check;    /* hold and judge float GET_TENSOR replies (the serving side) */
    int rewrite;  /* rewrite REGISTER_PEER endpoints (the worker side) */
    rw_judge_fn judge;
    rw_resolve_fn resolve;
    void *ctx;

    enum rw_phase phase;
    const struct rw_dialect *dialect;
    int64_t hello_request_bytes; /* -1 until HELLO is seen */

    /* client -> server */
    uint64_t up_parsed;          /* of the unreleased bytes, how many were read already */
    uint64_t up_hold;            /* where a hold of them begins; UINT64_MAX: none */
    uint8_t header[RW_HEADER_BYTES];
    size_t header_len;
    uint64_t skip;               /* payload bytes of the current command still to pass */
    uint8_t tap[RW_GET_TENSOR_HEAD_BYTES + 4 + RW_TENSOR_BYTES];
    size_t tap_len, tap_need;
    int tap_cmd;                 /* RW_NO_CMD: no payload is being tapped */
    uint64_t tap_frame_bytes;
    int registering;             /* a REGISTER_PEER frame is being held whole */
    struct rw_expected pending[RW_MAX_PENDING];
    size_t pending_head, pending_count;

    /* server -> client */
    uint64_t down_parsed;
    uint64_t down_hold;
    uint8_t reply_header[RW_REPLY_SIZE_BYTES];
    size_t reply_header_len;
    uint64_t reply_left;
    struct rw_expected reply;    /* what the reply being read answers */
    int holding;                 /* the reply being read is held from its first byte */
    uint8_t hello_reply[RW_MAX_HELLO_REPLY_BYTES];
    size_t hello_reply_len;

    /* counters, for the sidecar */
    uint64_t frames;
    uint64_t activation_bytes;   /* layer outputs moved (either way), as rpc_framing.py counts them */
    uint64_t allocated_bytes;    /* ALLOC_BUFFER sizes asked for */
    uint64_t checked;

    /* events not yet taken, oldest first (events are rare: a short queue of texts is enough; beyond it
     * the newest are dropped and counted, and an RW_EV_DROPPED follows the ones kept) */
    enum rw_event_kind events[16];
    char event_text[16][192];
    struct rw_measured rejected;
    size_t events_head, events_count;
    uint64_t events_dropped;
    char dropped_text[24];
};

void rw_init(struct rpc_watch *w, const struct rw_rules *rules, int check, int rewrite,
             rw_judge_fn judge, rw_resolve_fn resolve, void *ctx);
/* Client bytes: `data` holds every unreleased byte of that direction, `len` of them (those shown
 * before first). May rewrite bytes in place. Returns how many bytes from the front may go on;
 * the caller must pass them on and never show them again. */
uint64_t rw_from_client(struct rpc_watch *w, uint8_t *data, uint64_t len);
/* Server bytes, the same way. */
uint64_t rw_from_server(struct rpc_watch *w, uint8_t *data, uint64_t len);
/* Whether the server owes the client a reply for what was sent so far (reply-wait timing). */
int rw_replies_owed(const struct rpc_watch *w);
/* The oldest event, or RW_EV_NONE; `text` gets its text (valid until the next call). */
enum rw_event_kind rw_next_event(struct rpc_watch *w, const char **text);

/* All values finite, their RMS (in double) and largest |value|, of a float tensor's raw little-endian
 * bytes, in one pass. */
void rw_measure(struct rw_measured *out, const uint8_t *data, uint64_t bytes, int ggml_type);

#endif
