/*
 * regions_ioctl.h - ioctls on an open file of a REGIONFS mount.
 *
 * Remote regions ("Remote regions: a simple abstraction for remote memory", sections
 * 5.8 and 5.10) offer calls without a
 * VFS analogue; regionfs serves them as ioctls on the region's open file
 * descriptor:
 *
 *   RCLEARCACHE  drop this host's cached pages of a range, so that the next
 *                read or page fault fetches fresh data from the region
 *                (rclearcache). Dirty pages in the range are written back
 *                first.
 *   RPREFETCH    read a range now and place it in this host's page cache
 *                (rprefetch with sync = true).
 *   RINFO        describe the open region (struct regions_info).
 *   RMARKDIRTY   rmarkdirty: with zero != 0, the range is zeroed in the
 *                region without being read; with zero == 0 it is a no-op
 *                hint (writes mark pages dirty anyway).
 *
 * Ranges are clipped to the region's size; len == 0 means "to the end".
 * Errors: ENOTTY for an unknown request, EBADF when the descriptor was not
 * opened for writing (RMARKDIRTY), EIO when a daemon holding the data is
 * unreachable.
 *
 * Example:
 *
 *   struct regions_range r = { .offset = 0, .len = 0 };
 *   ioctl(fd, RCLEARCACHE, &r);
 *   struct regions_info info;
 *   ioctl(fd, RINFO, &info);
 *
 * The numbers use the Linux _IOC encoding with type 'R'; the hexadecimal
 * values beside each definition are those of the asm-generic layout
 * (x86-64, arm64, riscv64) and are checked by regionfs's unit tests.
 */
#ifndef REGIONS_IOCTL_H
#define REGIONS_IOCTL_H

#include <stdint.h>
#include <linux/ioctl.h>

#define REGIONS_IOC_MAGIC 'R'

/* A byte range of a region; len == 0 means "to the end of the region". */
struct regions_range {
	uint64_t offset;
	uint64_t len;
};

/* Argument of RMARKDIRTY. */
struct regions_markdirty {
	uint64_t offset;
	uint64_t len;
	uint32_t zero; /* non-zero: zero the range without reading it */
	uint32_t reserved;
};

#define REGIONS_INFO_MAX_HOSTS 16

/* regions_info.flags */
#define REGIONS_INFO_PERSISTENT  (1u << 0) /* survives its owner process */
#define REGIONS_INFO_MULTIHOSTED (1u << 1) /* spread over many hosts */
#define REGIONS_INFO_FIXVADDR    (1u << 2) /* has a fixed virtual address */
#define REGIONS_INFO_ONEWRITER   (1u << 3) /* one writer at a time */
#define REGIONS_INFO_LOCAL       (1u << 4) /* every byte held by this host */
#define REGIONS_INFO_PASSTHROUGH (1u << 5) /* this open reads the memory directly */
#define REGIONS_INFO_WRITABLE    (1u << 6) /* this open may write */

/* Result of RINFO (120 bytes). */
struct regions_info {
	uint64_t ino;         /* region id (inode number) */
	uint64_t size;        /* bytes */
	uint64_t vaddr;       /* fixed virtual address, 0 without FIXVADDR */
	uint64_t map_version; /* changes whenever the region map changes */
	uint64_t allocated;   /* bytes of pool memory allocated */
	uint32_t owner_pid;   /* creating process (OWNERPID) */
	uint32_t owner_host;  /* host of the creating process */
	uint32_t flags;       /* REGIONS_INFO_* */
	uint32_t nhosts;      /* hosts holding data (may exceed the array) */
	uint32_t hosts[REGIONS_INFO_MAX_HOSTS]; /* their ids, in map order */
};

#define RCLEARCACHE _IOW(REGIONS_IOC_MAGIC, 1, struct regions_range)       /* 0x40105201 */
#define RPREFETCH   _IOW(REGIONS_IOC_MAGIC, 2, struct regions_range)       /* 0x40105202 */
#define RINFO       _IOR(REGIONS_IOC_MAGIC, 3, struct regions_info)        /* 0x80785203 */
#define RMARKDIRTY  _IOW(REGIONS_IOC_MAGIC, 4, struct regions_markdirty)   /* 0x40185204 */

#endif /* REGIONS_IOCTL_H */
