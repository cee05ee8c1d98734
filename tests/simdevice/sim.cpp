// sim: a simulated asynchronous accelerator on PrivateUse1, for tests only.
//
// Pieces, in order: controls and the host-sync counter; streams (one worker thread each) and events;
// device memory protection; the caching device allocator; the pinned host allocator; the device guard;
// the hooks; the kernels (empty, views, copies, the boxed CPU fallback); the Python bindings.
//
// [Note: what "device memory" means here]
// Device memory is host memory obtained with mmap, one mapping per allocator segment. Only the device
// (a stream's worker thread executing a queued item) may touch it. With the `protect` control on, every
// segment is PROT_NONE except while some worker executes an item ("the device window"): the first worker
// to start an item opens the window for all segments, the last one to finish closes it. A host read or
// write of device bytes while no item runs therefore dies with SIGSEGV. The window is process-wide
// (mprotect cannot be per thread), so a host access that happens while a worker runs is not caught; the
// worker hold and the delays make such windows short and the tests deterministic.
//
// [Note: which waits count as host synchronisations]
// Every time the host blocks on device work: stream, event and device synchronize, a copy that is not
// asynchronous (pageable host memory, or non_blocking=False), and an op whose result the host must read
// (item(), nonzero, equal, ...). The synchronous mode's own waits after each op are not counted: they are
// the simulator's mode, not the program's. This matches what CUDA's sync-debug mode reports.

#include <cmath>
#include <cstring>
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/python.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

namespace sim {

using Clock = std::chrono::steady_clock;
constexpr c10::DeviceType kSim = c10::DeviceType::PrivateUse1;

// ---------------------------------------------------------------------------------------------------
// Controls. Read by every thread, written by Python between (or during) runs: atomics, no lock.
struct Controls {
  std::atomic<double> copy_bandwidth{0.0};  // bytes per second a host<->device copy moves; 0 = instant
  std::atomic<double> device_copy_bandwidth{0.0};  // the same within the device (HBM); 0 = instant
  std::atomic<double> copy_delay{0.0};      // seconds added to every copy
  std::atomic<double> compute_delay{0.0};   // seconds added to every queued op
  std::atomic<bool> protect{false};         // PROT_NONE device memory outside the device window
  std::atomic<bool> asynchronous{true};     // ops return before their kernel ran
  std::atomic<bool> memory_info{true};      // getMemoryInfo answers (else raises, as without one)
  std::atomic<int64_t> capacity{int64_t(4) << 30};  // device bytes the allocator may reserve
  std::atomic<double> wait_timeout{120.0};  // a host wait longer than this raises (a held stream?)
};
Controls g_controls;
std::atomic<int64_t> g_host_syncs{0};

// Host threads blocked in a wait on the device right now, by pthread id (Python's
// threading.get_ident()): a test releases a stream's hold once the host really waits for it
// (simdevice.waiting_threads).  Registered only when the wait must block (its item or event not
// done yet); a stream worker's queued event wait is the device waiting, not the host.
// Owner: g_waiting_mu (taken after a stream's or an event's own mutex, never before).
std::mutex g_waiting_mu;
std::multiset<uint64_t> g_waiting;

struct HostWaiting {
  const uint64_t id = uint64_t(pthread_self());
  HostWaiting() {
    std::lock_guard<std::mutex> g(g_waiting_mu);
    g_waiting.insert(id);
  }
  ~HostWaiting() {
    std::lock_guard<std::mutex> g(g_waiting_mu);
    g_waiting.erase(g_waiting.find(id));
  }
};

std::vector<uint64_t> waiting_threads() {
  std::lock_guard<std::mutex> g(g_waiting_mu);
  return {g_waiting.begin(), g_waiting.end()};
}

void sleep_for_seconds(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

// A copy within the device runs at device memory speed, not at the host link's (on an H200, HBM's
// 4.8 TB/s against PCIe Gen5's 64 GB/s): its own rate.
double copy_seconds(size_t nbytes, bool within_device = false) {
  double bw = (within_device ? g_controls.device_copy_bandwidth : g_controls.copy_bandwidth).load();
  return g_controls.copy_delay.load() + (bw > 0 ? double(nbytes) / bw : 0.0);
}

// ---------------------------------------------------------------------------------------------------
// Device window (see the note at the top). Owner: g_prot_mu guards g_segments and g_window_depth.
std::mutex g_prot_mu;
std::map<void*, size_t> g_segments;  // every live device mapping: base -> length
int g_window_depth = 0;

int device_protection_locked() {
  return (g_controls.protect.load() && g_window_depth == 0) ? PROT_NONE : (PROT_READ | PROT_WRITE);
}

void apply_protection_locked() {
  int prot = device_protection_locked();
  for (auto& [base, len] : g_segments) TORCH_CHECK(mprotect(base, len, prot) == 0, "sim: mprotect failed");
}

struct DeviceWindow {  // RAII: the device is executing; device memory is accessible
  DeviceWindow() {
    std::lock_guard<std::mutex> g(g_prot_mu);
    if (g_window_depth++ == 0 && g_controls.protect.load()) apply_protection_locked();
  }
  ~DeviceWindow() {
    std::lock_guard<std::mutex> g(g_prot_mu);
    if (--g_window_depth == 0 && g_controls.protect.load()) apply_protection_locked();
  }
};

void* map_segment(size_t len) {
  std::lock_guard<std::mutex> g(g_prot_mu);
  void* p = mmap(nullptr, len, device_protection_locked(), MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "sim: mmap of ", len, " bytes failed");
  g_segments[p] = len;
  return p;
}

void unmap_segment(void* p) {
  std::lock_guard<std::mutex> g(g_prot_mu);
  auto it = g_segments.find(p);
  TORCH_INTERNAL_ASSERT(it != g_segments.end());
  munmap(p, it->second);
  g_segments.erase(it);
}

void set_protect(bool on) {
  std::lock_guard<std::mutex> g(g_prot_mu);
  g_controls.protect = on;
  apply_protection_locked();
}

// ---------------------------------------------------------------------------------------------------
// Streams. Each stream owns one worker thread that runs its queued items in order. `enqueued` counts
// items ever queued, `completed` items finished; an item's sequence number is `enqueued` after queueing
// it, so "item n is done" is `completed >= n`. Streams are never destroyed (threads are detached at exit).
std::mutex g_error_mu;
std::string g_device_error;  // first exception an item raised; reported by the next host wait

struct Stream {
  explicit Stream(c10::StreamId id) : id(id), worker([this] { run(); }) { worker.detach(); }

  uint64_t enqueue(std::function<void()> item) {
    std::lock_guard<std::mutex> g(mu);
    queue.push_back(std::move(item));
    cv.notify_all();
    return ++enqueued;
  }

  uint64_t last_enqueued() {
    std::lock_guard<std::mutex> g(mu);
    return enqueued;
  }

  bool done(uint64_t seq) {
    std::lock_guard<std::mutex> g(mu);
    return completed >= seq;
  }

  void wait(uint64_t seq);  // host wait for item `seq`; defined after host_wait_failed

  void set_held(bool on) {
    std::lock_guard<std::mutex> g(mu);
    held = on;
    cv.notify_all();
  }

  const c10::StreamId id;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0, completed = 0;
  bool held = false;  // the worker does not start its next item while held
  std::thread worker;

 private:
  // The worker keeps the device window open from its first item to the moment it runs out of work
  // (or is held), not per item: toggling protection per op made protected runs 10x slower. It closes
  // the window before it marks its last item complete, so a host that has waited for the device sees
  // device memory protected again.
  void run() {
    std::optional<DeviceWindow> window;
    for (;;) {
      std::function<void()> item;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !queue.empty() && !held; });
        item = std::move(queue.front());
        queue.pop_front();
      }
      if (!window) window.emplace();
      try {
        item();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(g_error_mu);
        if (g_device_error.empty()) g_device_error = e.what();
        fprintf(stderr, "sim: a queued item on stream %lld failed: %s\n", (long long)id, e.what());
      } catch (...) {
        std::lock_guard<std::mutex> g(g_error_mu);
        if (g_device_error.empty()) g_device_error = "unknown exception";
      }
      std::lock_guard<std::mutex> g(mu);
      if (queue.empty() || held) window.reset();
      ++completed;
      cv.notify_all();
    }
  }
};

void raise_device_error() {
  std::lock_guard<std::mutex> g(g_error_mu);
  if (g_device_error.empty()) return;
  std::string msg = g_device_error;
  g_device_error.clear();
  TORCH_CHECK(false, "sim: an earlier queued op failed on the device: ", msg);
}

void Stream::wait(uint64_t seq) {
  std::unique_lock<std::mutex> lk(mu);
  auto timeout = std::chrono::duration<double>(g_controls.wait_timeout.load());
  bool ok = completed >= seq;
  if (!ok) {
    HostWaiting waiting;
    ok = cv.wait_for(lk, timeout, [&] { return completed >= seq; });
  }
  lk.unlock();
  TORCH_CHECK(ok, "sim: a host wait on stream ", id, " timed out after ", timeout.count(),
              " s (is the stream held by simdevice.hold?)");
  raise_device_error();
}

// Stream table. Owner: g_streams_mu. Id 0 is the default stream; 1..kPoolSize the global pool;
// getNewStream hands out ids from kFirstNewId upwards.
constexpr int kPoolSize = 8;
constexpr c10::StreamId kFirstNewId = 100;
std::mutex g_streams_mu;
std::unordered_map<c10::StreamId, Stream*> g_streams;
c10::StreamId g_next_new_id = kFirstNewId;
std::atomic<int> g_pool_cursor{0};
thread_local c10::StreamId t_current_stream = 0;

Stream* stream_by_id(c10::StreamId id) {
  std::lock_guard<std::mutex> g(g_streams_mu);
  auto it = g_streams.find(id);
  if (it != g_streams.end()) return it->second;
  TORCH_CHECK(id >= 0 && (id <= kPoolSize || (id >= kFirstNewId && id < g_next_new_id)) ,
              "sim: no stream with id ", id);
  Stream* s = new Stream(id);  // leaked on purpose: streams live as long as the process
  g_streams[id] = s;
  return s;
}

Stream* current_stream() { return stream_by_id(t_current_stream); }

std::vector<Stream*> all_streams() {
  std::lock_guard<std::mutex> g(g_streams_mu);
  std::vector<Stream*> out;
  for (auto& kv : g_streams) out.push_back(kv.second);
  return out;
}

void synchronize_device(bool counted) {
  if (counted) ++g_host_syncs;
  for (Stream* s : all_streams()) s->wait(s->last_enqueued());
}

// Events. An event's state is replaced at every record, so a wait captured earlier keeps waiting for
// the record it saw (CUDA semantics). Never recorded: complete.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Clock::time_point when;
};

struct Event {
  std::shared_ptr<EventState> state;
};

void complete(EventState& st) {
  std::lock_guard<std::mutex> g(st.mu);
  st.when = Clock::now();
  st.done = true;
  st.cv.notify_all();
}

// `host`: the host waits (registered in g_waiting while blocked), not a stream's worker.
void wait_state(EventState& st, bool host) {
  std::unique_lock<std::mutex> lk(st.mu);
  auto timeout = std::chrono::duration<double>(g_controls.wait_timeout.load());
  bool ok = st.done;
  if (!ok) {
    std::optional<HostWaiting> waiting;
    if (host) waiting.emplace();
    ok = st.cv.wait_for(lk, timeout, [&] { return st.done; });
  }
  TORCH_CHECK(ok, "sim: a wait on an event timed out (is its stream held by simdevice.hold?)");
}

// ---------------------------------------------------------------------------------------------------
// Caching device allocator.
// [Note: reuse rules] A block belongs to the stream current when it was allocated. When freed it goes
// back to that stream's pool and only an allocation on the same stream reuses it (stream order makes that
// safe). If it was used on other streams (record_stream), the free is deferred: the block joins its pool
// only once every item those streams had queued at free time has completed. Blocks are never split; a
// request is rounded up to 512 bytes and reuses a cached block of exactly that size.
// Owner: Allocator::mu guards everything below it.
struct Block {
  void* ptr;
  size_t size;
  c10::StreamId stream;
  std::set<c10::StreamId> used_on;  // other streams that used it (record_stream)
  size_t requested = 0;             // the bytes asked for by the allocation holding it now
};

struct Pending {
  Block* block;
  std::vector<std::pair<Stream*, uint64_t>> wait_for;
};

struct DeviceAllocator final : public c10::DeviceAllocator {
  at::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &no_delete, c10::Device(kSim, 0)};
    Block* b = malloc_block(nbytes);
    return {b->ptr, b, &delete_block, c10::Device(kSim, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    uint64_t seq = current_stream()->enqueue([=] {
      DeviceWindow w;
      std::memcpy(dest, src, count);
    });
    current_stream()->wait(seq);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {
    synchronize_device(false);  // a cached block may still be read by its stream's queued items
    std::lock_guard<std::mutex> g(mu);
    collect_pending_locked();
    release_cached_locked();
  }
  void recordStream(const at::DataPtr& ptr, c10::Stream stream) override {
    if (!ptr.get_context()) return;
    std::lock_guard<std::mutex> g(mu);
    Block* b = static_cast<Block*>(ptr.get_context());
    if (stream.id() != b->stream) b->used_on.insert(stream.id());
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    std::lock_guard<std::mutex> g(mu);
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {
    std::lock_guard<std::mutex> g(mu);
    for (auto* s : {&stats.allocation, &stats.segment, &stats.active, &stats.allocated_bytes,
                    &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes})
      for (auto& st : *s) st.reset_accumulated();
  }
  void resetPeakStats(c10::DeviceIndex) override {
    std::lock_guard<std::mutex> g(mu);
    for (auto* s : {&stats.allocation, &stats.segment, &stats.active, &stats.allocated_bytes,
                    &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes})
      for (auto& st : *s) st.reset_peak();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex) override {
    TORCH_CHECK_NOT_IMPLEMENTED(g_controls.memory_info.load(),
                                "getMemoryInfo is not implemented for this allocator yet.");
    std::lock_guard<std::mutex> g(mu);
    size_t total = size_t(g_controls.capacity.load());
    size_t reserved = size_t(stats.reserved_bytes[0].current);
    return {reserved > total ? 0 : total - reserved, total};
  }

  bool owns(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return find_segment_locked(p) != nullptr;
  }

 private:
  static void no_delete(void*) {}
  static void delete_block(void* ctx);

  Block* find_segment_locked(const void* p) {
    auto it = live.upper_bound(const_cast<void*>(p));
    if (it != live.begin()) {
      --it;
      if ((char*)p < (char*)it->first + it->second->size) return it->second;
    }
    for (auto& kv : cached)
      for (Block* b : kv.second)
        if (p >= b->ptr && (char*)p < (char*)b->ptr + b->size) return b;
    return nullptr;
  }

  Block* malloc_block(size_t nbytes) {
    size_t size = (nbytes + 511) / 512 * 512;
    c10::StreamId stream = t_current_stream;
    std::lock_guard<std::mutex> g(mu);
    collect_pending_locked();
    auto& pool = cached[{stream, size}];
    Block* b = nullptr;
    if (!pool.empty()) {
      b = pool.back();
      pool.pop_back();
    } else {
      if (stats.reserved_bytes[0].current + int64_t(size) > g_controls.capacity.load()) {
        mu.unlock();  // as CUDA does on a failed cudaMalloc: wait for the device, free the cache, retry
        synchronize_device(false);
        mu.lock();
        collect_pending_locked();
        release_cached_locked();
      }
      int64_t reserved = stats.reserved_bytes[0].current;
      if (reserved + int64_t(size) > g_controls.capacity.load()) {
        ++stats.num_ooms;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "sim: out of memory: tried to allocate ", size,
                         " bytes; ", reserved, " of ", g_controls.capacity.load(),
                         " bytes (the simdevice capacity control) are reserved");
      }
      b = new Block{map_segment(size), size, stream, {}};
      stats.reserved_bytes[0].increase(size);
      stats.segment[0].increase(1);
      ++stats.num_device_alloc;
    }
    b->used_on.clear();
    b->requested = nbytes;
    live[b->ptr] = b;
    stats.allocated_bytes[0].increase(size);
    stats.active_bytes[0].increase(size);
    stats.requested_bytes[0].increase(nbytes);
    stats.allocation[0].increase(1);
    stats.active[0].increase(1);
    return b;
  }

  void free_block(Block* b) {
    std::lock_guard<std::mutex> g(mu);
    live.erase(b->ptr);
    stats.allocated_bytes[0].decrease(b->size);
    stats.active_bytes[0].decrease(b->size);
    stats.requested_bytes[0].decrease(b->requested);
    stats.allocation[0].decrease(1);
    stats.active[0].decrease(1);
    if (b->used_on.empty()) {
      cached[{b->stream, b->size}].push_back(b);
      return;
    }
    Pending p{b, {}};
    for (c10::StreamId id : b->used_on) {
      Stream* s = stream_by_id(id);
      p.wait_for.emplace_back(s, s->last_enqueued());
    }
    pending.push_back(std::move(p));
  }

  void collect_pending_locked() {
    for (auto it = pending.begin(); it != pending.end();) {
      bool ready = true;
      for (auto& [s, seq] : it->wait_for) ready = ready && s->done(seq);
      if (ready) {
        cached[{it->block->stream, it->block->size}].push_back(it->block);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
  }

  void release_cached_locked() {
    for (auto& kv : cached) {
      for (Block* b : kv.second) {
        unmap_segment(b->ptr);
        stats.reserved_bytes[0].decrease(b->size);
        stats.segment[0].decrease(1);
        ++stats.num_device_free;
        delete b;
      }
    }
    cached.clear();
  }

  std::mutex mu;
  std::map<void*, Block*> live;                                              // allocated blocks
  std::map<std::pair<c10::StreamId, size_t>, std::vector<Block*>> cached;    // free, per stream + size
  std::deque<Pending> pending;                                               // freed, awaiting streams
  c10::CachingDeviceAllocator::DeviceStats stats;
};

DeviceAllocator g_device_allocator;
void DeviceAllocator::delete_block(void* ctx) { g_device_allocator.free_block(static_cast<Block*>(ctx)); }
REGISTER_ALLOCATOR(kSim, &g_device_allocator);

// ---------------------------------------------------------------------------------------------------
// Pinned host allocator. Ordinary host memory, remembered so is_pinned answers and asynchronous copies
// are allowed from/to it. As in CUDA's caching host allocator, a block an asynchronous copy uses
// (record_event) is reused only after that copy completed. Owner: HostAllocator::mu.
struct HostBlock {
  void* ptr;
  size_t size;
  std::vector<std::pair<Stream*, uint64_t>> uses;  // queued copies that read or write it
};

struct HostAllocator final : public at::HostAllocator {
  at::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &no_delete, at::DeviceType::CPU};
    size_t size = (nbytes + 511) / 512 * 512;
    std::lock_guard<std::mutex> g(mu);
    HostBlock* b = nullptr;
    auto& pool = cached[size];
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (all_done((*it)->uses)) {
        b = *it;
        pool.erase(it);
        break;
      }
    }
    if (!b) {
      void* p = nullptr;
      TORCH_CHECK(posix_memalign(&p, 4096, size) == 0, "sim: pinned allocation of ", size, " bytes failed");
      b = new HostBlock{p, size, {}};
      stats.allocations.increase(1);
      stats.allocated_bytes.increase(size);
      ++stats.num_host_alloc;
    }
    b->uses.clear();
    live[b->ptr] = b;
    stats.active_requests.increase(1);
    stats.active_bytes.increase(size);
    return {b->ptr, b, &delete_block, at::DeviceType::CPU};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }

  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    std::lock_guard<std::mutex> g(mu);
    HostBlock* b = find_locked(ptr);
    if (!b) return false;
    Stream* s = stream_by_id(stream.id());
    b->uses.emplace_back(s, s->last_enqueued());
    return true;
  }
  void empty_cache() override {
    std::lock_guard<std::mutex> g(mu);
    for (auto& kv : cached)
      for (auto it = kv.second.begin(); it != kv.second.end();) {
        if (!all_done((*it)->uses)) { ++it; continue; }
        stats.allocations.decrease(1);
        stats.allocated_bytes.decrease((*it)->size);
        ++stats.num_host_free;
        std::free((*it)->ptr);
        delete *it;
        it = kv.second.erase(it);
      }
  }
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> g(mu);
    return stats;
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}

  bool is_pinned(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return find_locked(p) != nullptr;
  }

 private:
  static void no_delete(void*) {}
  static void delete_block(void* ctx);
  static bool all_done(const std::vector<std::pair<Stream*, uint64_t>>& uses) {
    for (auto& [s, seq] : uses) if (!s->done(seq)) return false;
    return true;
  }
  HostBlock* find_locked(const void* p) {
    auto it = live.upper_bound(const_cast<void*>(p));
    if (it == live.begin()) return nullptr;
    --it;
    return (char*)p < (char*)it->first + it->second->size ? it->second : nullptr;
  }
  void free_block(HostBlock* b) {
    std::lock_guard<std::mutex> g(mu);
    live.erase(b->ptr);
    stats.active_requests.decrease(1);
    stats.active_bytes.decrease(b->size);
    cached[b->size].push_back(b);
  }

  std::mutex mu;
  std::map<void*, HostBlock*> live;
  std::map<size_t, std::vector<HostBlock*>> cached;
  at::HostStats stats;
};

HostAllocator g_host_allocator;
void HostAllocator::delete_block(void* ctx) { g_host_allocator.free_block(static_cast<HostBlock*>(ctx)); }
REGISTER_HOST_ALLOCATOR(kSim, &g_host_allocator);

// ---------------------------------------------------------------------------------------------------
// Device guard: one device (index 0), streams and events as above.
struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  c10::Device exchangeDevice(c10::Device d) const override { check(d); return {kSim, 0}; }
  c10::Device getDevice() const override { return {kSim, 0}; }
  void setDevice(c10::Device d) const override { check(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return make(t_current_stream); }
  c10::Stream getDefaultStream(c10::Device) const override { return make(0); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override {
    return make(1 + (g_pool_cursor++ % kPoolSize));
  }
  c10::Stream getNewStream(c10::Device, int) const override {
    std::lock_guard<std::mutex> g(g_streams_mu);
    return make(g_next_new_id++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    stream_by_id(s.id());  // validates
    c10::Stream old = make(t_current_stream);
    t_current_stream = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag)
      const override {
    if (!*event) *event = new Event();
    auto st = std::make_shared<EventState>();
    static_cast<Event*>(*event)->state = st;
    stream_by_id(stream.id())->enqueue([st] { complete(*st); });
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (!event) return;
    auto st = static_cast<Event*>(event)->state;
    if (!st) return;
    stream_by_id(stream.id())->enqueue([st] { wait_state(*st, false); });  // the stream waits, not the host
  }
  bool queryEvent(void* event) const override {
    if (!event || !static_cast<Event*>(event)->state) return true;
    auto& st = *static_cast<Event*>(event)->state;
    std::lock_guard<std::mutex> g(st.mu);
    return st.done;
  }
  void synchronizeEvent(void* event) const override {
    ++g_host_syncs;
    if (!event || !static_cast<Event*>(event)->state) return;
    wait_state(*static_cast<Event*>(event)->state, true);
    raise_device_error();
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a && b && a->state && b->state, "sim: elapsed_time needs two recorded events");
    std::lock_guard<std::mutex> ga(a->state->mu);
    std::lock_guard<std::mutex> gb(b->state->mu);
    TORCH_CHECK(a->state->done && b->state->done, "sim: elapsed_time on an event that has not completed");
    return std::chrono::duration<double, std::milli>(b->state->when - a->state->when).count();
  }
  bool queryStream(const c10::Stream& s) const override {
    Stream* st = stream_by_id(s.id());
    return st->done(st->last_enqueued());
  }
  void synchronizeStream(const c10::Stream& s) const override {
    ++g_host_syncs;
    Stream* st = stream_by_id(s.id());
    st->wait(st->last_enqueued());
  }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronize_device(true); }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const override {
    g_device_allocator.recordStream(p, s);
  }

 private:
  static void check(c10::Device d) {
    TORCH_CHECK(!d.has_index() || d.index() == 0, "sim: there is one device (index 0), not ", d);
  }
  static c10::Stream make(c10::StreamId id) { return c10::Stream(c10::Stream::UNSAFE, {kSim, 0}, id); }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------------------------------------------
// Hooks: what at::globalContext() asks an accelerator.
struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    TORCH_CHECK(d == 0, "sim: there is one device (index 0)");
  }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  bool isPinnedPtr(const void* p) const override { return g_host_allocator.is_pinned(p); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_host_allocator; }
  at::Device getDeviceFromPtr(void* p) const override {
    TORCH_CHECK(g_device_allocator.owns(p), "sim: the pointer is not device memory");
    return {kSim, 0};
  }
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
} g_register_hooks;

// ---------------------------------------------------------------------------------------------------
// Kernels.

// A CPU tensor over the same bytes as `t` (a sim tensor), owning nothing. Building it does not touch
// the bytes, so the host may build it; only a worker may read or write through it.
at::Tensor cpu_alias(const at::Tensor& t) {
  auto opts = at::TensorOptions().dtype(t.dtype()).device(at::kCPU);
  if (t.numel() == 0 || !t.storage().data()) return at::empty_strided(t.sizes(), t.strides(), opts);
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [](void*) {}, opts);
}

// A CPU tensor over `t`'s host bytes that owns nothing; `t` must outlive every use.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.numel() == 0) return at::empty_strided(t.sizes(), t.strides(), t.options());
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [](void*) {}, t.options());
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device>,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &g_device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &g_device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Queue `work` on the current stream; in synchronous mode wait for it (uncounted, see the note).
void launch(std::function<void()> work, double delay) {
  Stream* s = current_stream();
  uint64_t seq = s->enqueue([work = std::move(work), delay] {
    sleep_for_seconds(delay);
    DeviceWindow w;
    work();
  });
  if (!g_controls.asynchronous.load()) s->wait(seq);
}

// Run `work` on the current stream and wait for it: the host needs its result (counted).
void run_and_wait(std::function<void()> work) {
  ++g_host_syncs;
  Stream* s = current_stream();
  uint64_t seq = s->enqueue([work = std::move(work)] {
    sleep_for_seconds(g_controls.compute_delay.load());
    DeviceWindow w;
    work();
  });
  s->wait(seq);
}

// [Note: copies] Queued on the current stream like CUDA's cudaMemcpyAsync. Asynchronous exactly where
// CUDA's is: device to device, or host<->device with pinned host memory and non_blocking=True; then the
// pinned block is recorded so it is not reused before the copy ran. Otherwise the host waits (counted).
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(src.is_cpu() || src.device().type() == kSim, "sim: cannot copy from ", src.device());
  TORCH_CHECK(dst.is_cpu() || dst.device().type() == kSim, "sim: cannot copy to ", dst.device());
  if (dst.numel() == 0) return dst;
  const at::Tensor& host = src.is_cpu() ? src : dst;
  bool device_to_device = !src.is_cpu() && !dst.is_cpu();
  bool pinned = !device_to_device && g_host_allocator.is_pinned(host.storage().data());
  bool asynchronous = device_to_device || (pinned && non_blocking);
  // The item holds aliases only (see the note on queued items). A pageable host tensor is waited for
  // below; a pinned one is kept from reuse by the host allocator's record_event, as with CUDA.
  at::Tensor s = src.is_cpu() ? host_alias(src) : cpu_alias(src);
  at::Tensor d = dst.is_cpu() ? host_alias(dst) : cpu_alias(dst);
  double delay = copy_seconds(size_t(dst.numel()) * dst.element_size(), device_to_device);
  auto work = [s, d]() mutable { d.copy_(s); };
  if (asynchronous) {
    launch(work, delay);
    if (!device_to_device)  // after queueing: the recorded use includes this copy
      g_host_allocator.record_event(const_cast<void*>(host.storage().data()), nullptr,
                                    c10::Stream(c10::Stream::UNSAFE, {kSim, 0}, t_current_stream));
  } else {
    ++g_host_syncs;
    Stream* st = current_stream();
    uint64_t seq = st->enqueue([work, delay]() mutable {
      sleep_for_seconds(delay);
      DeviceWindow w;
      work();
    });
    st->wait(seq);
  }
  return dst;
}

// Metadata-only resize (plus a queued copy of the old bytes when the storage grows).
const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size_sym,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto size = C10_AS_INTARRAYREF_SLOW(size_sym);
  auto* impl = self.unsafeGetTensorImpl();
  int64_t numel = c10::multiply_integers(size);
  size_t need = size_t(self.storage_offset() + numel) * self.element_size();
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  if (need > storage->nbytes()) {
    at::DataPtr fresh = g_device_allocator.allocate(need);
    size_t old = storage->nbytes();
    void* from = storage->mutable_data();
    void* to = fresh.get();
    if (old > 0) launch([=] { std::memcpy(to, from, old); }, copy_seconds(old, true));
    storage->set_data_ptr_noswap(std::move(fresh));  // the old block returns to its stream's pool
    storage->set_nbytes(need);
  }
  impl->set_sizes_contiguous(size);
  if (memory_format && *memory_format != c10::MemoryFormat::Preserve)
    impl->empty_tensor_restride(*memory_format);
  return self;
}

const at::Tensor& resize_symint(const at::Tensor& self, c10::SymIntArrayRef size,
                                std::optional<c10::MemoryFormat> mf) {
  return resize_(self, size, mf);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                        c10::SymIntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset.expect_int());
  auto sz = C10_AS_INTARRAYREF_SLOW(size);
  if (stride.empty()) impl->set_sizes_contiguous(sz);
  else impl->set_sizes_and_strides(sz, C10_AS_INTARRAYREF_SLOW(stride));
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = int64_t(source.nbytes() / self.element_size());
  return set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  return set_storage(self, src.storage(), src.storage_offset(), src.sym_sizes(), src.sym_strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, &g_device_allocator, true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  // [Note: .data = between host and device] torch's default (TensorImpl::has_compatible_shallow_copy_type)
  // accepts dense tensors of a fixed list of backends, without PrivateUse1. Registering this op for
  // PrivateUse1 makes the dispatcher use it whenever either tensor is a sim tensor.
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.device().type() == kSim);
  };
  return dense(self) && dense(from);
}

// ---------------------------------------------------------------------------------------------------
// The boxed CPU fallback.
// [Note: the fallback] For an op without a sim kernel: (1) run its Meta kernel on meta copies of the
// arguments to learn the outputs' shapes and dtypes (and resize out= arguments as the op would), or
// reuse what it returned for the same metadata ([Note: the Meta results cache]);
// (2) allocate sim outputs; (3) queue the CPU kernel on the current stream over CPU aliases of the sim
// bytes, copying functional results into the outputs. Returns that alias an input are that input (in
// place / out=) or a view of it (metadata only, nothing queued). An op without a Meta kernel, or one
// returning host values, runs on the stream while the host waits (a counted host sync).

template <typename F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(f(t));
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    bool optional_tensors = false;
    for (const c10::IValue& e : in) optional_tensors = optional_tensors || e.isTensor();
    if (!optional_tensors) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const c10::IValue& e : in) out.push_back(e.isTensor() ? std::optional<at::Tensor>(f(e.toTensor())) : std::nullopt);
    return out;
  }
  return v;
}

bool is_sim(const at::Tensor& t) { return t.defined() && t.device().type() == kSim; }

at::Tensor to_meta(const at::Tensor& t) {
  if (!is_sim(t)) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
}

// [Note: what a queued item may hold] Only tensors without a Python object: an item is destroyed on its
// worker, and dropping a tensor's Python object there would need the GIL (a deadlock while the host waits
// holding it, a forced thread exit during interpreter shutdown). So sim arguments become aliases and host
// arguments (scalars, CPU indices) are cloned when queued, which is also what CUDA does with them.
at::Tensor to_alias(const at::Tensor& t) {
  if (is_sim(t)) return cpu_alias(t);
  return t.defined() ? t.clone() : t;
}

void check_devices(const c10::OperatorHandle& op, const torch::jit::Stack& args) {
  if (c10::string_view(op.schema().name()).starts_with("aten::index")) return;  // CPU indices allowed
  for (const c10::IValue& v : args)
    map_tensors(v, [&](const at::Tensor& t) {
      TORCH_CHECK(!t.defined() || is_sim(t) || t.dim() == 0,
                  "Expected all tensors to be on the same device, but found at least two devices, sim:0 and ",
                  t.device(), "! (in ", op.schema().name(), ")");
      return t;
    });
}

// The argument a return aliases, or -1.
int aliased_argument(const c10::FunctionSchema& schema, size_t ret) {
  const c10::AliasInfo* info = schema.returns()[ret].alias_info();
  if (!info) return -1;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::AliasInfo* a = schema.arguments()[i].alias_info();
    if (a && a->beforeSets() == info->beforeSets()) return int(i);
  }
  return -1;
}

bool returns_only_tensors(const c10::FunctionSchema& schema) {
  for (const c10::Argument& r : schema.returns()) {
    auto kind = r.type()->kind();
    bool tensorish = kind == c10::TypeKind::TensorType ||
                     (kind == c10::TypeKind::ListType && r.type()->containedType(0)->kind() == c10::TypeKind::TensorType);
    if (!tensorish) return false;
  }
  return true;
}

// A sim tensor over `base`'s storage with the view `meta` describes (meta was computed from a meta copy
// of base at storage offset 0).
at::Tensor view_of(const at::Tensor& base, const at::Tensor& meta) {
  return at::native::as_strided_tensorimpl(base, meta.sizes(), meta.strides(),
                                           base.storage_offset() + meta.storage_offset());
}

void sync_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const torch::jit::Stack& args) {
  const auto& schema = op.schema();
  torch::jit::Stack cpu_args;
  for (const c10::IValue& v : args) cpu_args.push_back(map_tensors(v, to_alias));
  auto results = std::make_shared<torch::jit::Stack>();
  run_and_wait([op, cpu_args, results]() mutable {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &cpu_args);
    *results = std::move(cpu_args);
  });
  for (size_t r = 0; r < results->size(); ++r) {
    int a = aliased_argument(schema, r);
    const c10::AliasInfo* info = schema.returns()[r].alias_info();
    c10::IValue out = map_tensors((*results)[r], [&](const at::Tensor& t) -> at::Tensor {
      if (!t.defined()) return t;
      if (a >= 0 && args[a].isTensor()) {
        const at::Tensor& base = args[a].toTensor();
        if (info->isWrite()) return base;
        // A view: its alias's pointer is base's alias pointer (base.data_ptr()) plus the view's offset.
        int64_t shift = ((char*)t.data_ptr() - (char*)base.data_ptr()) / int64_t(base.element_size());
        return at::native::as_strided_tensorimpl(base, t.sizes(), t.strides(), base.storage_offset() + shift);
      }
      // A new host result: move it to a fresh sim tensor (queued; the item owns the host tensor).
      at::Tensor dst = empty_strided(t.sizes(), t.strides(), t.scalar_type(), {}, {}, {});
      at::Tensor alias = cpu_alias(dst);
      launch([alias, t]() mutable { alias.copy_(t); }, 0.0);
      return dst;
    });
    stack->push_back(out);
  }
}

// [Note: the Meta results cache] Many Meta kernels are Python (torch._refs decompositions: a LayerNorm's
// takes milliseconds, the CPU kernel it stands before microseconds). A Meta kernel's returns depend only on
// its arguments' metadata when every tensor argument is a sim tensor (a host tensor's values may decide a
// shape: boolean indexing) and there is one (a factory op also reads global defaults): then the returns
// and the resized out= arguments of the first call are kept, keyed by the op and each argument's dtype,
// sizes and strides (the meta copies start at offset 0, so the offset cannot matter) or exact value, and
// later calls with the same key reuse them. Only their metadata is read. A Meta kernel that raised is
// kept too (its op then runs on the stream while the host waits, as before). An argument of another
// kind (a generator, say) is not keyed: that call runs its Meta kernel as before.
struct MetaResult {
  bool ok;
  torch::jit::Stack meta_args;  // after the call: out= arguments resized
  torch::jit::Stack returns;
};

// Appends `v`'s key to `key`; false for an argument the cache does not key.
bool key_of(const c10::IValue& v, std::string& key) {
  auto tensor = [&key](const at::Tensor& t) {
    if (!t.defined()) { key += "u;"; return true; }
    if (!is_sim(t)) return false;
    key += std::to_string(int(t.scalar_type()));
    for (int64_t d : t.sizes()) key += "," + std::to_string(d);
    key += "/";
    for (int64_t d : t.strides()) key += "," + std::to_string(d);
    key += ";";
    return true;
  };
  if (v.isTensor()) return tensor(v.toTensor());
  if (v.isNone()) { key += "n;"; return true; }
  if (v.isBool() || v.isInt()) { key += "i" + std::to_string(v.isBool() ? int64_t(v.toBool()) : v.toInt()) + ";"; return true; }
  if (v.isDouble()) {
    double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key += "d" + std::to_string(bits) + ";";
    return true;
  }
  if (v.isString()) { key += "s" + v.toStringRef() + ";"; return true; }
  if (v.isDevice()) { key += "v" + v.toDevice().str() + ";"; return true; }
  if (v.isList()) {
    key += "[";
    for (const c10::IValue& e : v.toListRef())
      if (!key_of(e, key)) return false;
    key += "];";
    return true;
  }
  return false;
}

std::mutex g_meta_mu;
std::unordered_map<std::string, MetaResult> g_meta_results;  // guarded by g_meta_mu
constexpr size_t kMetaResultsKept = 8192;                    // past it, the cache starts over

// The Meta results of `op` on `meta_args` (run, or reused: [Note: the Meta results cache]).
MetaResult meta_results(const c10::OperatorHandle& op, const torch::jit::Stack& args) {
  const auto& schema = op.schema();
  std::string key = schema.operator_name().name + "." + schema.operator_name().overload_name + "(";
  bool keyed = false;
  for (const c10::IValue& v : args) {
    keyed = keyed || v.isTensor() || v.isTensorList();
    if (!key_of(v, key)) { keyed = false; break; }
  }
  if (keyed) {
    std::lock_guard<std::mutex> lock(g_meta_mu);
    auto found = g_meta_results.find(key);
    if (found != g_meta_results.end()) return found->second;
  }
  MetaResult result{returns_only_tensors(schema), {}, {}};
  for (const c10::IValue& v : args) result.meta_args.push_back(map_tensors(v, to_meta));
  result.returns = result.meta_args;
  if (result.ok) {
    try {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &result.returns);
    } catch (const std::exception&) {  // c10::Error, or a Python meta kernel's exception
      result.ok = false;  // no Meta kernel, or data-dependent output shapes
    }
  }
  if (keyed) {
    std::lock_guard<std::mutex> lock(g_meta_mu);
    if (g_meta_results.size() >= kMetaResultsKept) g_meta_results.clear();
    g_meta_results.emplace(std::move(key), result);
  }
  return result;
}

// Ops whose CPU kernel reads only metadata (shapes, dtypes): run on the host, no device work, no wait.
bool reads_only_metadata(const c10::OperatorName& name) {
  static const std::set<std::string> names = {"aten::_fused_sdp_choice", "aten::is_same_size",
                                              "aten::is_set_to"};
  return names.count(name.name) > 0;
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  size_t n_args = schema.arguments().size();
  if (reads_only_metadata(schema.operator_name())) {
    for (auto it = stack->end() - n_args; it != stack->end(); ++it) *it = map_tensors(*it, to_alias);
    return op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  torch::jit::Stack args(stack->end() - n_args, stack->end());
  torch::jit::drop(*stack, n_args);
  check_devices(op, args);
  static const bool trace = std::getenv("SIMDEVICE_TRACE") != nullptr;  // print each op the fallback runs
  if (trace) fprintf(stderr, "sim fallback: %s\n", schema.operator_name().name.c_str());

  const MetaResult found = meta_results(op, args);
  if (!found.ok) return sync_fallback(op, stack, args);
  const torch::jit::Stack& meta_args = found.meta_args;  // out= arguments as the op resizes them
  const torch::jit::Stack& meta = found.returns;

  // out= arguments the Meta kernel resized: resize the sim tensors the same way before aliasing them.
  for (size_t i = 0; i < n_args; ++i) {
    const c10::AliasInfo* info = schema.arguments()[i].alias_info();
    if (!info || !info->isWrite() || !args[i].isTensor()) continue;
    const at::Tensor& t = args[i].toTensor();
    const at::Tensor& m = meta_args[i].toTensor();
    if (is_sim(t) && t.sizes() != m.sizes()) resize_(t, m.sym_sizes(), {});
  }

  // Outputs: an input (in place / out=), a view of one, or a fresh sim tensor the kernel's result fills.
  std::vector<std::pair<at::Tensor, size_t>> fills;  // (cpu alias of a fresh output, return index)
  torch::jit::Stack outputs;
  bool any_work = false;
  for (size_t r = 0; r < meta.size(); ++r) {
    int a = aliased_argument(schema, r);
    const c10::AliasInfo* info = schema.returns()[r].alias_info();
    c10::IValue out = map_tensors(meta[r], [&](const at::Tensor& m) -> at::Tensor {
      if (!m.defined()) return m;  // e.g. a gradient convolution_backward was not asked for
      if (a >= 0 && info && info->isWrite()) { any_work = true; return args[a].toTensor(); }
      if (a >= 0 && args[a].isTensor()) return view_of(args[a].toTensor(), m);
      at::Tensor dst = empty_strided(m.sizes(), m.strides(), m.scalar_type(), {}, {}, {});
      fills.emplace_back(cpu_alias(dst), r);
      any_work = true;
      return dst;
    });
    outputs.push_back(out);
  }
  for (const c10::Argument& argument : schema.arguments())  // an op that writes an argument has work
    if (argument.alias_info() && argument.alias_info()->isWrite()) any_work = true;
  if (schema.returns().empty()) any_work = true;

  if (any_work) {
    torch::jit::Stack cpu_args;
    for (const c10::IValue& v : args) cpu_args.push_back(map_tensors(v, to_alias));
    launch([op, cpu_args, fills]() mutable {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &cpu_args);
      // cpu_args now holds the results in return order; fills were made in the same order.
      size_t fi = 0;
      for (size_t r = 0; r < cpu_args.size() && fi < fills.size(); ++r) {
        map_tensors(cpu_args[r], [&](const at::Tensor& t) {
          if (t.defined() && fi < fills.size() && fills[fi].second == r) {
            if (fills[fi].first.data_ptr() != t.data_ptr()) fills[fi].first.copy_(t);
            ++fi;
          }
          return t;
        });
      }
    }, g_controls.compute_delay.load());
  }
  for (auto& v : outputs) stack->push_back(std::move(v));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", [](const at::Tensor& self, const at::Tensor& dst) {
    resize_(dst, self.sym_sizes(), {});
    return copy_from(self, dst, false);
  });
  m.impl("resize_", resize_symint);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  // Convolution's composite picks a kernel by device type and has none for PrivateUse1
  // (convolution_overrideable raises): run the whole op through the fallback, i.e. the CPU's choice.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
  m.impl("record_stream", [](at::Tensor& self, c10::Stream s) {
    g_device_allocator.recordStream(self.storage().data_ptr(), s);
  });
}

// [Note: CPU kernels over composite ones] An op with both a CPU kernel and a CompositeExplicitAutograd
// one would take the composite on PrivateUse1 (the dispatcher prefers it to a backend fallback); some
// composites compute differently (native_layer_norm decomposes into batch norm), so the results would
// not be bit-identical with the CPU. Every such op is routed to the fallback, hence to its CPU kernel.
int route_cpu_kernels() {
  static std::unique_ptr<torch::Library> lib;
  if (lib) return 0;
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                         __FILE__, __LINE__);
  int routed = 0;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    std::string full = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
    ++routed;
  }
  return routed;
}

}  // namespace sim

// ---------------------------------------------------------------------------------------------------
// Python bindings (used by tests/simdevice/__init__.py only).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace sim;
  m.def("set_control", [](const std::string& name, double value) {
    if (name == "copy_bandwidth") g_controls.copy_bandwidth = value;
    else if (name == "device_copy_bandwidth") g_controls.device_copy_bandwidth = value;
    else if (name == "copy_delay") g_controls.copy_delay = value;
    else if (name == "compute_delay") g_controls.compute_delay = value;
    else if (name == "protect") set_protect(value != 0);
    else if (name == "asynchronous") g_controls.asynchronous = value != 0;
    else if (name == "memory_info") g_controls.memory_info = value != 0;
    else if (name == "capacity") g_controls.capacity = int64_t(value);
    else if (name == "wait_timeout") g_controls.wait_timeout = value;
    else TORCH_CHECK(false, "sim: no control named ", name);
  });
  m.def("get_control", [](const std::string& name) -> double {
    if (name == "copy_bandwidth") return g_controls.copy_bandwidth;
    if (name == "device_copy_bandwidth") return g_controls.device_copy_bandwidth;
    if (name == "copy_delay") return g_controls.copy_delay;
    if (name == "compute_delay") return g_controls.compute_delay;
    if (name == "protect") return g_controls.protect;
    if (name == "asynchronous") return g_controls.asynchronous;
    if (name == "memory_info") return g_controls.memory_info;
    if (name == "capacity") return double(g_controls.capacity.load());
    if (name == "wait_timeout") return g_controls.wait_timeout;
    TORCH_CHECK(false, "sim: no control named ", name);
  });
  m.def("host_syncs", [] { return g_host_syncs.load(); });
  m.def("waiting_threads", &waiting_threads);
  m.def("pinned_bytes", [] {
    auto stats = g_host_allocator.get_stats();
    return std::make_pair(stats.active_bytes.current, stats.allocated_bytes.current);
  });
  m.def("route_cpu_kernels", &route_cpu_kernels);
  m.def("set_held", [](int64_t stream_id, bool held) { stream_by_id(stream_id)->set_held(held); });
  m.def("synchronize", [] { synchronize_device(true); });
  // A kernel that keeps the current stream busy for `seconds` and touches no memory (as
  // torch.cuda._sleep spins for cycles): a step's compute in one launch, the host not waiting.
  m.def("busy", [](double seconds) {
    TORCH_CHECK(seconds >= 0 && std::isfinite(seconds), "sim: busy seconds must be finite and >= 0");
    launch([] {}, seconds);
  });
  m.def("empty_cache", [] { g_device_allocator.emptyCache({0, 0}); });
  m.def("is_device_pointer", [](int64_t p) { return g_device_allocator.owns(reinterpret_cast<void*>(p)); });
}
