/* --replay: the watch and the judge over lines on stdin, for tests (README.md, "Testing"). */
#ifndef MESH_REPLAY_H
#define MESH_REPLAY_H

/* Control lines configure; "watch CHECK REWRITE NODE" starts a connection; "c HEX" and "s HEX" are
 * client and server bytes; it prints "up HEX" and "down HEX" for what the watch released. Returns the
 * exit status. */
int replay(void);

#endif
