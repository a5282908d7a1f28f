/* Single-copy reads without the library: READERS processes each read a 64
 * MiB buffer of the root's with process_vm_readv in CHUNK-byte reads (what
 * Open MPI's CMA does for a large broadcast; `CONSORT_SHM_CMA=1`). The root
 * allocates the buffer after the readers are forked: a buffer the readers
 * inherited would be shared copy-on-write, and the kernel copies such
 * pages when a reader pins them (a test built that way measured 4-5 GB/s).
 *
 *   cc -O2 -o cma cma.c && ./cma 67108864 2      (HUGE=0: 4 KiB pages)
 *
 * Prints each reader's GB/s over 10 reads of the whole buffer. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N ((size_t)64 << 20)
#define REPS 10

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *buffer(size_t n) {
    void *p;
    if (posix_memalign(&p, 2 << 20, n)) exit(1);
    const char *h = getenv("HUGE");
    madvise(p, n, h && h[0] == '0' ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
    memset(p, 1, n);
    return p;
}

int main(int argc, char **argv) {
    size_t chunk = argc > 1 ? strtoul(argv[1], 0, 10) : N;
    int readers = argc > 2 ? atoi(argv[2]) : 2;
    if (chunk == 0 || N % chunk || readers < 1 || readers > 64) return 2;
    int pipefd[2];
    if (pipe(pipefd)) return 1;
    pid_t root = getpid();
    double *gbs = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    for (int r = 0; r < readers; r++) {
        if (fork() == 0) {
            char *dst = buffer(N), *src;
            if (read(pipefd[0], &src, sizeof src) != sizeof src) exit(1);
            double t0 = now();
            for (int rep = 0; rep < REPS; rep++)
                for (size_t o = 0; o < N; o += chunk) {
                    struct iovec l = {dst + o, chunk}, rm = {src + o, chunk};
                    if (process_vm_readv(root, &l, 1, &rm, 1, 0) != (ssize_t)chunk) {
                        perror("process_vm_readv");
                        exit(1);
                    }
                }
            gbs[r] = N * (double)REPS / (now() - t0) / 1e9;
            exit(0);
        }
    }
    char *src = buffer(N);
    for (int r = 0; r < readers; r++)
        if (write(pipefd[1], &src, sizeof src) != sizeof src) return 1;
    for (int r = 0; r < readers; r++) wait(0);
    printf("cma: chunk %zu readers %d:", chunk, readers);
    for (int r = 0; r < readers; r++) printf(" %.2f", gbs[r]);
    printf(" GB/s\n");
    return 0;
}
