/* The same-host broadcast's stage without the library: what the hardware
 * allows one root and READERS readers for a 64 MiB broadcast in 256 KiB
 * segments through a SLOTS-segment shared region (the mesh's stage: the
 * root copies each segment in, every reader copies it out with streaming
 * stores, flags in shared memory, waiting by sched_yield).
 *
 *   cc -O2 -mavx512f -o stage stage.c && ./stage 16 2
 *
 * Prints the broadcast's algbw (GB/s) over 20 iterations. Compare with
 * `consort bench --world-size 3 --ops broadcast --sizes 64M` and cma.c in
 * the same minutes (BENCHMARKS.md, "The 3-rank broadcast's ceiling"). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N ((size_t)64 << 20)
#define SEG ((size_t)256 << 10)
#define REPS 20

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Memory advised to huge pages and touched, as numpy's arrays and
 * `consort bench`'s buffers are. */
static char *huge(size_t n) {
    void *p;
    if (posix_memalign(&p, 2 << 20, n)) exit(1);
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 1, n);
    return p;
}

static void stream_copy(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64)
        _mm512_stream_si512((__m512i *)(d + i), _mm512_loadu_si512(s + i));
    _mm_sfence();
}

struct flags {
    _Atomic long staged;          /* segments the root has put */
    char pad[56];
    _Atomic long taken[8][8];     /* per reader, one cache line each */
};

int main(int argc, char **argv) {
    int slots = argc > 1 ? atoi(argv[1]) : 16, readers = argc > 2 ? atoi(argv[2]) : 2;
    if (slots < 1 || readers < 1 || readers > 8) return 2;
    long segs = N / SEG;
    char *stage = mmap(0, slots * SEG, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    struct flags *f = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(stage, 0, slots * SEG);
    for (int r = 0; r < readers; r++) {
        if (fork() == 0) {
            char *dst = huge(N);
            long k = 0;
            for (int rep = 0; rep < REPS; rep++)
                for (long s = 0; s < segs; s++, k++) {
                    while (atomic_load_explicit(&f->staged, memory_order_acquire) <= k) sched_yield();
                    stream_copy(dst + s * SEG, stage + (k % slots) * SEG, SEG);
                    atomic_store_explicit(&f->taken[r][0], k + 1, memory_order_release);
                }
            exit(0);
        }
    }
    char *src = huge(N);
    long k = 0;
    double t0 = now();
    for (int rep = 0; rep < REPS; rep++) {
        for (long s = 0; s < segs; s++, k++) {
            for (int r = 0; r < readers; r++)
                while (atomic_load_explicit(&f->taken[r][0], memory_order_acquire) < k - slots + 1)
                    sched_yield();
            memcpy(stage + (k % slots) * SEG, src + s * SEG, SEG);
            atomic_store_explicit(&f->staged, k + 1, memory_order_release);
        }
        for (int r = 0; r < readers; r++)
            while (atomic_load_explicit(&f->taken[r][0], memory_order_acquire) < k) sched_yield();
    }
    double t = now() - t0;
    for (int r = 0; r < readers; r++) wait(0);
    printf("stage: slots %d readers %d: %.2f GB/s\n", slots, readers, N * (double)REPS / t / 1e9);
    return 0;
}
