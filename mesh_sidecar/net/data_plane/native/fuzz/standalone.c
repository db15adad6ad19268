/* A driver for the relay's libFuzzer harnesses without libFuzzer, so the test suite runs them under
 * gcc's sanitizers on machines without clang (tests/integration/test_relay_fuzz.py). Not coverage
 * guided: every file of a seed corpus as it is, then ITERATIONS inputs made by mutating them (bytes
 * flipped, inserted, removed, a tail cut, two seeds spliced), each passed to LLVMFuzzerTestOneInput.
 *
 *   cc -fsanitize=address,undefined fuzz/standalone.c fuzz_control.c <relay parts> -lssl -lcrypto -lm
 *   ./a.out CORPUS_DIR ITERATIONS SEED      prints "ok N" after N inputs; a fault aborts
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SEEDS 64
#define MAX_INPUT_BYTES 4096

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint64_t state;

static uint64_t next_random(void) { /* xorshift64: the same inputs for the same seed */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static uint8_t seeds[MAX_SEEDS][MAX_INPUT_BYTES];
static size_t seed_bytes[MAX_SEEDS], n_seeds;

static void load_corpus(const char *folder) {
    DIR *dir = opendir(folder);
    if (!dir) {
        perror(folder);
        exit(2);
    }
    char path[4096];
    for (struct dirent *e; (e = readdir(dir)) && n_seeds < MAX_SEEDS;) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", folder, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        seed_bytes[n_seeds] = fread(seeds[n_seeds], 1, MAX_INPUT_BYTES, f);
        fclose(f);
        n_seeds++;
    }
    closedir(dir);
}

static size_t mutate(uint8_t *out) {
    size_t n = seed_bytes[next_random() % n_seeds];
    memcpy(out, seeds[next_random() % n_seeds], MAX_INPUT_BYTES);
    for (int edits = 1 + (int)(next_random() % 8); edits > 0; edits--) {
        size_t at = n ? next_random() % n : 0;
        switch (next_random() % 5) {
        case 0: if (n) out[at] ^= (uint8_t)(1u << (next_random() % 8)); break;
        case 1: if (n) out[at] = (uint8_t)next_random(); break;
        case 2: /* insert a byte */
            if (n < MAX_INPUT_BYTES) {
                memmove(out + at + 1, out + at, n - at);
                out[at] = (uint8_t)next_random();
                n++;
            }
            break;
        case 3: /* remove a byte */
            if (n) {
                memmove(out + at, out + at + 1, n - at - 1);
                n--;
            }
            break;
        default: { /* splice: another seed's tail from here */
            size_t other = next_random() % n_seeds, from = seed_bytes[other] ? next_random() % seed_bytes[other] : 0;
            size_t take = seed_bytes[other] - from;
            if (at + take > MAX_INPUT_BYTES) take = MAX_INPUT_BYTES - at;
            memcpy(out + at, seeds[other] + from, take);
            n = at + take;
        }
        }
    }
    return n;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s CORPUS_DIR ITERATIONS SEED\n", argv[0]);
        return 2;
    }
    load_corpus(argv[1]);
    if (!n_seeds) {
        fprintf(stderr, "no seeds in %s\n", argv[1]);
        return 2;
    }
    long iterations = atol(argv[2]);
    state = strtoull(argv[3], NULL, 10) | 1;
    static uint8_t input[MAX_INPUT_BYTES];
    for (size_t i = 0; i < n_seeds; i++) {
        memcpy(input, seeds[i], seed_bytes[i]); /* a copy of its own size, so overreads are caught */
        uint8_t *exact = malloc(seed_bytes[i] ? seed_bytes[i] : 1);
        memcpy(exact, input, seed_bytes[i]);
        LLVMFuzzerTestOneInput(exact, seed_bytes[i]);
        free(exact);
    }
    for (long i = 0; i < iterations; i++) {
        size_t n = mutate(input);
        uint8_t *exact = malloc(n ? n : 1);
        memcpy(exact, input, n);
        LLVMFuzzerTestOneInput(exact, n);
        free(exact);
    }
    printf("ok %ld\n", (long)n_seeds + iterations);
    return 0;
}
