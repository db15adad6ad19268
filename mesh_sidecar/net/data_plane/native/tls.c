/* TLS (tls.h): OpenSSL's documented API, nothing hand-rolled. */
#include "tls.h"

#include <openssl/err.h>
#include <openssl/x509.h>
#include <sys/epoll.h>

SSL_CTX *tls;
uint8_t own_id[NODE_ID_BYTES];

/* Node certificates are self-signed: no chain is built and no signature over a certificate checked (its
 * key proves itself in the handshake's CertificateVerify). Only an Ed25519 key is taken, so a stranger's
 * certificate (an RSA key of any size) costs no more than reading it; which key it is, is checked
 * against the members after the handshake. */
static int ed25519_certificate(X509_STORE_CTX *store, void *arg) {
    (void)arg;
    X509 *cert = X509_STORE_CTX_get0_cert(store);
    EVP_PKEY *key = cert ? X509_get0_pubkey(cert) : NULL;
    return key && EVP_PKEY_id(key) == EVP_PKEY_ED25519;
}

int peer_node_id(SSL *ssl, uint8_t out[NODE_ID_BYTES]) {
    X509 *cert = SSL_get1_peer_certificate(ssl);
    if (!cert) return -1;
    EVP_PKEY *key = X509_get0_pubkey(cert);
    size_t len = NODE_ID_BYTES;
    int ok = key && EVP_PKEY_id(key) == EVP_PKEY_ED25519 && EVP_PKEY_get_raw_public_key(key, out, &len) == 1
             && len == NODE_ID_BYTES;
    X509_free(cert);
    return ok ? 0 : -1;
}

SSL_CTX *make_tls(const uint8_t *cert_der, size_t cert_len, const uint8_t *key_der, size_t key_len) {
    SSL_CTX *ctx = SSL_CTX_new(TLS_method());
    if (!ctx) return NULL;
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    SSL_CTX_set_cert_verify_callback(ctx, ed25519_certificate, NULL);
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    SSL_CTX_set_max_cert_list(ctx, MAX_CERT_LIST_BYTES);
    SSL_CTX_set_read_ahead(ctx, 1); /* one read() per record, not two (header, then body) */
    SSL_CTX_set_default_read_buffer_len(ctx, BUF_BYTES); /* ...and many records per read() in bulk */
    const uint8_t *c = cert_der, *k = key_der;
    X509 *cert = d2i_X509(NULL, &c, (long)cert_len);
    EVP_PKEY *key = d2i_AutoPrivateKey(NULL, &k, (long)key_len);
    /* Only what node keys use: TLS 1.3, X25519, Ed25519; a peer offering anything else is refused
     * before any costly step. */
    int ok = SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) == 1 && SSL_CTX_set_num_tickets(ctx, 0) == 1
             && SSL_CTX_set1_groups_list(ctx, "X25519") == 1 && SSL_CTX_set1_sigalgs_list(ctx, "ed25519") == 1
             && cert && key && SSL_CTX_use_certificate(ctx, cert) == 1 && SSL_CTX_use_PrivateKey(ctx, key) == 1
             && SSL_CTX_check_private_key(ctx) == 1;
    size_t len = NODE_ID_BYTES;
    ok = ok && EVP_PKEY_get_raw_public_key(key, own_id, &len) == 1;
    X509_free(cert);
    EVP_PKEY_free(key);
    if (!ok) {
        SSL_CTX_free(ctx);
        return NULL;
    }
    return ctx;
}

int step_handshake(struct side *s) {
    int r = SSL_do_handshake(s->ssl);
    if (r == 1) return 1;
    int err = SSL_get_error(s->ssl, r);
    if (err == SSL_ERROR_WANT_READ) set_events(s, EPOLLIN);
    else if (err == SSL_ERROR_WANT_WRITE) set_events(s, EPOLLOUT);
    else {
        ERR_clear_error();
        return -1;
    }
    return 0;
}
