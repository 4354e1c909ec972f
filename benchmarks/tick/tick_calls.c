/* What the calls a tick makes cost on this machine, each timed in a loop, hot (back to
 * back) and cold (after a 10 ms sleep, as a tick runs): printed as JSON, microseconds.
 * Built and run by benchmarks/tick_anatomy.py. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define THREADS 11
#define ROUNDS 300

static void *blocks[THREADS];
static pid_t tids[THREADS];

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* A parked thread with a thread state-sized block of its own, as Python's threads have. */
static void *parked(void *arg) {
    long i = (long)arg;
    blocks[i] = calloc(1, 400);
    __atomic_store_n(&tids[i], (pid_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
    for (;;) pause();
    return NULL;
}

static char buf[1 << 16];
static struct iovec local[THREADS], remote[THREADS];
static int fd_syscall, fd_schedstat, fd_stat, fd_status;
static char big[16384];
/* 128 pages of 4 KiB (no huge pages), one word read from each: a tick's data and code
 * spread over pages, each a TLB miss once the sleep evicted them. */
#define PAGES 128
static volatile char *pages;

static void call(int which) {
    struct timespec ts;
    switch (which) {
    case 0: syscall(SYS_getppid); break;
    case 1: clock_gettime(((~tids[0]) << 3) | 6, &ts); break;
    case 2: clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts); break;
    case 3: pread(fd_syscall, buf, 160, 0); break;
    case 4: pread(fd_schedstat, buf, 80, 0); break;
    case 5: pread(fd_stat, buf, 1024, 0); break;
    case 6: pread(fd_status, buf, 4096, 0); break;
    case 7: {
        struct iovec l = {buf, sizeof big}, r = {big, sizeof big};
        process_vm_readv(getpid(), &l, 1, &r, 1, 0);
        break;
    }
    case 8: process_vm_readv(getpid(), local, THREADS, remote, THREADS, 0); break;
    case 9:
        for (int i = 0; i < THREADS; i++) memcpy(buf + i * 400, blocks[i], 400);
        break;
    case 10: sigaction(11, NULL, (struct sigaction *)buf); break;
    case 11:
        for (int i = 0; i < PAGES; i++) (void)pages[(size_t)i * 3 * 4096 + 64 * (i % 60)];
        break;
    }
}

static const char *names[] = {
    "getppid (a system call's floor)",
    "clock_gettime, another thread's CPU clock",
    "clock_gettime, the process's CPU clock (12 threads)",
    "pread /proc/self/task/TID/syscall",
    "pread .../schedstat",
    "pread .../stat",
    "pread .../status",
    "process_vm_readv, 16 KiB in one range",
    "process_vm_readv, 11 ranges of 400 B on 11 threads' heaps",
    "memcpy of the same 11 ranges",
    "sigaction, a query",
    "a word from each of 128 pages (no system call)",
};

/* CPU the kernel charges a thread for one sleep of `us` and the wake after it. */
static double wake_cost_us(long us) {
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    for (int r = 0; r < ROUNDS / 10; r++) usleep(us);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (ROUNDS / 10) / 1e3;
}

int main(void) {
    size_t span = (size_t)PAGES * 3 * 4096;
    pages = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise((void *)pages, span, MADV_NOHUGEPAGE);
    memset((void *)pages, 1, span);
    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, parked, (void *)i);
    for (int i = 0; i < THREADS; i++)
        while (!__atomic_load_n(&tids[i], __ATOMIC_ACQUIRE)) usleep(1000);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", tids[0]);
    fd_syscall = open(path, O_RDONLY);
    snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", tids[0]);
    fd_schedstat = open(path, O_RDONLY);
    snprintf(path, sizeof path, "/proc/self/task/%d/stat", tids[0]);
    fd_stat = open(path, O_RDONLY);
    snprintf(path, sizeof path, "/proc/self/task/%d/status", tids[0]);
    fd_status = open(path, O_RDONLY);
    for (int i = 0; i < THREADS; i++) {
        local[i] = (struct iovec){buf + i * 400, 400};
        remote[i] = (struct iovec){blocks[i], 400};
    }
    int n = sizeof names / sizeof *names;
    printf("[");
    for (int which = 0; which < n; which++) {
        double hot = 0, cold = 0;
        for (int r = 0; r < ROUNDS; r++) {
            double t0 = now_ns();
            call(which);
            hot += now_ns() - t0;
        }
        for (int r = 0; r < ROUNDS / 10; r++) {
            usleep(10000);
            double t0 = now_ns();
            call(which);
            cold += now_ns() - t0;
        }
        printf("%s{\"call\": \"%s\", \"hot_us\": %.2f, \"cold_us\": %.2f}", which ? ", " : "", names[which],
               hot / ROUNDS / 1e3, cold / (ROUNDS / 10) / 1e3);
    }
    printf(", {\"call\": \"a sleep and its wake, CPU charged (hot: 1 ms, cold: 10 ms)\", \"hot_us\": %.2f, "
           "\"cold_us\": %.2f}]\n",
           wake_cost_us(1000), wake_cost_us(10000));
    return 0;
}
