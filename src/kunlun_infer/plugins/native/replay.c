/*
 * A captured step's kernel calls made again from C (cpu_capture.py): one call from Python for the whole step.
 *
 * A decode step of the 0.5B model replays ~240 calls. Made one at a time through ctypes, each converted its
 * arguments from Python objects on every step; here the step's calls are a table built once (kunlun_replay_call),
 * and this loop makes them in order.
 *
 * Every kernel the library exports takes integers and pointers (int64_t, int, void *) and float32 values, and
 * returns an int status or nothing. The x86-64 System V calling convention passes integer arguments in order,
 * the first six in registers and the rest on the stack, and float arguments in order in their own registers
 * (the first eight), whatever the order in which the two kinds alternate. So a kernel is called here as one
 * taking REPLAY_FLOATS floats and REPLAY_INTS integers: it reads its own integers and floats in their order and
 * leaves the rest, which the caller pops. cpu_capture.py builds the table only for calls that fit it (at most
 * REPLAY_INTS integer and REPLAY_FLOATS float arguments, no double); elsewhere than x86-64 System V this says so
 * and the calls are made from Python.
 */
#include <stdint.h>

#define REPLAY_INTS 16
#define REPLAY_FLOATS 2

typedef struct {
    void *function;
    int64_t ints[REPLAY_INTS];     /* the integer and pointer arguments, in order (an int sign-extended) */
    float floats[REPLAY_FLOATS];   /* the float arguments, in order */
    int64_t checked;               /* the kernel returns a status: nonzero stops the replay */
} kunlun_replay_call;

/* The layout cpu_capture.py builds the table in: integers, floats, and the struct's size in bytes. */
int64_t kunlun_replay_layout(int64_t which) {
    switch (which) {
        case 0: return REPLAY_INTS;
        case 1: return REPLAY_FLOATS;
        default: return (int64_t)sizeof(kunlun_replay_call);
    }
}

#if defined(__x86_64__) && !defined(_WIN32)
typedef int (*generic_kernel)(float, float, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

/* Calls [0, n) in order. Returns 0, or 1 + the index of the first checked call that returned nonzero (the calls
 * after it not made), or -1 where this platform's convention is not the one above (nothing made). */
int64_t kunlun_replay(const kunlun_replay_call *calls, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const kunlun_replay_call *c = calls + i;
        const int64_t *a = c->ints;
        const int status = ((generic_kernel)c->function)(c->floats[0], c->floats[1], a[0], a[1], a[2], a[3], a[4],
                                                          a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
                                                          a[14], a[15]);
        if (c->checked && status != 0) return i + 1;
    }
    return 0;
}
#else
int64_t kunlun_replay(const kunlun_replay_call *calls, int64_t n) {
    (void)calls, (void)n;
    return -1;
}
#endif
