/* TLS 1.3 with node keys: our context, the handshake, the key the peer showed. */
#ifndef MESH_TLS_H
#define MESH_TLS_H

#include <openssl/ssl.h>
#include <stddef.h>
#include <stdint.h>

#include "pipe.h"
#include "relay.h"

extern SSL_CTX *tls;                 /* NULL until a usable `identity` line */
extern uint8_t own_id[NODE_ID_BYTES];

/* A context presenting the node's certificate and key (DER), or NULL. */
SSL_CTX *make_tls(const uint8_t *cert_der, size_t cert_len, const uint8_t *key_der, size_t key_len);
/* The Ed25519 key the peer's certificate carries: its node id; -1 if none. */
int peer_node_id(SSL *ssl, uint8_t out[NODE_ID_BYTES]);
/* The handshake went on; 1 done, 0 not yet, -1 failed. */
int step_handshake(struct side *s);

#endif
