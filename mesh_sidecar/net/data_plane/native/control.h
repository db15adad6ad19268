/* The control channel to the sidecar (net/data_plane/control_lines.py): report lines out, command lines and the
 * sockets passed beside them in. */
#ifndef MESH_CONTROL_H
#define MESH_CONTROL_H

#include <stddef.h>

extern int control_fd;
extern size_t control_out_len; /* bytes queued for the sidecar, not yet written */

/* Write what is queued, as far as the socket takes it now. */
void flush_control(void);
/* One report line (printf-style, no newline) of a state the sidecar must know (opened, closed, probe,
 * rejected...), queued and written when the socket takes it; never dropped. */
void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A summary line (stats, refused): 0 when the sidecar is too far behind to take it now; the caller
 * keeps what it counted for the next one. */
int report_summary(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Read what the sidecar sent, running control_line on each whole line. Returns 0 when it has gone. */
int read_control(void);
/* The oldest socket the sidecar passed that no line took yet, or -1. */
int take_queued_fd(void);

#endif
