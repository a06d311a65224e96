/* Preloaded (LD_PRELOAD) into the Python and JavaScript plugin toolchains by `idemhost plugin
 * build` (cli/plugin_repro.rs), beside tracer.c, so that the same source and seed build the same
 * bytes. componentize-py and componentize-js run the interpreter and keep a snapshot of its
 * memory; without this, that memory holds random bytes and clock readings of the build machine.
 *
 * - getrandom/getentropy: a stream from the project's seed (IDEMHOST_BUILD_SEED, 16 hex digits)
 *   and the program's command line (each argument's last path component); the k-th call on a thread gets the stream's k-th block, so
 *   two threads never race for one position (what a thread asks for, in its order, decides what
 *   it gets). So two threads of one program draw the same blocks: a name both make from random
 *   bytes at once collides (the toolchains pinned here do not).
 * - The wall clock starts at 2001-01-01 and advances 1 us per read on each thread: fixed, yet a
 *   loop that waits until a wall-clock deadline still ends.
 * - The monotonic clocks start at 1 s and advance 1 us per read on each thread. Their start
 *   reaches the snapshot (a real one made Python's differ), so it is fixed; it is below any
 *   real monotonic time, so a deadline given to the kernel (an absolute sleep or timed wait) is
 *   already past and returns at once, and a loop that waits until a deadline by reading the
 *   clock ends after as many reads as microseconds it waits. A start above the real clock would
 *   make such a sleep last for years.
 * Raw system calls that bypass libc are tracer.c's. */
#define _GNU_SOURCE
/* glibc declares the pointers below nonnull; a caller may still pass NULL. */
#pragma GCC diagnostic ignored "-Wnonnull-compare"
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define WALL_START 978307200ull /* 2001-01-01T00:00:00Z */
#define MONOTONIC_START_NS 1000000000ull

static uint64_t seed;
static __thread uint64_t random_calls, wall_reads, mono_reads;

/* The seed, mixed with the program's command line: two programs of a build (node and the
 * wizer step it starts, componentize-py and the python3 it asks) draw different streams, so the
 * names they make from random bytes (temporary files) do not collide. */
__attribute__((constructor)) static void read_seed(void) {
  const char *s = getenv("IDEMHOST_BUILD_SEED");
  if (s) seed = strtoull(s, NULL, 16);
  int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  unsigned char buf[4096];
  ssize_t n = read(fd, buf, sizeof buf);
  close(fd);
  /* Each argument's last path component only: where the toolchain is installed differs
   * between machines, and must not change the bytes. */
  uint64_t h = 1469598103934665603ull;
  ssize_t start = 0;
  for (ssize_t i = 0; i < n; i++) {
    if (buf[i] == '/') start = i + 1;
    if (buf[i] != 0) continue;
    for (ssize_t j = start; j <= i; j++) h = (h ^ buf[j]) * 1099511628211ull;
    start = i + 1;
  }
  seed ^= h;
}

static uint64_t splitmix(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

ssize_t getrandom(void *buf, size_t len, unsigned flags) {
  (void)flags;
  uint64_t state = seed ^ ((++random_calls) * 0xD1B54A32D192ED03ull);
  unsigned char *p = buf;
  for (size_t i = 0; i < len; i += 8) {
    uint64_t z = splitmix(&state);
    memcpy(p + i, &z, len - i < 8 ? len - i : 8);
  }
  return (ssize_t)len;
}

int getentropy(void *buf, size_t len) {
  getrandom(buf, len, 0);
  return 0;
}

typedef long (*syscall_fn)(long, ...);
static syscall_fn real_syscall(void) {
  static syscall_fn real = 0;
  if (!real) real = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
  return real;
}

static void set(struct timespec *ts, uint64_t ns) {
  ts->tv_sec = (time_t)(ns / 1000000000ull);
  ts->tv_nsec = (long)(ns % 1000000000ull);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
  if (!ts) return 0;
  switch (id) {
  case CLOCK_REALTIME:
  case CLOCK_REALTIME_COARSE:
  case CLOCK_TAI:
    set(ts, WALL_START * 1000000000ull + (wall_reads++) * 1000ull);
    return 0;
  case CLOCK_MONOTONIC:
  case CLOCK_MONOTONIC_RAW:
  case CLOCK_MONOTONIC_COARSE:
  case CLOCK_BOOTTIME:
    set(ts, MONOTONIC_START_NS + (mono_reads++) * 1000ull);
    return 0;
  default: /* CPU-time clocks: counted from zero */
    set(ts, (mono_reads++) * 1000ull);
    return 0;
  }
}

int gettimeofday(struct timeval *tv, void *tz) {
  (void)tz;
  if (tv) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
  }
  return 0;
}

time_t time(time_t *t) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (t) *t = ts.tv_sec;
  return ts.tv_sec;
}

/* syscall(SYS_getrandom, ...) and syscall(SYS_clock_gettime, ...) through libc's wrapper. */
long syscall(long number, ...) {
  va_list ap;
  va_start(ap, number);
  long a[6];
  for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
  va_end(ap);
  if (number == SYS_getrandom) return getrandom((void *)a[0], (size_t)a[1], (unsigned)a[2]);
  if (number == SYS_clock_gettime) return clock_gettime((clockid_t)a[0], (struct timespec *)a[1]);
  return real_syscall()(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
