/*
 * mesh-tensor-cache: fill and check llama.cpp rpc-server's weight cache (`rpc-server -c`).
 *
 * rpc-server names each cached tensor by the 64-bit FNV-1a hash of its bytes,
 * written as 16 lowercase hex digits, and trusts the file it finds under that
 * name. FNV-1a is a byte-serial loop: too slow in Python for gigabytes, hence
 * this small program, built beside llama.cpp.
 *
 *   mesh-tensor-cache seed GGUF CACHE_DIR OFFSET:SIZE ...
 *       copy each byte range of GGUF into CACHE_DIR/<hash>, written to a
 *       temporary name and renamed, so a reader never sees half a file;
 *       prints "<hash> <size>" per range.
 *   mesh-tensor-cache verify CACHE_DIR NAME ...
 *       hash each CACHE_DIR/NAME; prints "ok NAME" or "bad NAME" (a file torn
 *       by a crash mid-write, or altered); the caller removes bad ones.
 *
 * Exit status: 0 on success, 1 on any I/O error (with a message on stderr).
 */
#define _FILE_OFFSET_BITS 64
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FNV_OFFSET 0xcbf29ce484222325ULL /* llama.cpp ggml-rpc.cpp fnv_hash() */
#define FNV_PRIME 0x100000001b3ULL
#define CHUNK (4u << 20)

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

static int seed(const char *gguf, const char *dir, int n, char **ranges, unsigned char *buf) {
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
        uint64_t hash = FNV_OFFSET;
        for (unsigned long long left = size; left > 0;) {
            size_t want = left < CHUNK ? (size_t)left : CHUNK;
            if (fread(buf, 1, want, in) != want) return fail("short read from", gguf);
            hash = fnv1a(hash, buf, want);
            if (fwrite(buf, 1, want, out) != want) return fail("cannot write", tmp);
            left -= want;
        }
        if (fclose(out) != 0) return fail("cannot write", tmp);
        snprintf(final, sizeof final, "%s/%016" PRIx64, dir, hash);
        if (rename(tmp, final) != 0) return fail("cannot rename to", final);
        printf("%016" PRIx64 " %llu\n", hash, size);
        fflush(stdout);
    }
    fclose(in);
    return 0;
}

static int verify(const char *dir, int n, char **names, unsigned char *buf) {
    char path[4096];
    for (int i = 0; i < n; ++i) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        FILE *in = fopen(path, "rb");
        if (!in) return fail("cannot open", path);
        uint64_t hash = FNV_OFFSET;
        size_t got;
        while ((got = fread(buf, 1, CHUNK, in)) > 0) hash = fnv1a(hash, buf, got);
        int broken = ferror(in);
        fclose(in);
        if (broken) return fail("cannot read", path);
        char expected[17];
        snprintf(expected, sizeof expected, "%016" PRIx64, hash);
        printf("%s %s\n", strcmp(expected, names[i]) == 0 ? "ok" : "bad", names[i]);
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv) {
    unsigned char *buf = malloc(CHUNK);
    if (!buf) return 1;
    if (argc >= 4 && strcmp(argv[1], "seed") == 0) return seed(argv[2], argv[3], argc - 4, argv + 4, buf);
    if (argc >= 3 && strcmp(argv[1], "verify") == 0) return verify(argv[2], argc - 3, argv + 3, buf);
    fprintf(stderr, "usage: mesh-tensor-cache seed GGUF CACHE_DIR OFFSET:SIZE ...\n"
                    "       mesh-tensor-cache verify CACHE_DIR NAME ...\n");
    return 2;
}
