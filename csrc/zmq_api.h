// The few libzmq calls the serving fast path makes (csrc/serve_loop.h), reached at run
// time in the libzmq that pyzmq already loaded.
//
// kvsparse never links to libzmq: pyzmq's wheel bundles its own copy
// (site-packages/pyzmq.libs/libzmq-*.so) and ships no zmq.h, and a second libzmq
// in the process could not share sockets with it. So the prototypes and
// constants below are declared here (libzmq 4.x's stable ABI), and Load() looks
// the functions up with dlopen(path, RTLD_NOW | RTLD_NOLOAD) of the library
// already mapped (the Python side finds its path in /proc/self/maps). If that
// fails, the fast path is off and the server serves everything in Python.
//
//   kvsparse::ZmqApi zmq;
//   std::string error;
//   if (!kvsparse::ZmqApi::Load("/.../libzmq-2f02442c.so.5.2.5", &zmq, &error)) { ... }
//   kvsparse::ZmqMsg msg;
//   zmq.msg_init(&msg);
//
// A loaded ZmqApi is immutable: safe to share between threads (libzmq's own rules
// for sockets still apply: one thread at a time per socket).
#ifndef KVSPARSE_ZMQ_API_H_
#define KVSPARSE_ZMQ_API_H_

#include <cstddef>
#include <string>

namespace kvsparse {

// zmq_msg_t: 64 opaque bytes, pointer-aligned (zmq.h).
struct alignas(8) ZmqMsg {
  unsigned char opaque[64];
};

// zmq_pollitem_t is not needed: the loop waits with ::poll on ZMQ_FD (see serve_loop.h).
constexpr int kZmqDontWait = 1;     // ZMQ_DONTWAIT
constexpr int kZmqSndMore = 2;      // ZMQ_SNDMORE
constexpr int kZmqFd = 14;          // ZMQ_FD
constexpr int kZmqEvents = 15;      // ZMQ_EVENTS
constexpr int kZmqPollIn = 1;       // ZMQ_POLLIN

struct ZmqApi {
  int (*msg_init)(ZmqMsg* msg) = nullptr;
  int (*msg_init_size)(ZmqMsg* msg, size_t size) = nullptr;
  // data is handed over: libzmq calls free_fn(data, hint) once it is done with it, from
  // whichever thread lets go of the message last (its I/O thread, usually).
  int (*msg_init_data)(ZmqMsg* msg, void* data, size_t size, void (*free_fn)(void*, void*),
                       void* hint) = nullptr;
  int (*msg_recv)(ZmqMsg* msg, void* socket, int flags) = nullptr;
  int (*msg_send)(ZmqMsg* msg, void* socket, int flags) = nullptr;
  int (*msg_close)(ZmqMsg* msg) = nullptr;
  void* (*msg_data)(ZmqMsg* msg) = nullptr;
  size_t (*msg_size)(const ZmqMsg* msg) = nullptr;
  int (*msg_more)(const ZmqMsg* msg) = nullptr;
  int (*getsockopt)(void* socket, int option, void* value, size_t* size) = nullptr;
  int (*errno_)() = nullptr;

  // Fills *api from the libzmq mapped at path (never loads a new copy). False, with
  // *error saying why, when it is not loaded or lacks a function.
  static bool Load(const char* path, ZmqApi* api, std::string* error);
};

}  // namespace kvsparse

#endif  // KVSPARSE_ZMQ_API_H_
