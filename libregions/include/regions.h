/*
 * regions.h - the C interface of libregions ("Remote regions: a simple abstraction for
 * remote memory", sections 5.2, 5.7-5.10, 6.3).
 *
 * Link with `pkg-config --cflags --libs regions` (libregions.so or
 * libregions.a). A region is a file under a regionfs mount (env
 * REGIONS_MOUNT, default /regions); open it with open(2) and pass the
 * descriptor to these calls.
 *
 * Return convention: 0 (or a pointer) on success; -1 (or NULL) with errno
 * set on failure. The calls are thread-safe.
 */
#ifndef REGIONS_H
#define REGIONS_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Region attributes for rsetdefaultattr (the xattrs user.regions.<name>). */
#define RATTR_PERSISTENT  1 /* "0" or "1": the region survives its creator */
#define RATTR_MULTIHOSTED 2 /* "0" or "1": spread over many hosts */
#define RATTR_FIXVADDR    3 /* "0" or "1": same virtual address on every host */
#define RATTR_ONEWRITER   4 /* "0" or "1": one writer at a time */
#define RATTR_HOSTALLOC   5 /* comma-separated host ids to allocate on */

/* mapping */

/* Maps the whole region; at its fixed address if FIXVADDR. Mapping a region
 * twice in a process returns the same address. */
void *rmap(int regionfd);
/* Unmaps the mapping that contains addr. */
int runmap(void *addr);
/* Fetches [addr, addr+len) into this host's cache; waits when sync. */
int rprefetch(void *addr, size_t len, bool sync);
/* Marks [addr, addr+len) dirty; with zero, the range becomes zeros without
 * being fetched. */
int rmarkdirty(void *addr, size_t len, bool zero);
/* Drops this host's cached copy of [addr, addr+len), so the next access
 * fetches fresh data (dirty pages are written back first). */
int rclearcache(void *addr, size_t len);
/* Writes dirty pages of [addr, addr+len) back to the region; flags as for
 * msync(2): MS_SYNC returns once they are written, MS_ASYNC queues the
 * write-back and returns at once (a later MS_SYNC waits for it). Plain
 * msync(2) on rmap memory publishes nothing: pages of chunks on other hosts
 * are this process's cache, which only rmsync writes back. */
int rmsync(void *addr, size_t len, int flags);

/* allocation */

/* Allocates len bytes inside the region (mapping it first if needed). The
 * allocator's state lives in the region, so any process that maps the region
 * can continue it. Blocks are 16-byte aligned. ENOMEM when the region is full
 * and cannot grow; EINVAL when the region's allocator header is corrupt.
 * regionfd is checked to name the same file as at the thread's last call
 * without a system call, from the mount's counts of opens and closes; a
 * number closed by one thread and, before that close returns, reused by
 * another thread for a region of another mount escapes them (docs/SEMANTICS.md);
 * rmalloc_at names the region by address instead. */
void *rmalloc(int regionfd, size_t len);
/* rmalloc in the mapped region containing where (the address rmap returned,
 * or any address inside that mapping). Same blocks and heap as rmalloc, but
 * no system call on the fast path: rmalloc checks on every call (one kcmp)
 * that the descriptor still names the same open file, which costs more than
 * the allocation itself. EINVAL when where is not inside a mapping. */
void *rmalloc_at(void *where, size_t len);
/* Frees a block returned by rmalloc (any process that maps the region). */
int rfree(void *ptr);
/* Stores ptr (NULL to clear) as the region's root pointer, kept in the region
 * for other hosts and processes. ptr must lie inside the region's mapping. */
int rsetroot(int regionfd, void *ptr);
/* The region's root pointer in this process's mapping, NULL with errno 0 when
 * none is set. */
void *rgetroot(int regionfd);
/* Sets, for the calling thread, a default attribute (RATTR_*) of regions it
 * creates afterwards through the mount; val of len bytes, len == 0 clears
 * the default. */
int rsetdefaultattr(int attr, const char *val, int len);

/* sync
 * Named barriers, mutexes and doorbells at the manager, reached through the
 * host agent of REGIONS_MOUNT (default /regions). 0 on success, -1 with errno:
 * ENOENT unknown name, EEXIST re-init with other parameters (or another
 * kind), EINVAL bad n or name, EPERM unlocking a mutex this thread does not
 * hold, EDEADLK locking a mutex this thread holds, EIO manager or lock word
 * unreachable. A mutex is held by a thread (threads of one process exclude
 * each other; the locking thread unlocks); it is released when the holder's
 * process exits or its host's lease ends. */
/* Creates barrier name of n parties (fine if it exists with the same n). */
int rbarrier_init(const char *name, int n);
/* Waits until n callers reached the barrier in this round; reusable.
 * Arrives with one fetch-add on the barrier's word, then polls the word over
 * the transport (sleeping at the manager when the round takes long). */
int rbarrier_wait(const char *name);
int rmutex_init(const char *name);
/* Uncontended: one compare-and-swap on the lock word; else queued (FIFO). */
int rmutex_lock(const char *name);
int rmutex_unlock(const char *name);
int rbell_init(const char *name);
int rbell_ring(const char *name);
/* Waits for a ring since this process's last wait (any ring before its
 * first); returns the ring count. */
long rbell_wait(const char *name);
/* Deletes a barrier, mutex or doorbell; its waiters fail with ENOENT. */
int rdelete(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* REGIONS_H */
