// The host device's kernel launcher: worker/cuda/kernels.cu compiled as C++ (with
// cuda_host.h), running a launch's blocks one after another, every thread of a block
// live at once as a fiber. Called from Rust (worker/src/gpu/host.rs) with the
// same packed arguments cuLaunchKernel takes: an array of pointers to each argument.

// Fibers switch with _setjmp/_longjmp between their own stacks (no signal-mask syscall
// per switch, unlike swapcontext); the fortified longjmp would refuse another stack.
#undef _FORTIFY_SOURCE

#include "cuda_host.h"

#include <csetjmp>

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../kernels.cu"

namespace hd {

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
dim3 block_dim;
dim3 grid_dim;

// Every thread of a block is a fiber (ucontext) with its own stack, all of them live at
// once and interleaved on one OS thread: a thread runs until it reaches a barrier, a warp
// collective or its end, then the next one runs. So a barrier really waits for every
// thread of the block, shared memory is really shared, and a read of shared memory that
// a missing __syncthreads leaves unordered sees the other threads' writes not done yet,
// deterministically. (OS threads per GPU thread were tried first: on a 2-core CI machine
// their context switches made a forward take seconds.)
constexpr size_t kStack = 128 * 1024;

struct Bar;

struct Fiber {
    ucontext_t start;   // used once per block, to enter fiber_main on the fiber's stack
    jmp_buf jb;         // where the fiber continues
    void* stack = nullptr;
    bool started = false, done = false;
    // Waiting at `wait_bar` until its generation moves past `wait_gen`.
    const Bar* wait_bar = nullptr;
    unsigned wait_gen = 0;
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
    Bar block_bar;
    jmp_buf scheduler;
    ucontext_t scheduler_ctx;
    unsigned current = 0;
};

// Never destroyed: leaked on purpose so nothing runs at process exit.
static Launch& g_launch = *new Launch;

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
        std::fprintf(stderr, "host device: a warp collective after some lanes of the warp returned (warp %u)\n", warp);
        std::abort();
    }
    uint64_t* slots = &L.warp_slots[warp * 32];
    slots[lane] = mine;
    bar_wait(L.warp_bars[warp]);
    const uint64_t r = slots[src & 31];
    bar_wait(L.warp_bars[warp]);
    return r;
}

static void fiber_main() {
    Launch& L = g_launch;
    const unsigned id = L.current;
    L.entry(L.args);
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

// Run every block of the launch, one after another.
static void run_blocks(unsigned long long blocks) {
    Launch& L = g_launch;
    const dim3 gd = grid_dim;
    for (unsigned long long blk = 0; blk < blocks; ++blk) {
        prepare_fibers();
        block_idx = uint3{(unsigned)(blk % gd.x), (unsigned)((blk / gd.x) % gd.y), (unsigned)(blk / ((unsigned long long)gd.x * gd.y))};
        for (;;) {
            unsigned live = 0, ran = 0;
            for (unsigned t = 0; t < L.threads; ++t) {
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
                std::fprintf(stderr, "host device: every live thread of a block waits at a barrier that can never open\n");
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
    std::lock_guard<std::mutex> g(hd::g_launch_mutex);
    hd::Launch& L = hd::g_launch;
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
    hd::run_blocks(blocks);
    return 0;
}
}
