/*
 * The arrival counts of the collectives that the ranks of one host run through a shared-memory segment
 * (host_collectives.py). Each rank owns one count, on a cache line of its own: how many collectives it has arrived
 * at. A rank writes its share of the segment, then publishes its new count; the others wait until every count has
 * reached theirs, then read. The data is moved by the caller (torch); these two calls give the ordering between the
 * data and the counts, which Python alone cannot.
 */
#include <immintrin.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

/* how long a waiting rank spins before it gives its core away between looks (sched_yield), and how long it yields
 * before it sleeps between looks: a step's collectives come microseconds apart, a worker's wait for the next step
 * may last minutes */
#define SPIN_S 50e-6
#define YIELD_S 5e-3
#define SLEEP_NS 200000
/* and after how long a wait the naps grow longer (an idle worker waiting for the next step: a few hundred wake-ups
 * a second instead of thousands, the first step after idling answered a millisecond or two later) */
#define IDLE_S 0.1
#define IDLE_SLEEP_NS 2000000

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* *count = arrived, after every store this thread made before (non-temporal ones included) */
void kunlun_host_arrive(int64_t *count, int64_t arrived) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(count, arrived, __ATOMIC_RELEASE);
}

/* Wait until counts[r * stride] >= arrived for every r < ranks, for at most wait_s seconds. Returns -1 once all
 * have (every store a rank made before its count is then seen here), else the first rank not there yet. began: when
 * the caller's whole wait began (CLOCK_MONOTONIC seconds, as Python's time.monotonic()), of which this call may be
 * one look of many: how long it has waited so far, not this call, decides between spinning, yielding and napping. */
int64_t kunlun_host_wait(const int64_t *counts, int64_t ranks, int64_t stride, int64_t arrived, double wait_s,
                         double began) {
    const double start = seconds();
    for (int64_t looks = 0;; looks++) {
        int64_t missing = -1;
        for (int64_t r = 0; r < ranks && missing < 0; r++)
            if (__atomic_load_n(counts + r * stride, __ATOMIC_ACQUIRE) < arrived) missing = r;
        if (missing < 0) return -1;
        if (looks % 64 != 63) {
            _mm_pause();
            continue;
        }
        const double now = seconds();
        if (now - start >= wait_s) return missing;
        const double waited = now - began;
        if (waited >= YIELD_S) {
            const struct timespec nap = {0, waited >= IDLE_S ? IDLE_SLEEP_NS : SLEEP_NS};
            nanosleep(&nap, NULL);
        } else if (waited >= SPIN_S) {
            sched_yield();
        }
    }
}
