/* The tracer `idemhost plugin build` runs the Python and JavaScript toolchains under
 * (cli/plugin_repro.rs), beside pin.c, so that the same source and seed build the same bytes:
 *   PIN_UNDER=/abs/dir/ IDEMHOST_BUILD_SEED=<16 hex digits> tracer program [args...]
 * A seccomp filter stops the program only at the stat calls (statx, newfstatat, fstat, stat,
 * lstat), getrandom and the wall clock; at each stop's end the tracer pins what the program
 * reads: the times and inode numbers of files under $PIN_UNDER (componentize-py's WASI layer
 * reads them with raw system calls, which a preloaded library cannot reach), getrandom's bytes
 * (the k-th call of a thread gets the seed's k-th block), a fixed wall clock. At each exec it
 * hides the vDSO (AT_SYSINFO_EHDR becomes AT_IGNORE) so that clock reads are system calls (the
 * monotonic ones pass unstopped: pin.c counts them) and fixes the 16 bytes AT_RANDOM points to.
 * Not covered: getdents64's inode numbers, /proc/self/auxv. x86_64 Linux only. Exits with the
 * program's status. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <linux/audit.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <linux/stat.h>
#include <unistd.h>
#include <time.h>
static const char *PFX;
static uint64_t fnv(const char *s) { uint64_t h = 1469598103934665603ull; while (*s) { h ^= (unsigned char)*s++; h *= 1099511628211ull; } return h; }
struct pend { pid_t tid; long nr; unsigned long a[6]; int seen; uint64_t random_calls; };
static uint64_t SEED;
static struct pend pend[4096];
static struct pend *slot(pid_t t) { for (int i = 0; i < 4096; i++) if (pend[i].tid == t) return &pend[i]; for (int i = 0; i < 4096; i++) if (!pend[i].tid) { memset(&pend[i], 0, sizeof pend[i]); pend[i].tid = t; return &pend[i]; } fprintf(stderr, "tracer: more than 4096 threads\n"); exit(3); }
static int rd(pid_t t, unsigned long addr, void *buf, size_t n) { struct iovec l = {buf, n}, r = {(void *)addr, n}; return process_vm_readv(t, &l, 1, &r, 1, 0) == (ssize_t)n ? 0 : -1; }
static int wr(pid_t t, unsigned long addr, void *buf, size_t n) { struct iovec l = {buf, n}, r = {(void *)addr, n}; return process_vm_writev(t, &l, 1, &r, 1, 0) == (ssize_t)n ? 0 : -1; }
static int path_of(pid_t t, long dirfd, unsigned long p, char *out, size_t len) {
  char s[4096] = {0};
  if (p) { for (size_t i = 0; i < sizeof s - 1; i += 1) { if (rd(t, p + i, s + i, 1)) return -1; if (!s[i]) break; } }
  if (s[0] == '/') { snprintf(out, len, "%s", s); return 0; }
  char link[64];
  if ((int)dirfd == AT_FDCWD) snprintf(link, sizeof link, "/proc/%d/cwd", t); else snprintf(link, sizeof link, "/proc/%d/fd/%d", t, (int)dirfd);
  ssize_t n = readlink(link, out, len - 1); if (n < 0) return -1; out[n] = 0;
  /* An empty path (AT_EMPTY_PATH) is the descriptor itself; with a path the kernel uses the path. */
  if (s[0]) { size_t l = strlen(out); snprintf(out + l, len - l, "/%s", s); }
  return 0;
}
int main(int argc, char **argv) {
  PFX = getenv("PIN_UNDER");
  if (getenv("IDEMHOST_BUILD_SEED")) SEED = strtoull(getenv("IDEMHOST_BUILD_SEED"), NULL, 16);
  if (argc < 2 || !PFX || PFX[0] != '/') { fprintf(stderr, "usage: PIN_UNDER=/abs/dir/ tracer program [args...]\n"); return 2; }
  /* Ends with the build that started it (a signal to that process alone, an IDE's stop): the
   * traced toolchain then dies too (PTRACE_O_EXITKILL) instead of running on, orphaned, in the
   * build directory the next build takes. */
  pid_t parent = getppid();
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) || getppid() != parent) return 1;
  pid_t child = fork();
  if (child == 0) {
    if (ptrace(PTRACE_TRACEME, 0, 0, 0)) {
      perror("tracer: ptrace (a reproducible build traces its toolchain; where tracing is not allowed, IDEMHOST_UNPINNED_BUILD=1 builds without)");
      _exit(127);
    }
    raise(SIGSTOP);
    struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_statx, 12, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_newfstatat, 11, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_fstat, 10, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_stat, 9, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_lstat, 8, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getrandom, 7, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_gettimeofday, 6, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_time, 5, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clock_gettime, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, CLOCK_REALTIME, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, CLOCK_REALTIME_COARSE, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRACE),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) { perror("tracer: seccomp (IDEMHOST_UNPINNED_BUILD=1 builds without)"); _exit(127); }
    execvp(argv[1], argv + 1); fprintf(stderr, "tracer: cannot run %s: %s\n", argv[1], strerror(errno)); _exit(127);
  }
  int st; waitpid(child, &st, 0);
  ptrace(PTRACE_SETOPTIONS, child, 0, PTRACE_O_TRACESECCOMP | PTRACE_O_TRACECLONE | PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK | PTRACE_O_TRACEEXEC | PTRACE_O_TRACESYSGOOD | PTRACE_O_EXITKILL);
  ptrace(PTRACE_CONT, child, 0, 0);
  int code = 0;
  for (;;) {
    pid_t t = waitpid(-1, &st, __WALL);
    if (t < 0 && errno == EINTR) continue;
    if (t < 0) break;
    if (WIFEXITED(st) || WIFSIGNALED(st)) { if (t == child) code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); struct pend *p = slot(t); if (p) p->tid = 0; continue; }
    if (!WIFSTOPPED(st)) continue;
    int sig = WSTOPSIG(st), ev = st >> 16;
    if (sig == SIGTRAP && ev == PTRACE_EVENT_SECCOMP) {
      struct user_regs_struct r; ptrace(PTRACE_GETREGS, t, 0, &r);
      struct pend *p = slot(t); p->nr = r.orig_rax; p->a[0] = r.rdi; p->a[1] = r.rsi; p->a[2] = r.rdx; p->a[3] = r.r10; p->a[4] = r.r8;
      ptrace(PTRACE_SYSCALL, t, 0, 0); continue;
    }
    if (sig == (SIGTRAP | 0x80)) {
      struct user_regs_struct r; ptrace(PTRACE_GETREGS, t, 0, &r);
      struct pend *p = slot(t);
      if (p && p->nr == SYS_time) { r.rax = 978307200; ptrace(PTRACE_SETREGS, t, 0, &r); if (p->a[0]) { long v = 978307200; wr(t, p->a[0], &v, 8); } }
      if (p && p->nr && ((long)r.rax == 0 || p->nr == SYS_getrandom)) {
        char path[4096];
        if (p->nr == SYS_statx) {
          if (!path_of(t, p->a[0], p->a[1], path, sizeof path) && !strncmp(path, PFX, strlen(PFX))) {
            struct statx sx; if (!rd(t, p->a[4], &sx, sizeof sx)) {
              sx.stx_atime.tv_sec = sx.stx_btime.tv_sec = sx.stx_ctime.tv_sec = sx.stx_mtime.tv_sec = 978307200;
              sx.stx_atime.tv_nsec = sx.stx_btime.tv_nsec = sx.stx_ctime.tv_nsec = sx.stx_mtime.tv_nsec = 0;
              sx.stx_ino = fnv(path + strlen(PFX)) >> 16; wr(t, p->a[4], &sx, sizeof sx); }
          }
        } else if (p->nr == SYS_getrandom) {
          /* The k-th call of this thread: the seed's k-th block (as pin.c). */
          uint64_t st2 = SEED ^ ((++p->random_calls) * 0xD1B54A32D192ED03ull); unsigned char buf[4096];
          size_t n = (long)r.rax > 0 ? r.rax : 0;
          for (size_t done = 0; done < n; done += sizeof buf) {
            size_t k = n - done < sizeof buf ? n - done : sizeof buf;
            for (size_t i = 0; i < k; i += 8) { uint64_t z = (st2 += 0x9E3779B97F4A7C15ull); z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; z ^= z >> 31; memcpy(buf + i, &z, k - i < 8 ? k - i : 8); }
            wr(t, p->a[0] + done, buf, k);
          }
         
        } else if (p->nr == SYS_clock_gettime) {
          struct timespec ts = {978307200, 0}; wr(t, p->a[1], &ts, sizeof ts);
        } else if (p->nr == SYS_gettimeofday) {
          if (p->a[0]) { struct timeval tv = {978307200, 0}; wr(t, p->a[0], &tv, sizeof tv); }
        } else if (p->nr == SYS_newfstatat || p->nr == SYS_fstat || p->nr == SYS_stat || p->nr == SYS_lstat) {
          int ok; unsigned long buf;
          if (p->nr == SYS_newfstatat) { ok = !path_of(t, p->a[0], p->a[1], path, sizeof path); buf = p->a[2]; }
          else if (p->nr == SYS_fstat) { ok = !path_of(t, p->a[0], 0, path, sizeof path); buf = p->a[1]; }
          else { ok = !path_of(t, AT_FDCWD, p->a[0], path, sizeof path); buf = p->a[1]; }
          if (ok && !strncmp(path, PFX, strlen(PFX))) {
            struct stat s; if (!rd(t, buf, &s, sizeof s)) {
              s.st_atim.tv_sec = s.st_mtim.tv_sec = s.st_ctim.tv_sec = 978307200; s.st_atim.tv_nsec = s.st_mtim.tv_nsec = s.st_ctim.tv_nsec = 0;
              s.st_ino = fnv(path + strlen(PFX)) >> 16; wr(t, buf, &s, sizeof s); }
          }
        }
      }
      if (p) p->nr = 0;
      ptrace(PTRACE_CONT, t, 0, 0); continue;
    }
    if (sig == SIGTRAP && ev == PTRACE_EVENT_EXEC) {
      struct user_regs_struct r; ptrace(PTRACE_GETREGS, t, 0, &r);
      unsigned long sp = r.rsp, argc; rd(t, sp, &argc, 8); sp += 8 * (argc + 2);
      for (unsigned long v = 1; v; sp += 8) if (rd(t, sp, &v, 8)) v = 0;
      for (unsigned long a[2] = {1, 0}; a[0]; sp += 16) {
        if (rd(t, sp, a, 16)) break;
        if (a[0] == 33) { unsigned long ign = 1; wr(t, sp, &ign, 8); }              /* AT_SYSINFO_EHDR */
        if (a[0] == 25) { uint64_t r16[2] = {SEED ^ 0x5a5a5a5a5a5a5a5aull, ~SEED}; wr(t, a[1], r16, 16); } /* AT_RANDOM */
      }
      ptrace(PTRACE_CONT, t, 0, 0); continue;
    }
    if (sig == SIGTRAP && ev) { ptrace(PTRACE_CONT, t, 0, 0); continue; }
    if (sig == SIGSTOP && ev == 0) { struct pend *p = slot(t); int first = !p->seen; p->seen = 1; ptrace(PTRACE_CONT, t, 0, first ? 0 : sig); continue; }
    if (ev == PTRACE_EVENT_STOP) { ptrace(PTRACE_CONT, t, 0, 0); continue; }
    ptrace(PTRACE_CONT, t, 0, sig);
  }
  return code;
}
