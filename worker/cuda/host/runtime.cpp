// The host device's kernel launcher: worker/cuda/kernels.cu compiled as C++ (with
// cuda_host.h), running a launch's blocks one after another, every thread of a block
// live at once as a fiber, in an order drawn from a seed (the schedule, below). Called
// from Rust (worker/src/device/host.rs) with the same packed arguments cuLaunchKernel
// takes: an array of pointers to each argument.

// Fibers switch with _setjmp/_longjmp between their own stacks (no signal-mask syscall
// per switch, unlike swapcontext); the fortified longjmp would refuse another stack.
#undef _FORTIFY_SOURCE

#include "cuda_host.h"

#include <csetjmp>
#include <deque>

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// In an unnamed namespace, where no function is COMDAT (inline ones otherwise are): GCC
// refuses to put a COMDAT function's statics in the one section that cuda_host.h gives
// every __shared__ variable, next to the others.
namespace {
#include "../kernels.cu"
#include "../test_kernels.cu"
}  // namespace

// Every __shared__ variable of kernels.cu, from the first to the last (the linker brackets
// a section whose name is an identifier with these two symbols). Hidden: a shared library
// with a host device of its own (tests/emu-cuda) poisons its own section, not one that
// another module exports under the same name.
extern "C" __attribute__((visibility("hidden"))) unsigned char __start_hd_shared[], __stop_hd_shared[];

namespace hd {

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
dim3 block_dim;
dim3 grid_dim;

// ---------------------------------------------------------------------------------------
// The schedule. On a GPU the warps of a block, and the blocks of a grid, run in no order
// that a kernel may count on, and float atomics add in the order they arrive; a kernel
// that is right in one order only would pass here every time if every launch ran its
// fibers 0..N-1 and its blocks 0..n-1. So a launch runs its blocks in a shuffled order
// and resumes its threads in one of three orders: ascending, reversed, or shuffled (anew
// for every block). DFLASH_HD_ORDER picks one (ascending|reverse|random), or mixed, the
// default: one of the three per launch. DFLASH_HD_SEED (a decimal u64, else kDefaultSeed)
// seeds the shuffles and the picks. Both are read once. A launch's draws depend only on
// the seed and on the number of launches its thread made before it, so a run repeats
// exactly, test by test (each test is a thread), and a failure the host device detects
// itself names the schedule to repeat it with.
enum class Order { ascending, reverse, random, mixed };
constexpr const char* kOrderNames[] = {"ascending", "reverse", "random", "mixed"};
constexpr uint64_t kDefaultSeed = 0x5eed;

struct Schedule {
    Order order = Order::mixed;
    uint64_t seed = kDefaultSeed;
};

static bool parse_order(const char* s, Order* o) {
    for (int i = 0; i < 4; ++i)
        if (std::strcmp(s, kOrderNames[i]) == 0) {
            *o = (Order)i;
            return true;
        }
    return false;
}

// splitmix64's finalizer: a bijection of 64-bit words in which every bit moves every other.
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// splitmix64: plenty for shuffles, and the same sequence from a seed on every machine
// (std::shuffle's distributions are the library's own).
struct Rng {
    uint64_t s;
    uint64_t next() { return mix64(s += 0x9E3779B97F4A7C15ull); }
    // Uniform in [0, n): the high word of a 128-bit product (Lemire; bias below n / 2^64).
    uint64_t below(uint64_t n) { return (uint64_t)(((unsigned __int128)next() * n) >> 64); }
    template <class T>
    void shuffle(std::vector<T>& v) {
        for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
    }
};

// The environment's schedule, or why it is refused (every launch then fails with that).
struct EnvSchedule {
    Schedule s;
    std::string error;
};

static EnvSchedule read_env_schedule() {
    EnvSchedule e;
    if (const char* o = std::getenv("DFLASH_HD_ORDER"); o && *o && !parse_order(o, &e.s.order))
        e.error = std::string("DFLASH_HD_ORDER=") + o + ": expected ascending, reverse, random or mixed";
    if (const char* v = std::getenv("DFLASH_HD_SEED"); v && *v) {
        char* end = nullptr;
        errno = 0;
        const unsigned long long x = std::strtoull(v, &end, 10);
        // strtoull also takes blanks, a sign, and wraps a negative number around.
        if (*v < '0' || *v > '9' || *end || errno) e.error = std::string("DFLASH_HD_SEED=") + v + ": expected a decimal 64-bit unsigned integer";
        else e.s.seed = x;
    }
    return e;
}

static const EnvSchedule& env_schedule() {
    static const EnvSchedule& e = *new EnvSchedule(read_env_schedule());  // leaked, as g_launch
    return e;
}

// The calling thread's own schedule once a test set one (dflash_hd_set_schedule), the
// launches it made (numbered from 0), how its last one ran (dflash_hd_last_schedule), and
// the shared memory its last one left, when a test asked for it (dflash_hd_keep_shared).
thread_local bool t_schedule_set = false;
thread_local Schedule t_schedule;
thread_local uint64_t t_launches = 0;
thread_local Order t_last_order = Order::mixed;
thread_local std::vector<unsigned> t_last_threads;
thread_local std::vector<unsigned long long> t_last_blocks;
thread_local bool t_keep_shared = false;
thread_local std::vector<unsigned char> t_last_shared;

// What a launch drew: the order of its threads (never mixed), and the draws still to come.
struct Draw {
    Schedule s;
    uint64_t launch;
    Order order;
    Rng rng;
};

static Draw draw_schedule(const Schedule& s) {
    const uint64_t launch = t_launches++;
    Draw d{s, launch, s.order, Rng{mix64(s.seed ^ mix64(launch))}};
    if (d.order == Order::mixed) d.order = (Order)d.rng.below(3);
    return d;
}

// Before each block: every kernel's shared memory to 0xFF bytes (see cuda_host.h). All
// of it, not just the running kernel's, as the section does not say which is whose; at
// the few tens of KiB the attention kernels take, a block's fibers cost far more.
static void poison_shared() { std::memset(__start_hd_shared, 0xFF, (size_t)(__stop_hd_shared - __start_hd_shared)); }

// ---------------------------------------------------------------------------------------
// Fibers and barriers.

// Every thread of a block is a fiber (ucontext) with its own stack, all of them live at
// once and interleaved on one OS thread: a thread runs until it reaches a barrier, a warp
// collective or its end, then the next one runs. So a barrier really waits for every
// thread of the block, shared memory is really shared, and a read of shared memory that
// a missing __syncthreads leaves unordered sees other threads' writes not done yet
// (which ones, the schedule decides). (OS threads per GPU thread were tried first: on a
// 2-core CI machine their context switches made a forward take seconds.)
constexpr size_t kStack = 128 * 1024;

struct Bar;

// A cp.async in flight: its destination, and the 16 bytes it read at issue.
struct AsyncCopy {
    unsigned char* dst;
    int bytes;
    unsigned char data[16];
};

struct Fiber {
    ucontext_t start;   // used once per block, to enter fiber_main on the fiber's stack
    jmp_buf jb;         // where the fiber continues
    void* stack = nullptr;
    bool started = false, done = false;
    // Waiting at `wait_bar` until its generation moves past `wait_gen`.
    const Bar* wait_bar = nullptr;
    unsigned wait_gen = 0;
    // Its cp.async copies: issued since its last commit_group, and the committed groups
    // not yet waited for (oldest first).
    std::vector<AsyncCopy> open_copies;
    std::deque<std::vector<AsyncCopy>> copy_groups;
};

// A barrier for `n` fibers, from which fibers that have returned drop out.
struct Bar {
    int n = 0, arrived = 0, exited = 0;
    unsigned gen = 0;
    void reset(int count) {
        n = count;
        arrived = exited = 0;
    }
};

struct Launch {
    void (*entry)(void**) = nullptr;
    void** args = nullptr;
    unsigned threads = 0;
    std::vector<Fiber> fibers;
    std::vector<Bar> warp_bars;
    std::vector<uint64_t> warp_slots;  // 32 per warp
    std::vector<uint32_t> warp_words;  // 32 · kGatherWords per warp (warp_allgather)
    Bar block_bar;
    jmp_buf scheduler;
    ucontext_t scheduler_ctx;
    unsigned current = 0;
    // The threads in the order the scheduler resumes them, and the blocks in the order
    // they run (linear indices); the kernel and its schedule, for messages.
    std::vector<unsigned> order;
    std::vector<unsigned long long> blocks;
    const char* kernel = nullptr;
    Schedule schedule;
    uint64_t launch = 0;
    Order thread_order = Order::ascending;
};

// Never destroyed: leaked on purpose so nothing runs at process exit.
static Launch& g_launch = *new Launch;

// Where the running block stands and how to repeat its schedule, for a failure's message.
static std::string where() {
    const Launch& L = g_launch;
    char b[320];
    std::snprintf(b, sizeof b, "%s, block (%u, %u, %u), threads resumed in %s order; launch %llu of its thread under DFLASH_HD_ORDER=%s DFLASH_HD_SEED=%llu",
                  L.kernel, block_idx.x, block_idx.y, block_idx.z, kOrderNames[(int)L.thread_order], (unsigned long long)L.launch,
                  kOrderNames[(int)L.schedule.order], (unsigned long long)L.schedule.seed);
    return b;
}

static void yield_to_scheduler() {
    Launch& L = g_launch;
    if (!_setjmp(L.fibers[L.current].jb)) _longjmp(L.scheduler, 1);
}

static void bar_wait(Bar& b) {
    const unsigned gen = b.gen;
    if (++b.arrived + b.exited >= b.n) {
        b.arrived = 0;
        ++b.gen;
        return;
    }
    Fiber& f = g_launch.fibers[g_launch.current];
    f.wait_bar = &b;
    f.wait_gen = gen;
    while (b.gen == gen) yield_to_scheduler();
    f.wait_bar = nullptr;
}

static void bar_exit(Bar& b) {
    ++b.exited;
    if (b.arrived > 0 && b.arrived + b.exited >= b.n) {
        b.arrived = 0;
        ++b.gen;
    }
}

void syncthreads() { bar_wait(g_launch.block_bar); }

uint64_t warp_exchange(uint64_t mine, int src) {
    Launch& L = g_launch;
    const unsigned warp = L.current / 32, lane = L.current % 32;
    if (L.warp_bars[warp].exited > 0) {
        // Undefined on a GPU (a full-mask collective with lanes gone): refuse it here.
        std::fprintf(stderr, "host device: a warp collective after some lanes of the warp returned (warp %u; %s)\n", warp, where().c_str());
        std::abort();
    }
    uint64_t* slots = &L.warp_slots[warp * 32];
    slots[lane] = mine;
    bar_wait(L.warp_bars[warp]);
    const uint64_t r = slots[src & 31];
    bar_wait(L.warp_bars[warp]);
    return r;
}

constexpr int kGatherWords = 16;

void warp_allgather(const uint32_t* mine, int n, uint32_t* all) {
    Launch& L = g_launch;
    const unsigned warp = L.current / 32, lane = L.current % 32;
    if (n < 1 || n > kGatherWords) {
        std::fprintf(stderr, "host device: warp_allgather of %d words (1..%d; %s)\n", n, kGatherWords, where().c_str());
        std::abort();
    }
    if (L.warp_bars[warp].exited > 0) {
        std::fprintf(stderr, "host device: a warp collective (mma/ldmatrix) after some lanes of the warp returned (warp %u; %s)\n", warp, where().c_str());
        std::abort();
    }
    uint32_t* words = &L.warp_words[(size_t)warp * 32 * kGatherWords];
    std::memcpy(&words[lane * kGatherWords], mine, sizeof(uint32_t) * n);
    bar_wait(L.warp_bars[warp]);
    for (int l = 0; l < 32; ++l) std::memcpy(&all[l * n], &words[l * kGatherWords], sizeof(uint32_t) * n);
    bar_wait(L.warp_bars[warp]);
}

void check_space(const void* p, size_t bytes, bool shared, size_t align, const char* what) {
    const unsigned char* c = (const unsigned char*)p;
    const bool inside = c >= __start_hd_shared && c + bytes <= __stop_hd_shared;
    const bool outside = c + bytes <= __start_hd_shared || c >= __stop_hd_shared;
    if ((shared ? inside : outside) && (uintptr_t)p % align == 0) return;
    std::fprintf(stderr, "host device: %s %p (%zu bytes) is not %zu-byte aligned %s memory (%s)\n", what, p, bytes, align, shared ? "shared" : "global",
                 where().c_str());
    std::abort();
}

void cp_async(void* dst, const void* src, int bytes, const char* what) {
    check_space(dst, (size_t)bytes, true, (size_t)bytes, what);
    check_space(src, (size_t)bytes, false, (size_t)bytes, what);
    AsyncCopy c{(unsigned char*)dst, bytes, {}};
    std::memcpy(c.data, src, (size_t)bytes);
    std::memset(dst, 0xFF, (size_t)bytes);
    g_launch.fibers[g_launch.current].open_copies.push_back(c);
}

void cp_async_commit() {
    Fiber& f = g_launch.fibers[g_launch.current];
    f.copy_groups.push_back(std::move(f.open_copies));
    f.open_copies.clear();
}

void cp_async_wait(int pending) {
    Fiber& f = g_launch.fibers[g_launch.current];
    while ((int)f.copy_groups.size() > pending) {
        for (const AsyncCopy& c : f.copy_groups.front()) std::memcpy(c.dst, c.data, (size_t)c.bytes);
        f.copy_groups.pop_front();
    }
}

static void fiber_main() {
    Launch& L = g_launch;
    const unsigned id = L.current;
    L.entry(L.args);
    {
        const Fiber& f = L.fibers[id];
        size_t left = f.open_copies.size();
        for (const auto& g : f.copy_groups) left += g.size();
        if (left) {
            // Not an error on a GPU, but a copy that nothing waits for is nothing anyone
            // may read: a kernel of ours that leaves one has lost a wait.
            std::fprintf(stderr, "host device: thread %u returned with %zu cp.async copies not waited for (%s)\n", id, left, where().c_str());
            std::abort();
        }
    }
    bar_exit(L.block_bar);
    bar_exit(L.warp_bars[id / 32]);
    L.fibers[id].done = true;
    _longjmp(L.scheduler, 1);
}

static void prepare_fibers() {
    Launch& L = g_launch;
    L.block_bar.reset((int)L.threads);
    for (unsigned w = 0; w < L.threads / 32; ++w) L.warp_bars[w].reset(32);
    for (unsigned t = 0; t < L.threads; ++t) {
        Fiber& f = L.fibers[t];
        f.started = f.done = false;
        f.wait_bar = nullptr;
        f.open_copies.clear();
        f.copy_groups.clear();
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = f.stack;
        f.start.uc_stack.ss_size = kStack;
        f.start.uc_link = nullptr;
        makecontext(&f.start, fiber_main, 0);
    }
}

// Resume fiber t until it yields or ends.
static void resume(unsigned t) {
    Launch& L = g_launch;
    Fiber& f = L.fibers[t];
    L.current = t;
    const dim3 b = block_dim;
    thread_idx = uint3{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
    if (!_setjmp(L.scheduler)) {
        if (!f.started) {
            f.started = true;
            swapcontext(&L.scheduler_ctx, &f.start);
        } else {
            _longjmp(f.jb, 1);
        }
    }
}

// Run every block of the launch, one after another, in the order drawn, each from
// poisoned shared memory, its threads resumed in the order drawn.
static void run_blocks(unsigned long long blocks, Draw& d) {
    Launch& L = g_launch;
    const dim3 gd = grid_dim;
    L.blocks.resize(blocks);
    std::iota(L.blocks.begin(), L.blocks.end(), 0ull);
    d.rng.shuffle(L.blocks);
    L.order.resize(L.threads);
    for (unsigned i = 0; i < L.threads; ++i) L.order[i] = d.order == Order::reverse ? L.threads - 1 - i : i;
    for (const unsigned long long blk : L.blocks) {
        if (d.order == Order::random) d.rng.shuffle(L.order);
        if (blk == L.blocks[0]) t_last_threads = L.order;
        poison_shared();
        prepare_fibers();
        block_idx = uint3{(unsigned)(blk % gd.x), (unsigned)((blk / gd.x) % gd.y), (unsigned)(blk / ((unsigned long long)gd.x * gd.y))};
        for (;;) {
            unsigned live = 0, ran = 0;
            for (const unsigned t : L.order) {
                Fiber& f = L.fibers[t];
                if (f.done) continue;
                ++live;
                // Still waiting at a barrier nobody has released: nothing to do yet.
                if (f.wait_bar && f.wait_bar->gen == f.wait_gen) continue;
                ++ran;
                resume(t);
            }
            if (live == 0) break;
            if (ran == 0) {
                std::fprintf(stderr, "host device: every live thread of a block waits at a barrier that can never open (%s)\n", where().c_str());
                std::abort();
            }
        }
    }
}

static std::mutex& g_launch_mutex = *new std::mutex;

// Call `f` with its arguments read from cuLaunchKernel-style packed pointers.
template <class... A, std::size_t... I>
void call_packed(void (*f)(A...), void** a, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(a[I])...);
}
template <class... A>
void call(void (*f)(A...), void** a) {
    call_packed(f, a, std::index_sequence_for<A...>{});
}

struct Entry {
    const char* name;
    void (*entry)(void**);
    // One letter per parameter: p pointer, i 4-byte integer, l 8-byte integer, f float,
    // d double. The launcher checks the arguments against it, which is what a GPU launch
    // needs (cuLaunchKernel copies each parameter's size from the pointer it is given).
    const char* sig;
};

template <class T>
constexpr char kind_of() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_floating_point_v<T>) return sizeof(T) == 4 ? 'f' : 'd';
    else return sizeof(T) == 8 ? 'l' : 'i';
}

template <class... A>
const char* sig_of(void (*)(A...)) {
    static const char s[] = {kind_of<A>()..., 0};
    return s;
}

#define HD_KERNEL(k) {#k, [](void** a) { call(k, a); }, sig_of(k)},
static const Entry g_kernels[] = {
#include "kernel_table.inc"
};
#undef HD_KERNEL

}  // namespace hd

extern "C" {

// Number of kernels, and the name and parameter count of kernel i.
int dflash_hd_kernel_count() { return (int)(sizeof(hd::g_kernels) / sizeof(hd::g_kernels[0])); }
const char* dflash_hd_kernel_name(int i) { return hd::g_kernels[i].name; }
const char* dflash_hd_kernel_sig(int i) { return hd::g_kernels[i].sig; }

// Run kernel `index` over `grid` blocks of `block` threads. Returns 0, or writes a
// message into `err` and returns non-zero.
int dflash_hd_launch(int index, const unsigned* grid, const unsigned* block, void** args, char* err, size_t errlen) {
    if (index < 0 || index >= dflash_hd_kernel_count()) {
        std::snprintf(err, errlen, "no kernel #%d", index);
        return 1;
    }
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024 || threads % 32 != 0) {
        std::snprintf(err, errlen, "%s: %u threads per block (expected a multiple of 32, at most 1024)", hd::g_kernels[index].name, threads);
        return 1;
    }
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    if (blocks == 0) return 0;
    const hd::EnvSchedule& env = hd::env_schedule();
    if (!hd::t_schedule_set && !env.error.empty()) {
        std::snprintf(err, errlen, "%s", env.error.c_str());
        return 1;
    }
    hd::Draw d = hd::draw_schedule(hd::t_schedule_set ? hd::t_schedule : env.s);
    std::lock_guard<std::mutex> g(hd::g_launch_mutex);
    hd::Launch& L = hd::g_launch;
    L.kernel = hd::g_kernels[index].name;
    L.schedule = d.s;
    L.launch = d.launch;
    L.thread_order = d.order;
    L.entry = hd::g_kernels[index].entry;
    L.args = args;
    L.threads = threads;
    hd::block_dim = dim3(block[0], block[1], block[2]);
    hd::grid_dim = dim3(grid[0], grid[1], grid[2]);
    while (L.fibers.size() < threads) {
        hd::Fiber f;
        f.stack = mmap(nullptr, hd::kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f.stack == MAP_FAILED) {
            std::snprintf(err, errlen, "cannot map a %zu-byte fiber stack", hd::kStack);
            return 1;
        }
        L.fibers.push_back(f);
    }
    L.warp_bars.resize(std::max<size_t>(L.warp_bars.size(), threads / 32));
    L.warp_slots.resize(std::max<size_t>(L.warp_slots.size(), threads));
    L.warp_words.resize(std::max<size_t>(L.warp_words.size(), (size_t)threads * hd::kGatherWords));
    hd::run_blocks(blocks, d);
    hd::t_last_order = d.order;
    hd::t_last_blocks = L.blocks;
    // Under the lock: another thread's launch would write the same shared memory.
    if (hd::t_keep_shared) hd::t_last_shared.assign(__start_hd_shared, __stop_hd_shared);
    return 0;
}

// For tests. The calling thread's launches from its next one on run under this schedule
// (`order`: ascending, reverse, random or mixed), numbered from 0 again; `order` null:
// under the environment's again. Returns 0, or 1 for an order it does not know.
int dflash_hd_set_schedule(const char* order, unsigned long long seed) {
    hd::Order o = hd::Order::mixed;
    if (order && !hd::parse_order(order, &o)) return 1;
    hd::t_schedule_set = order != nullptr;
    hd::t_schedule = hd::Schedule{o, seed};
    hd::t_launches = 0;
    return 0;
}

// For tests: how the calling thread's last launch ran. Returns the order its threads
// were resumed in (0 ascending, 1 reverse, 2 random; -1 before any launch), and copies
// that order for its first block into threads[..nthreads] and the order its blocks ran
// in (linear indices) into blocks[..nblocks], as much of them as there is room for.
int dflash_hd_last_schedule(unsigned* threads, size_t nthreads, unsigned long long* blocks, size_t nblocks) {
    if (hd::t_last_order == hd::Order::mixed) return -1;
    std::copy_n(hd::t_last_threads.begin(), std::min(nthreads, hd::t_last_threads.size()), threads);
    std::copy_n(hd::t_last_blocks.begin(), std::min(nblocks, hd::t_last_blocks.size()), blocks);
    return (int)hd::t_last_order;
}

// For tests: from now on, each launch of the calling thread keeps a copy of the shared
// memory of every kernel (which each block starts with poisoned) as its last block left
// it. Returns the copy that the last launch kept, and its size.
size_t dflash_hd_keep_shared(const unsigned char** copy) {
    hd::t_keep_shared = true;
    *copy = hd::t_last_shared.data();
    return hd::t_last_shared.size();
}
}
