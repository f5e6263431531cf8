// The CPU execution harness's runtime: runs CUDA kernels compiled for the host.
//
// A launch runs its blocks one at a time on the calling OS thread. Every CUDA thread
// of a block is a fiber with its own stack (guard page below it); a fiber runs until
// it reaches a synchronization point (__syncthreads, a *_sync shuffle, __syncwarp) or
// returns, then the scheduler picks the next one:
//
// * a barrier completes when every thread of the block waits at it (all at the same
//   __syncthreads of the source: file and line); waiting threads are then released in
//   schedule order;
// * a warp operation completes when every lane named in its mask has arrived with the
//   same operation, mask and width; the lanes of that warp then run first (depth
//   first), so one warp may run far ahead of the others, as it may on a GPU;
// * deadlock (nothing can run), a barrier reached by part of the block (others exited),
//   a shuffle whose lanes cannot all arrive, or reading a lane outside the mask are
//   reported as errors, with the threads involved.
//
// Two schedules exist: "forward" (threads in index order, blocks in order) and
// "reverse" (everything reversed). The Python launcher runs every launch under both
// and compares the outputs bit for bit: a result that depends on the order of
// unsynchronized threads (a race) shows up as a difference.
//
// Memory: device buffers come from pnc_alloc: each is its own mapping with an
// inaccessible page on both sides, NaN bytes (0xFF) everywhere at allocation, and
// 0xFF canary bytes between the buffer and the guard pages, checked after each launch
// (pnc_check_canaries). The module's thread-local block (its __shared__ variables)
// is filled with 0xFF before every block. A fault (guard page, stack overflow,
// misaligned access trapped by -fsanitize=alignment, integer division by zero) ends
// the launch with an error naming the thread and block, instead of the process.
#include <dlfcn.h>
#include <link.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "include/cuda_cpu_abi.h"
#include "include/cuda_cpu_convert.h"

extern "C" {
pnc_thread* pnc_current = nullptr;
uint3 pnc_block_idx = {0, 0, 0};
dim3 pnc_block_dim;
dim3 pnc_grid_dim;
}

namespace {

// ---------------------------------------------------------------------------
// fibers

#if defined(__x86_64__)
// void pnc_swap(void** save_sp, void* load_sp): save the callee-saved registers, the
// SSE control word and the x87 control word on the current stack, switch stacks, and
// restore them from the new one.
extern "C" void pnc_swap(void** save_sp, void* load_sp);
extern "C" void pnc_fiber_entry();
asm(R"(
  .text
  .globl pnc_swap
  .type pnc_swap, @function
pnc_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pnc_swap, .-pnc_swap

  .globl pnc_fiber_entry
  .type pnc_fiber_entry, @function
pnc_fiber_entry:
  movq %r12, %rdi
  andq $-16, %rsp
  callq *%r13
  ud2
  .size pnc_fiber_entry, .-pnc_fiber_entry
)");
#define PNC_ASM_FIBERS 1
#else
#include <ucontext.h>
#endif

constexpr size_t kStack = 256 * 1024;  // per fiber (kernels use a few KiB; -O0 builds more)
constexpr size_t kMaxThreads = 1024;

enum State { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
  pnc_thread t;  // first member: pnc_current points here
  int linear = 0;
  State state = READY;
  const char* site = nullptr;  // barrier call site ("file:line")
  // warp operation
  uint64_t value = 0, result = 0;
  unsigned mask = 0;
  int op = 0, arg = 0, width = 0;
#if PNC_ASM_FIBERS
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

struct WarpRound {
  unsigned arrived = 0;  // lanes waiting
  unsigned mask = 0;
  int op = -1, width = 0;
};

struct Launch;
Launch* g_launch = nullptr;

size_t page_size() {
  static size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

constexpr size_t kGuard = 64 * 1024;  // inaccessible below each stack: frames larger than a page still hit it

struct Stacks {
  char* base = nullptr;
  size_t count = 0;
  size_t stride() const { return kStack + kGuard; }
  char* lo(size_t i) const { return base + i * stride() + kGuard; }  // above the guard region
  char* hi(size_t i) const { return lo(i) + kStack; }
  bool ensure(size_t n) {
    if (n <= count) return true;
    if (base != nullptr) munmap(base, count * stride());
    void* p = mmap(nullptr, n * stride(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      base = nullptr;
      count = 0;
      return false;
    }
    base = static_cast<char*>(p);
    count = n;
    for (size_t i = 0; i < n; ++i) mprotect(base + i * stride(), kGuard, PROT_NONE);
    return true;
  }
  bool contains_guard(const void* a, size_t* which) const {
    const char* c = static_cast<const char*>(a);
    for (size_t i = 0; i < count; ++i) {
      const char* g = base + i * stride();
      if (c >= g && c < g + kGuard) {
        *which = i;
        return true;
      }
    }
    return false;
  }
};
Stacks g_stacks;

// ---------------------------------------------------------------------------
// errors

struct LaunchError {
  std::string msg;
  bool set = false;
};

void fmt_into(std::string& s, const char* f, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof buf, f, ap);
  s += buf;
}

std::string describe_thread(const Fiber& f) {
  char buf[160];
  snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", f.t.tid.x, f.t.tid.y, f.t.tid.z, pnc_block_idx.x,
           pnc_block_idx.y, pnc_block_idx.z);
  return buf;
}

// ---------------------------------------------------------------------------
// a launch in progress

struct Launch {
  const pnc_kernel* kernel = nullptr;
  void** slots = nullptr;
  int reverse = 0;
  size_t nthreads = 0;
  std::vector<Fiber> fibers;
  std::vector<WarpRound> warps;
  std::deque<int> queue;
  Fiber* running = nullptr;
  size_t n_done = 0, n_barrier = 0;
#if PNC_ASM_FIBERS
  void* sched_sp = nullptr;
#else
  ucontext_t sched;
#endif
  LaunchError err;
  sigjmp_buf fault_jmp;
  volatile sig_atomic_t in_block = 0;

  void fail(const char* f, ...) __attribute__((format(printf, 2, 3))) {
    if (err.set) return;
    err.set = true;
    va_list ap;
    va_start(ap, f);
    fmt_into(err.msg, f, ap);
    va_end(ap);
  }
};

void to_scheduler(Fiber* f) {
#if PNC_ASM_FIBERS
  pnc_swap(&f->sp, g_launch->sched_sp);
#else
  swapcontext(&f->uc, &g_launch->sched);
#endif
}

void fiber_main(Fiber* f) {
  g_launch->kernel->invoke(g_launch->slots);
  f->state = DONE;
  to_scheduler(f);
  __builtin_trap();  // a finished fiber is never resumed
}

#if !PNC_ASM_FIBERS
void fiber_trampoline(unsigned hi, unsigned lo) {
  fiber_main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

void init_fiber(Fiber& f, size_t i) {
#if PNC_ASM_FIBERS
  uint64_t* sp = reinterpret_cast<uint64_t*>(g_stacks.hi(i));
  // frame popped by pnc_swap: [mxcsr|fpucw] r15 r14 r13 r12 rbx rbp, then the return address
  *--sp = 0;  // padding (keeps the entry's stack 16-byte aligned before its call)
  *--sp = reinterpret_cast<uint64_t>(&pnc_fiber_entry);
  *--sp = 0;                                             // rbp
  *--sp = 0;                                             // rbx
  *--sp = reinterpret_cast<uint64_t>(&f);                // r12: the argument
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);       // r13: the function
  *--sp = 0;                                             // r14
  *--sp = 0;                                             // r15
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(*reinterpret_cast<uint16_t*>(&csr[1])));
  *--sp = static_cast<uint64_t>(csr[0]) | (static_cast<uint64_t>(csr[1] & 0xffffu) << 32);
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = g_stacks.lo(i);
  f.uc.uc_stack.ss_size = kStack;
  f.uc.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_trampoline), 2, static_cast<unsigned>(p >> 32),
              static_cast<unsigned>(p & 0xffffffffu));
#endif
}

void resume(Launch& L, Fiber& f) {
  L.running = &f;
  pnc_current = &f.t;
#if PNC_ASM_FIBERS
  pnc_swap(&L.sched_sp, f.sp);
#else
  swapcontext(&L.sched, &f.uc);
#endif
  pnc_current = nullptr;
  L.running = nullptr;
}

// push threads in schedule order, to the back (after a barrier) or the front (a warp's lanes)
void push_order(Launch& L, std::vector<int>& ids, bool front) {
  if (L.reverse) std::reverse(ids.begin(), ids.end());
  if (front) {
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) L.queue.push_front(*it);
  } else {
    for (int i : ids) L.queue.push_back(i);
  }
}

unsigned lanes_present(const Launch& L, int warp) {
  const size_t first = static_cast<size_t>(warp) * 32;
  const size_t n = std::min<size_t>(32, L.nthreads - first);
  return n == 32 ? 0xffffffffu : ((1u << n) - 1u);
}

// every thread of the block waits at the barrier: check the sites, release them
void release_barrier(Launch& L) {
  const char* site = nullptr;
  size_t first = 0;
  std::vector<int> ids;
  for (size_t i = 0; i < L.nthreads; ++i) {
    Fiber& f = L.fibers[i];
    if (f.state != AT_BARRIER) continue;
    if (site == nullptr) {
      site = f.site;
      first = i;
    }
    if (strcmp(f.site, site) != 0) {
      L.fail("__syncthreads: threads of one block wait at different __syncthreads calls (%s at %s, %s at %s)",
             describe_thread(L.fibers[first]).c_str(), site, describe_thread(f).c_str(), f.site);
      return;
    }
    f.state = READY;
    ids.push_back(static_cast<int>(i));
  }
  L.n_barrier = 0;
  push_order(L, ids, false);
}

void complete_warp(Launch& L, int w) {
  WarpRound& r = L.warps[static_cast<size_t>(w)];
  std::vector<int> ids;
  for (int lane = 0; lane < 32; ++lane) {
    if (!(r.mask & (1u << lane))) continue;
    Fiber& f = L.fibers[static_cast<size_t>(w) * 32 + static_cast<size_t>(lane)];
    if (r.op >= 0) {  // a shuffle (op -1: __syncwarp)
      const int width = f.width;
      const int seg = lane & ~(width - 1);
      int src = lane;
      switch (f.op) {
        case PNC_SHFL_IDX: src = seg + (f.arg & (width - 1)); break;
        case PNC_SHFL_UP: src = lane - f.arg < seg ? lane : lane - f.arg; break;
        case PNC_SHFL_DOWN: src = lane + f.arg >= seg + width ? lane : lane + f.arg; break;
        case PNC_SHFL_XOR: src = (lane ^ f.arg) >= seg + width ? lane : (lane ^ f.arg); break;
        default: break;
      }
      if (src < 0 || src > 31 || !(r.mask & (1u << src))) {
        L.fail("warp shuffle: %s reads lane %d, which is not in the mask 0x%08x", describe_thread(f).c_str(), src,
               r.mask);
        return;
      }
      f.result = L.fibers[static_cast<size_t>(w) * 32 + static_cast<size_t>(src)].value;
    }
    f.state = READY;
    ids.push_back(static_cast<int>(static_cast<size_t>(w) * 32 + static_cast<size_t>(lane)));
  }
  r = WarpRound();
  push_order(L, ids, true);
}

// a thread arrived at a warp operation (op -1: __syncwarp)
void warp_arrive(Launch& L, Fiber& f, unsigned mask, int op, int width) {
  const int w = f.linear / 32, lane = f.linear % 32;
  WarpRound& r = L.warps[static_cast<size_t>(w)];
  if (!(mask & (1u << lane))) {
    L.fail("warp operation: %s calls it with a mask 0x%08x that does not name its own lane %d",
           describe_thread(f).c_str(), mask, lane);
    return;
  }
  if (mask & ~lanes_present(L, w)) {
    L.fail("warp operation: %s names lanes that do not exist in its warp (mask 0x%08x, block of %zu threads)",
           describe_thread(f).c_str(), mask, L.nthreads);
    return;
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    L.fail("warp shuffle: %s passes width %d (must be a power of two <= 32)", describe_thread(f).c_str(), width);
    return;
  }
  if (r.arrived == 0) {
    r.mask = mask;
    r.op = op;
    r.width = width;
  } else if (r.mask != mask || r.op != op || r.width != width) {
    L.fail("warp operation: lanes of warp %d meet with different operations or masks (%s: op %d mask 0x%08x width "
           "%d; waiting lanes 0x%08x: op %d mask 0x%08x width %d)",
           w, describe_thread(f).c_str(), op, mask, width, r.arrived, r.op, r.mask, r.width);
    return;
  }
  r.arrived |= 1u << lane;
  f.state = AT_WARP;
  if (r.arrived == r.mask) complete_warp(L, w);
}

std::string waiting_summary(Launch& L) {
  std::string s;
  size_t shown = 0;
  for (size_t w = 0; w < L.warps.size(); ++w) {
    const WarpRound& r = L.warps[w];
    if (r.arrived == 0) continue;
    unsigned missing = r.mask & ~r.arrived;
    char buf[256];
    std::string why;
    for (int lane = 0; lane < 32 && why.size() < 80; ++lane) {
      if (!(missing & (1u << lane))) continue;
      const Fiber& f = L.fibers[w * 32 + static_cast<size_t>(lane)];
      why += " lane " + std::to_string(lane) +
             (f.state == DONE ? " (exited)" : f.state == AT_BARRIER ? " (at __syncthreads)" : " (elsewhere)");
    }
    snprintf(buf, sizeof buf, "; warp %zu: lanes 0x%08x wait at a %s with mask 0x%08x, missing:%s", w, r.arrived,
             r.op < 0 ? "__syncwarp" : "shuffle", r.mask, why.c_str());
    s += buf;
    if (++shown >= 4) break;
  }
  return s;
}

// run one block to completion (or to the first error)
void run_block(Launch& L) {
  L.queue.clear();
  L.n_done = L.n_barrier = 0;
  for (WarpRound& r : L.warps) r = WarpRound();
  std::vector<int> ids;
  for (size_t i = 0; i < L.nthreads; ++i) {
    Fiber& f = L.fibers[i];
    f.state = READY;
    f.site = nullptr;
    init_fiber(f, i);
    ids.push_back(static_cast<int>(i));
  }
  push_order(L, ids, false);
  while (!L.err.set) {
    if (L.queue.empty()) {
      if (L.n_done == L.nthreads) return;
      if (L.n_barrier > 0 && L.n_barrier + L.n_done == L.nthreads) {
        L.fail("__syncthreads reached by %zu of the block's %zu threads: the other %zu have exited (block (%u,%u,%u))",
               L.n_barrier, L.nthreads, L.n_done, pnc_block_idx.x, pnc_block_idx.y, pnc_block_idx.z);
      } else {
        L.fail("deadlock in block (%u,%u,%u): %zu threads at __syncthreads, %zu exited, the rest wait at warp "
               "operations that cannot complete%s",
               pnc_block_idx.x, pnc_block_idx.y, pnc_block_idx.z, L.n_barrier, L.n_done, waiting_summary(L).c_str());
      }
      return;
    }
    const int id = L.queue.front();
    L.queue.pop_front();
    Fiber& f = L.fibers[static_cast<size_t>(id)];
    resume(L, f);
    if (f.state == DONE) {
      ++L.n_done;
      const int w = f.linear / 32;
      if (L.warps[static_cast<size_t>(w)].mask & (1u << (f.linear % 32)) &&
          !(L.warps[static_cast<size_t>(w)].arrived & (1u << (f.linear % 32)))) {
        L.fail("warp operation: %s exited while the lanes 0x%08x of its warp wait for it (mask 0x%08x)",
               describe_thread(f).c_str(), L.warps[static_cast<size_t>(w)].arrived,
               L.warps[static_cast<size_t>(w)].mask);
        return;
      }
    } else if (f.state == AT_BARRIER) {
      ++L.n_barrier;
    }
    if (L.n_barrier > 0 && L.n_barrier == L.nthreads - L.n_done && L.n_done == 0) release_barrier(L);
  }
}

// ---------------------------------------------------------------------------
// faults

struct sigaction g_old_actions[32];
const int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGALRM};
stack_t g_old_altstack;
char* g_altstack = nullptr;
volatile void* g_fault_addr = nullptr;
volatile int g_fault_sig = 0;

void on_fault(int sig, siginfo_t* info, void* ctx) {
  Launch* L = g_launch;
  if (L == nullptr || !L->in_block) {
    // not ours: restore the previous handler and let the signal happen again
    sigaction(sig, &g_old_actions[sig], nullptr);
    if (sig == SIGALRM) raise(sig);
    return;
  }
  (void)ctx;
  g_fault_sig = sig;
  g_fault_addr = info->si_addr;
  L->in_block = 0;
  siglongjmp(L->fault_jmp, 1);
}

void install_handlers() {
  if (g_altstack == nullptr) g_altstack = static_cast<char*>(malloc(1 << 16));
  stack_t ss;
  ss.ss_sp = g_altstack;
  ss.ss_size = 1 << 16;
  ss.ss_flags = 0;
  sigaltstack(&ss, &g_old_altstack);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int s : kSignals) sigaction(s, &sa, &g_old_actions[s]);
}

void remove_handlers() {
  for (int s : kSignals) sigaction(s, &g_old_actions[s], nullptr);
  sigaltstack(&g_old_altstack, nullptr);
}

std::mutex g_launch_mutex;

// ---------------------------------------------------------------------------
// the module's thread-local block (shared memory)

struct TlsRange {
  unsigned char* start = nullptr;
  size_t size = 0;
};

struct PhdrQuery {
  ElfW(Addr) base;
  size_t tls_size;
};

int phdr_cb(struct dl_phdr_info* info, size_t, void* data) {
  PhdrQuery* q = static_cast<PhdrQuery*>(data);
  if (info->dlpi_addr != q->base) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) q->tls_size = info->dlpi_phdr[i].p_memsz;
  }
  return 1;
}

bool tls_range(void* handle, const pnc_module* mod, TlsRange* out, std::string* why) {
  mod->tls_anchor();  // the block is allocated on first use by this thread
  void* start = nullptr;
  if (dlinfo(handle, RTLD_DI_TLS_DATA, &start) != 0 || start == nullptr) {
    *why = "dlinfo(RTLD_DI_TLS_DATA) found no thread-local block for the module";
    return false;
  }
  struct link_map* lm = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || lm == nullptr) {
    *why = "dlinfo(RTLD_DI_LINKMAP) failed";
    return false;
  }
  PhdrQuery q{lm->l_addr, 0};
  dl_iterate_phdr(phdr_cb, &q);
  if (q.tls_size == 0) {
    *why = "the module has no PT_TLS segment";
    return false;
  }
  out->start = static_cast<unsigned char*>(start);
  out->size = q.tls_size;
  return true;
}

// ---------------------------------------------------------------------------
// device memory

struct Alloc {
  char* map = nullptr;  // whole mapping, guard pages included
  size_t map_size = 0;
  char* data = nullptr;
  size_t size = 0;
};
std::mutex g_alloc_mutex;
std::map<uintptr_t, Alloc> g_allocs;  // by data address
constexpr size_t kPreCanary = 512;     // data is 512-byte aligned, as CuPy's allocations
constexpr size_t kMinPostCanary = 256;
int g_poison_fd = -2;
constexpr size_t kPoisonChunk = 2 << 20;

// a 2 MiB memfd of 0xFF bytes, mapped copy-on-write over new buffers (poisoning a large
// buffer costs a few mmap calls instead of writing every page)
int poison_fd() {
  if (g_poison_fd != -2) return g_poison_fd;
  g_poison_fd = -1;
#ifdef MFD_CLOEXEC
  int fd = memfd_create("pnc_poison", MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(kPoisonChunk)) == 0) {
    void* p = mmap(nullptr, kPoisonChunk, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      memset(p, 0xff, kPoisonChunk);
      munmap(p, kPoisonChunk);
      g_poison_fd = fd;
    }
  }
#endif
  return g_poison_fd;
}

bool canary_ok(const Alloc& a, std::string* where) {
  const char* pre = a.map + page_size();
  for (size_t i = 0; i < kPreCanary; ++i) {
    if (static_cast<unsigned char>(pre[i]) != 0xffu) {
      char buf[200];
      snprintf(buf, sizeof buf, "%zu bytes before the start of a %zu-byte buffer at %p", kPreCanary - i, a.size,
               static_cast<void*>(a.data));
      *where = buf;
      return false;
    }
  }
  const char* end = a.map + a.map_size - page_size();
  for (const char* p = a.data + a.size; p < end; ++p) {
    if (static_cast<unsigned char>(*p) != 0xffu) {
      char buf[200];
      snprintf(buf, sizeof buf, "%zu bytes past the end of a %zu-byte buffer at %p", static_cast<size_t>(p - (a.data + a.size)),
               a.size, static_cast<void*>(a.data));
      *where = buf;
      return false;
    }
  }
  return true;
}

}  // namespace

static const unsigned char* first_not_ff(const unsigned char* lo, const unsigned char* hi) {
  for (const unsigned char* p = lo; p < hi; ++p) {
    if (*p != 0xffu) return p;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// what kernel threads call

extern "C" void pnc_syncthreads(const char* site) {
  Launch* L = g_launch;
  Fiber* f = L->running;
  f->site = site;
  f->state = AT_BARRIER;
  to_scheduler(f);
}

extern "C" void pnc_syncwarp(unsigned int mask) {
  Launch* L = g_launch;
  Fiber* f = L->running;
  warp_arrive(*L, *f, mask, -1, 32);
  if (f->state == AT_WARP || L->err.set) to_scheduler(f);
}

extern "C" uint64_t pnc_shfl(unsigned int mask, uint64_t value, int op, int arg, int width) {
  Launch* L = g_launch;
  Fiber* f = L->running;
  f->value = value;
  f->op = op;
  f->arg = arg;
  f->width = width;
  warp_arrive(*L, *f, mask, op, width);
  // the last lane to arrive completes the round (its state is READY again, and it was
  // queued first among its warp); every lane, that one included, returns to the scheduler
  to_scheduler(f);
  return f->result;
}

// ---------------------------------------------------------------------------
// the launcher's entry points

extern "C" {

// Run kernel `k` of module `mod` (dlopen handle `handle`) on a grid, writing an error
// message (and returning non-zero) on failure. schedule: 0 forward, 1 reverse.
// smem: the launch's dynamic shared memory bytes. timeout_s: wall-clock limit.
int pnc_launch(void* handle, const pnc_module* mod, int k, const unsigned* grid, const unsigned* block, size_t smem,
               void** slots, int schedule, double timeout_s, char* errbuf, size_t errlen) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  auto report = [&](const std::string& m) {
    snprintf(errbuf, errlen, "%s", m.c_str());
    return 1;
  };
  if (k < 0 || k >= mod->nkernels) return report("no such kernel");
  const size_t nthreads = static_cast<size_t>(block[0]) * block[1] * block[2];
  if (nthreads == 0 || nthreads > kMaxThreads) return report("block size out of range");
  if (!g_stacks.ensure(kMaxThreads)) return report("could not map fiber stacks");
  TlsRange tls;
  std::string why;
  if (!tls_range(handle, mod, &tls, &why)) return report(why);
  std::vector<pnc_dynamic_smem> dyn(static_cast<size_t>(mod->ndynamic));
  if (mod->ndynamic > 0) mod->dynamic_smem(dyn.data());  // this thread's addresses
  for (const pnc_dynamic_smem& d : dyn) {
    if (smem > d.size) return report("dynamic shared memory larger than the harness provides");
  }

  Launch L;
  L.kernel = &mod->kernels[k];
  L.slots = slots;
  L.reverse = schedule;
  L.nthreads = nthreads;
  L.fibers.resize(nthreads);
  L.warps.resize((nthreads + 31) / 32);
  for (size_t i = 0; i < nthreads; ++i) {
    Fiber& f = L.fibers[i];
    f.linear = static_cast<int>(i);
    f.t.tid.x = static_cast<unsigned>(i % block[0]);
    f.t.tid.y = static_cast<unsigned>((i / block[0]) % block[1]);
    f.t.tid.z = static_cast<unsigned>(i / (static_cast<size_t>(block[0]) * block[1]));
  }
  pnc_block_dim = dim3(block[0], block[1], block[2]);
  pnc_grid_dim = dim3(grid[0], grid[1], grid[2]);
  const size_t nblocks = static_cast<size_t>(grid[0]) * grid[1] * grid[2];

  g_launch = &L;
  g_fault_sig = 0;
  install_handlers();
  struct itimerval tv, old_tv;
  memset(&tv, 0, sizeof tv);
  tv.it_value.tv_sec = static_cast<time_t>(timeout_s);
  tv.it_value.tv_usec = static_cast<suseconds_t>((timeout_s - static_cast<double>(tv.it_value.tv_sec)) * 1e6);
  setitimer(ITIMER_REAL, &tv, &old_tv);

  // dynamic shared memory past the launch's size: read-only pages (a write faults at
  // once) and, for the part of a page after the launch's size, a check after each block
  struct Tail {
    unsigned char* check_lo;  // first byte past the launch's size
    unsigned char* prot_lo;   // whole pages made read-only: [prot_lo, prot_hi)
    unsigned char* prot_hi;
    unsigned char* end;       // end of the array; [check_lo, prot_lo) and [prot_hi, end) are checked
  };
  std::vector<Tail> tails;
  const uintptr_t ps = page_size();
  for (const pnc_dynamic_smem& d : dyn) {
    Tail t;
    t.check_lo = d.data + smem;
    t.end = d.data + d.size;
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(t.check_lo) + ps - 1) / ps * ps;
    const uintptr_t hi = reinterpret_cast<uintptr_t>(t.end) / ps * ps;
    t.prot_lo = lo < hi ? reinterpret_cast<unsigned char*>(lo) : t.end;
    t.prot_hi = lo < hi ? reinterpret_cast<unsigned char*>(hi) : t.end;
    tails.push_back(t);
  }
  // the parts of the thread-local block to poison before each block: all of it but the read-only pages
  std::vector<std::pair<unsigned char*, unsigned char*>> poison;
  unsigned char* const tls_end = tls.start + tls.size;
  memset(tls.start, 0xff, tls.size);
  {
    std::vector<std::pair<unsigned char*, unsigned char*>> holes;
    for (const Tail& t : tails) holes.emplace_back(t.prot_lo, t.prot_hi);
    std::sort(holes.begin(), holes.end());
    unsigned char* at = tls.start;
    for (const auto& h : holes) {
      unsigned char* a = std::min(std::max(h.first, tls.start), tls_end);
      if (a > at) poison.emplace_back(at, a);
      at = std::max(at, std::min(h.second, tls_end));
    }
    if (tls_end > at) poison.emplace_back(at, tls_end);
  }
  for (const Tail& t : tails) {
    if (t.prot_hi > t.prot_lo) mprotect(t.prot_lo, static_cast<size_t>(t.prot_hi - t.prot_lo), PROT_READ);
  }

  L.in_block = 1;
  if (sigsetjmp(L.fault_jmp, 1) == 0) {
    for (size_t b = 0; b < nblocks && !L.err.set; ++b) {
      const size_t lin = schedule ? nblocks - 1 - b : b;
      pnc_block_idx.x = static_cast<unsigned>(lin % grid[0]);
      pnc_block_idx.y = static_cast<unsigned>((lin / grid[0]) % grid[1]);
      pnc_block_idx.z = static_cast<unsigned>(lin / (static_cast<size_t>(grid[0]) * grid[1]));
      for (const auto& r : poison) memset(r.first, 0xff, static_cast<size_t>(r.second - r.first));
      run_block(L);
      for (const Tail& t : tails) {  // the bytes past the launch's size that are not read-only pages
        const unsigned char* bad = first_not_ff(t.check_lo, t.prot_lo);
        if (bad == nullptr) bad = first_not_ff(t.prot_hi, t.end);
        if (bad != nullptr) {
          L.fail("block (%u,%u,%u) wrote dynamic shared memory %zu bytes past the %zu bytes of the launch",
                 pnc_block_idx.x, pnc_block_idx.y, pnc_block_idx.z, static_cast<size_t>(bad - t.check_lo), smem);
        }
      }
    }
  } else {
    // a fault inside a kernel thread
    const Fiber* f = L.running;
    const char* what = g_fault_sig == SIGSEGV   ? "invalid memory access (SIGSEGV)"
                       : g_fault_sig == SIGBUS  ? "bus error (SIGBUS)"
                       : g_fault_sig == SIGILL  ? "trap (SIGILL: misaligned access or undefined behaviour caught by "
                                                  "-fsanitize, or __trap)"
                       : g_fault_sig == SIGFPE  ? "arithmetic exception (SIGFPE: integer division by zero)"
                       : g_fault_sig == SIGALRM ? "time limit exceeded (a thread never reached its end?)"
                                                : "signal";
    std::string who = f != nullptr ? describe_thread(*f) : std::string("the scheduler");
    size_t which = 0;
    std::string extra;
    const unsigned char* fa = static_cast<const unsigned char*>(const_cast<void*>(g_fault_addr));
    if (g_fault_sig == SIGSEGV && g_stacks.contains_guard(fa, &which)) {
      extra = " (the guard region below a thread's stack: stack overflow)";
    }
    for (const Tail& t : tails) {
      if (g_fault_sig == SIGSEGV && fa >= t.check_lo && fa < t.end) {
        char buf[160];
        snprintf(buf, sizeof buf, " (a write to dynamic shared memory %zu bytes past the %zu bytes of the launch)",
                 static_cast<size_t>(fa - t.check_lo), smem);
        extra = buf;
      }
    }
    L.err.set = false;
    L.fail("%s in %s at address %p%s", what, who.c_str(), static_cast<const void*>(fa), extra.c_str());
  }
  L.in_block = 0;
  for (const Tail& t : tails) {
    if (t.prot_hi > t.prot_lo) mprotect(t.prot_lo, static_cast<size_t>(t.prot_hi - t.prot_lo), PROT_READ | PROT_WRITE);
  }
  memset(&tv, 0, sizeof tv);
  setitimer(ITIMER_REAL, &old_tv, nullptr);
  remove_handlers();
  g_launch = nullptr;
  pnc_current = nullptr;
  if (L.err.set) return report(L.err.msg);
  return 0;
}

void* pnc_alloc(size_t size) {
  const size_t ps = page_size();
  const size_t body = (kPreCanary + size + kMinPostCanary + ps - 1) / ps * ps;
  const size_t total = body + 2 * ps;
  char* map = static_cast<char*>(mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (map == MAP_FAILED) return nullptr;
  char* bodyp = map + ps;
  int fd = poison_fd();
  bool ok = false;
  if (fd >= 0) {
    ok = true;
    for (size_t off = 0; off < body && ok; off += kPoisonChunk) {
      const size_t n = std::min(kPoisonChunk, body - off);
      void* p = mmap(bodyp + off, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
      ok = p != MAP_FAILED;
    }
  }
  if (!ok) {
    if (mprotect(bodyp, body, PROT_READ | PROT_WRITE) != 0) {
      munmap(map, total);
      return nullptr;
    }
    memset(bodyp, 0xff, body);
  }
  Alloc a;
  a.map = map;
  a.map_size = total;
  a.data = bodyp + kPreCanary;
  a.size = size;
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  g_allocs[reinterpret_cast<uintptr_t>(a.data)] = a;
  return a.data;
}

void pnc_free(void* data) {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  auto it = g_allocs.find(reinterpret_cast<uintptr_t>(data));
  if (it == g_allocs.end()) return;
  munmap(it->second.map, it->second.map_size);
  g_allocs.erase(it);
}

// The allocation holding address p: its data pointer and size (0 when p is in none).
size_t pnc_find_alloc(const void* p, void** data) {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return 0;
  --it;
  if (a >= it->first + it->second.size) {
    if (!(a == it->first && it->second.size == 0)) return 0;
  }
  *data = it->second.data;
  return it->second.size;
}

// Check the canaries of every live buffer; 0 when intact, else 1 with a message.
int pnc_check_canaries(char* errbuf, size_t errlen) {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  for (const auto& kv : g_allocs) {
    std::string where;
    if (!canary_ok(kv.second, &where)) {
      snprintf(errbuf, errlen, "a kernel wrote outside a device buffer: %s", where.c_str());
      return 1;
    }
  }
  return 0;
}

size_t pnc_live_allocations() {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  return g_allocs.size();
}

void pnc_f32_to_f16(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = pnc_conv::f32_to_f16(in[i]);
}
void pnc_f16_to_f32(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = pnc_conv::f16_to_f32(in[i]);
}
void pnc_f32_to_bf16(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = pnc_conv::f32_to_bf16(in[i]);
}
void pnc_bf16_to_f32(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = pnc_conv::bf16_to_f32(in[i]);
}
void pnc_f64_to_f16(const double* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = pnc_conv::f64_to_f16(in[i]);
}
void pnc_f64_to_bf16(const double* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = pnc_conv::f64_to_bf16(in[i]);
}

}  // extern "C"
