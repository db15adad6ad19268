/*
 * mesh-tensor-cache: fill llama.cpp rpc-server's weight cache (`rpc-server -c`) from a model file.
 *
 * rpc-server names each cached tensor by the 64-bit FNV-1a hash of its bytes,
 * written as 16 lowercase hex digits, and trusts the file it finds under that
 * name. FNV-1a is a byte-serial loop: too slow in Python for gigabytes, hence
 * this small program, built beside llama.cpp. FNV-1a is no proof of content
 * (a second preimage is easy to make), so each file's SHA-256 is taken in the
 * same pass: the sidecar records it, and checks files against it before use.
 *
 *   mesh-tensor-cache seed GGUF CACHE_DIR OFFSET:SIZE ...
 *       copy each byte range of GGUF into CACHE_DIR/<fnv>, written to a
 *       temporary name and renamed, so a reader never sees half a file;
 *       prints "<fnv> <size> <sha256>" per range.
 *
 * Exit status: 0 on success, 1 on any I/O error (with a message on stderr).
 */
#define _FILE_OFFSET_BITS 64
#include <errno.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FNV_OFFSET 0xcbf29ce484222325ULL /* llama.cpp ggml-rpc.cpp fnv_hash() */
#define FNV_PRIME 0x100000001b3ULL
#define CHUNK (4u << 20)
#define SHA256_BYTES 32

static uint64_t fnv1a(uint64_t hash, const unsigned char *data, size_t len) {
    for (size_t i = 0; i < len; ++i) {
        hash ^= data[i];
        hash *= FNV_PRIME;
    }
    return hash;
}

static int fail(const char *what, const char *path) {
    fprintf(stderr, "mesh-tensor-cache: %s %s: %s\n", what, path, strerror(errno));
    return 1;
}

static int sha256_failed(void) {
    fprintf(stderr, "mesh-tensor-cache: OpenSSL's SHA-256 failed\n");
    return 1;
}

static int seed(const char *gguf, const char *dir, int n, char **ranges, unsigned char *buf, EVP_MD_CTX *sha) {
    FILE *in = fopen(gguf, "rb");
    if (!in) return fail("cannot open", gguf);
    char tmp[4096], final[4096];
    snprintf(tmp, sizeof tmp, "%s/.seeding.%ld", dir, (long)getpid());
    for (int r = 0; r < n; ++r) {
        unsigned long long offset, size;
        if (sscanf(ranges[r], "%llu:%llu", &offset, &size) != 2) {
            fprintf(stderr, "mesh-tensor-cache: bad range %s (want OFFSET:SIZE)\n", ranges[r]);
            return 1;
        }
        if (fseeko(in, (off_t)offset, SEEK_SET) != 0) return fail("cannot seek in", gguf);
        FILE *out = fopen(tmp, "wb");
        if (!out) return fail("cannot create", tmp);
        if (EVP_DigestInit_ex(sha, EVP_sha256(), NULL) != 1) return sha256_failed();
        uint64_t hash = FNV_OFFSET;
        for (unsigned long long left = size; left > 0;) {
            size_t want = left < CHUNK ? (size_t)left : CHUNK;
            if (fread(buf, 1, want, in) != want) return fail("short read from", gguf);
            hash = fnv1a(hash, buf, want);
            if (EVP_DigestUpdate(sha, buf, want) != 1) return sha256_failed();
            if (fwrite(buf, 1, want, out) != want) return fail("cannot write", tmp);
            left -= want;
        }
        if (fclose(out) != 0) return fail("cannot write", tmp);
        unsigned char digest[SHA256_BYTES];
        if (EVP_DigestFinal_ex(sha, digest, NULL) != 1) return sha256_failed();
        snprintf(final, sizeof final, "%s/%016" PRIx64, dir, hash);
        if (rename(tmp, final) != 0) return fail("cannot rename to", final);
        printf("%016" PRIx64 " %llu ", hash, size);
        for (int i = 0; i < SHA256_BYTES; ++i) printf("%02x", digest[i]);
        printf("\n");
        fflush(stdout);
    }
    fclose(in);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4 || strcmp(argv[1], "seed") != 0) {
        fprintf(stderr, "usage: mesh-tensor-cache seed GGUF CACHE_DIR OFFSET:SIZE ...\n");
        return 2;
    }
    unsigned char *buf = malloc(CHUNK);
    EVP_MD_CTX *sha = EVP_MD_CTX_new();
    if (!buf || !sha) return 1;
    return seed(argv[2], argv[3], argc - 4, argv + 4, buf, sha);
}
