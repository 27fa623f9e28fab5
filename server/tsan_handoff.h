// Happens-before edges that ThreadSanitizer cannot see through gRPC. A reactor is made on one thread and
// its callbacks (OnWriteDone, OnCancel, OnDone) run on others; libgrpc orders them, but Debian's libgrpc
// is not instrumented, so a TSan build would report the reactor's own fields (its mutex included) as
// racing with its constructor. Each reactor calls HandOff(this) before it gives itself to gRPC (end of
// the constructor, every Finish/StartWrite) and at every other exit of a callback (never after Finish:
// the reactor may be gone), and Received(this) first thing in every callback. Outside TSan builds both
// are empty.
#pragma once

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define QKV_TSAN_BUILD 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define QKV_TSAN_BUILD 1
#endif

#ifdef QKV_TSAN_BUILD
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace qkv::server {

inline void HandOff(void* reactor) {
#ifdef QKV_TSAN_BUILD
  __tsan_release(reactor);
#else
  (void)reactor;
#endif
}

inline void Received(void* reactor) {
#ifdef QKV_TSAN_BUILD
  __tsan_acquire(reactor);
#else
  (void)reactor;
#endif
}

}  // namespace qkv::server
