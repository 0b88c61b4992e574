/*
 * transport._ucxspin: progress a UCX worker without holding the GIL.
 *
 * UCX moves a large message in fragments (TCP segments, shared-memory rendezvous fragments),
 * and each one needs both ends' workers to be progressed. A worker that sleeps on its event fd
 * between fragments pays a wake-up per fragment (measured: about half of ucx_perftest's
 * throughput); one that is polled from a Python loop holds the GIL between calls and starves
 * the threads that post and hash. Here the owner thread polls the worker in C with the GIL
 * released, for a bounded slice, and comes back to Python as soon as something happened. An
 * idle turn yields the core (sched_yield), so the polling costs little to threads that have
 * work: on a machine with few cores, a hashing thread and the poller share one.
 *
 *   spin(progress_fn, worker, wake_fd, budget_ns) -> int
 *       progress_fn: address of `unsigned ucp_worker_progress(ucp_worker_h)` (from ctypes);
 *       worker: the ucp_worker_h (ucxx's UCXWorker.handle); wake_fd: a file descriptor that
 *       becomes readable when other threads queued work for the owner thread.
 *       Polls until progress reported events and then went quiet (returns their count), or
 *       wake_fd became readable, or budget_ns passed (returns 0 for both).
 *       Call it only on the thread that owns the worker (a UCX worker is single-threaded).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

typedef unsigned (*progress_fn_t)(void *worker);

/* Iterations between checks of the clock and the wake fd (each check is a syscall or two). */
#define CHECK_EVERY 16

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int readable(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
    return poll(&p, 1, 0) > 0;
}

static unsigned long long spin_loop(progress_fn_t progress, void *worker, int wake_fd,
                                    int64_t budget_ns) {
    unsigned long long events = 0;
    int64_t deadline = now_ns() + budget_ns;
    for (unsigned i = 1;; i++) {
        unsigned n = progress(worker);
        if (n) {
            events += n;
            continue;  /* drain what is there */
        }
        if (events)
            return events;  /* something happened and it is quiet now: let Python reap */
        sched_yield();  /* nothing to do: a thread of ours that has work (hashing, posting) runs */
        if (i % CHECK_EVERY == 0 && (now_ns() >= deadline || readable(wake_fd)))
            return 0;
    }
}

static PyObject *spin(PyObject *self, PyObject *args) {
    unsigned long long fn_addr, worker_addr;
    int wake_fd;
    long long budget_ns;
    if (!PyArg_ParseTuple(args, "KKiL", &fn_addr, &worker_addr, &wake_fd, &budget_ns))
        return NULL;
    if (fn_addr == 0 || worker_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "spin: null progress function or worker");
        return NULL;
    }
    if (budget_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "spin: budget_ns must be >= 0");
        return NULL;
    }
    unsigned long long events;
    Py_BEGIN_ALLOW_THREADS
    events = spin_loop((progress_fn_t)(uintptr_t)fn_addr, (void *)(uintptr_t)worker_addr, wake_fd,
                       (int64_t)budget_ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(events);
}

static PyMethodDef methods[] = {
    {"spin", spin, METH_VARARGS,
     "spin(progress_fn, worker, wake_fd, budget_ns) -> int: progress a UCX worker without the GIL "
     "until events came and went quiet (their count), wake_fd is readable or the budget passed (0)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "transport._ucxspin",
                                    "Progress a UCX worker without holding the GIL.", -1, methods};

PyMODINIT_FUNC PyInit__ucxspin(void) { return PyModule_Create(&module); }
