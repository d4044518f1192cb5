/*
 * The arrival counts of the collectives that the ranks of one host run through a shared-memory segment
 * (host_collectives.py). Each rank owns one count, on a cache line of its own: how many collectives it has arrived
 * at. A rank writes its share of the segment, then publishes its new count; the others wait until every count has
 * reached theirs, then read. The data is moved by the caller (torch); these two calls give the ordering between the
 * data and the counts, which Python alone cannot.
 */
#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

/* Wait until counts[r * 8] >= arrived for every r < ranks (a count on each cache line), for at most wait_s seconds.
 * Returns -1 once all have (every store a rank made before its count is then seen here), else the first rank not
 * there yet. began: when the caller's whole wait began: how long it has waited so far, not this call, decides
 * between spinning, yielding and napping. */
static int64_t wait_counts(const int64_t *counts, int64_t ranks, int64_t arrived, double wait_s, double began) {
    const double start = seconds();
    for (int64_t looks = 0;; looks++) {
        int64_t missing = -1;
        for (int64_t r = 0; r < ranks && missing < 0; r++)
            if (__atomic_load_n(counts + r * 8, __ATOMIC_ACQUIRE) < arrived) missing = r;
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

/* Whether process pid still runs: /proc/<pid>/stat exists and its state is not zombie or dead */
static int process_alive(int64_t pid) {
    char path[48], stat[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    const int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    const ssize_t got = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (got <= 0) return 0;
    stat[got] = 0;
    const char *state = strrchr(stat, ')');
    if (!state) return 1;
    while (*++state == ' ') {}
    return *state != 'Z' && *state != 'X';
}

/* Wait for the counts of `ranks` ranks (a cache line apart, from counts on) to reach arrived, looking at the
 * waited-for rank's process (pids: theirs, in the same order) every 20 ms. began: when the whole wait began
 * (CLOCK_MONOTONIC seconds, as Python's time.monotonic()). Returns 0 once all have; 1 + r where rank r did not
 * arrive within timeout_s of began; 1 + ranks + r where rank r's process has ended; -1 when look_s has passed in
 * this call with nothing decided (a Python caller looks again, handling its signals in between). */
int64_t kunlun_host_await(const int64_t *counts, int64_t ranks, int64_t arrived, const int64_t *pids,
                          double timeout_s, double began, double look_s) {
    const double start = seconds();
    for (;;) {
        const int64_t missing = wait_counts(counts, ranks, arrived, 0.02, began);
        if (missing < 0) return 0;
        if (!process_alive(pids[missing])) return 1 + ranks + missing;
        const double now = seconds();
        if (now - began >= timeout_s) return 1 + missing;
        if (now - start >= look_s) return -1;
    }
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch converts (a NaN becomes the quiet NaN 0x7FC0) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Arrive at collective `number` saying which one it is (`tag`, one word a set of slots beside this rank's count),
 * wait for every rank, and check that each is at the same one. Returns 0, what kunlun_host_await says went wrong,
 * or 1 + 2 * ranks + r where rank r is at another collective. Shared by the native collectives. */
static int meet(int64_t *counts, int64_t rank, int64_t ranks, int64_t number, int64_t tag, const int64_t *pids,
                float timeout_s) {
    __atomic_store_n(counts + rank * 8 + 1 + number % 2, tag, __ATOMIC_RELAXED);
    kunlun_host_arrive(counts + rank * 8, number);
    const int status = (int)kunlun_host_await(counts, ranks, number, pids, timeout_s, seconds(), timeout_s);
    if (status) return status;
    for (int64_t r = 0; r < ranks; r++)
        if (__atomic_load_n(counts + r * 8 + 1 + number % 2, __ATOMIC_RELAXED) != tag)
            return (int)(1 + 2 * ranks + r);
    return 0;
}

/*
 * One all-reduce of the n values at data among the ranks of the segment, as host_collectives.py's own all_reduce
 * makes it, to the bit: counts (a count on a cache line a rank), slots (two sets of `ranks` slots of slot_bytes),
 * pids (each rank's process). dtype 0: float32, summed in float32; dtype 1: bfloat16, widened to float32 in the
 * slots and rounded once (wide = 1), or rounded after each add as torch adds two bfloat16 tensors (wide = 0). Every
 * rank adds the slots up in rank order. The collective's number is this rank's count + 1, so that a step captured
 * and replayed (cpu_capture.py) needs no value from Python. Beside its count each rank says which collective it is
 * at (one word a set of slots); ranks at different ones fail. Returns 0, what kunlun_host_await says went wrong, or
 * 1 + 2 * ranks + r where rank r is at another collective.
 */
int kunlun_host_all_reduce(int64_t *counts, int64_t rank, int64_t ranks, uint8_t *slots, int64_t slot_bytes,
                           void *data, int64_t n, int64_t dtype, int64_t wide, const int64_t *pids, float timeout_s) {
    const int64_t in_slot = dtype == 0 || wide ? 4 : 2;
    const int64_t per_piece = slot_bytes / in_slot;
    for (int64_t start = 0; start < n; start += per_piece) {
        const int64_t m = n - start < per_piece ? n - start : per_piece;
        const int64_t number = __atomic_load_n(counts + rank * 8, __ATOMIC_RELAXED) + 1;
        uint8_t *set = slots + (number % 2) * ranks * slot_bytes;
        uint8_t *mine = set + rank * slot_bytes;
        if (dtype == 0) {
            memcpy(mine, (float *)data + start, (size_t)m * 4);
        } else if (wide) {
            const uint16_t *in = (const uint16_t *)data + start;
            float *out = (float *)mine;
            for (int64_t i = 0; i < m; i++) out[i] = bf16_to_f32(in[i]);
        } else {
            memcpy(mine, (uint16_t *)data + start, (size_t)m * 2);
        }
        /* which collective this is, as host_collectives.py tags an all-reduce: kind 1, its piece's bytes */
        const int status = meet(counts, rank, ranks, number, ((int64_t)1 << 56) | (m * in_slot), pids, timeout_s);
        if (status) return status;
        if (dtype == 0 || wide) {
            const float *first = (const float *)set;
            float total[256];
            for (int64_t i0 = 0; i0 < m; i0 += 256) {
                const int64_t k = m - i0 < 256 ? m - i0 : 256;
                for (int64_t i = 0; i < k; i++) total[i] = first[i0 + i];
                for (int64_t r = 1; r < ranks; r++) {
                    const float *other = (const float *)(set + r * slot_bytes) + i0;
                    for (int64_t i = 0; i < k; i++) total[i] += other[i];
                }
                if (dtype == 0) {
                    memcpy((float *)data + start + i0, total, (size_t)k * 4);
                } else {
                    uint16_t *out = (uint16_t *)data + start + i0;
                    for (int64_t i = 0; i < k; i++) out[i] = f32_to_bf16(total[i]);
                }
            }
        } else {
            const uint16_t *first = (const uint16_t *)set;
            uint16_t *out = (uint16_t *)data + start;
            for (int64_t i = 0; i < m; i++) {
                uint16_t total = first[i];
                for (int64_t r = 1; r < ranks; r++)
                    total = f32_to_bf16(bf16_to_f32(total) + bf16_to_f32(((const uint16_t *)(set + r * slot_bytes))[i]));
                out[i] = total;
            }
        }
    }
    return 0;
}

/*
 * One all-to-all among the ranks of the segment (host_collectives.py's HostSegment.all_to_all): this rank sends
 * send_bytes[j] bytes to each rank j (from `send`, rank 0's bytes first) and receives recv_bytes[i] from each rank i
 * (into `recv`, rank 0's first). Each rank's slot holds a header, the bytes it sends each rank and the rounds it
 * needs, then one region a destination; what does not fit a region goes in later rounds, a collective each, as
 * many as the rank needing most says in the first. sent[i]: the bytes rank i says it sends here (the caller fails
 * where they are not recv_bytes[i]; the smaller is copied, and every rank takes the same rounds, so the ranks stay
 * in step). Tagged as host_collectives.py tags an all-to-all: kind 5, the bytes of a row, which every rank must
 * agree on. Returns 0, what kunlun_host_await says went wrong, or 1 + 2 * ranks + r where rank r is at another
 * collective.
 */
int kunlun_host_all_to_all(int64_t *counts, int64_t rank, int64_t ranks, uint8_t *slots, int64_t slot_bytes,
                           const uint8_t *send, const int64_t *send_bytes, uint8_t *recv, const int64_t *recv_bytes,
                           int64_t row_bytes, const int64_t *pids, float timeout_s, int64_t *sent) {
    const int64_t header = 8 * (ranks + 1), region = (slot_bytes - header) / ranks / 64 * 64;
    const int64_t tag = ((int64_t)5 << 56) | row_bytes;
    int64_t needs = 1;
    for (int64_t j = 0; j < ranks; j++) {
        const int64_t most = send_bytes[j] > recv_bytes[j] ? send_bytes[j] : recv_bytes[j];
        if ((most + region - 1) / region > needs) needs = (most + region - 1) / region;
    }
    int64_t rounds = needs;
    for (int64_t round = 0; round < rounds; round++) {
        const int64_t number = __atomic_load_n(counts + rank * 8, __ATOMIC_RELAXED) + 1;
        uint8_t *set = slots + (number % 2) * ranks * slot_bytes;
        uint8_t *mine = set + rank * slot_bytes;
        int64_t *head = (int64_t *)mine, start = 0;
        for (int64_t j = 0; j < ranks; j++) {
            head[j] = send_bytes[j];
            const int64_t begin = round * region < send_bytes[j] ? round * region : send_bytes[j];
            const int64_t end = begin + region < send_bytes[j] ? begin + region : send_bytes[j];
            memcpy(mine + header + j * region, send + start + begin, (size_t)(end - begin));
            start += send_bytes[j];
        }
        head[ranks] = needs;
        const int status = meet(counts, rank, ranks, number, tag, pids, timeout_s);
        if (status) return status;
        int64_t into = 0;
        for (int64_t i = 0; i < ranks; i++) {
            const int64_t *theirs = (const int64_t *)(set + i * slot_bytes);
            if (round == 0) {
                sent[i] = theirs[rank];
                if (theirs[ranks] > rounds) rounds = theirs[ranks];
            }
            const int64_t both = sent[i] < recv_bytes[i] ? sent[i] : recv_bytes[i];
            const int64_t begin = round * region < both ? round * region : both;
            const int64_t end = begin + region < both ? begin + region : both;
            memcpy(recv + into + begin, set + i * slot_bytes + header + rank * region, (size_t)(end - begin));
            into += recv_bytes[i];
        }
    }
    return 0;
}
