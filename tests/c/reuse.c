/*
 * reuse - rfree/rmalloc reuse within a process and across processes and
 * hosts (tests/tests/c_abi.rs).
 *
 *   reuse REGION_PATH first    create the region; allocate, free, reuse; keep
 *                              the address of a freed block in the root
 *   reuse REGION_PATH second   (another process/host) the next 64-byte
 *                              rmalloc returns that freed block
 *   reuse REGION_PATH check    the first host sees the second's allocation
 * Prints "ok <mode>" on success; exits 1 with a reason otherwise.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <regions.h>

/* Offsets from the region's start: the region is not FIXVADDR, so it may
 * map at a different address in every process. */
struct record {
	uint64_t freed;  /* a freed 64-byte block */
	uint64_t second; /* the block the second process got (0: none) */
	uint64_t magic;
};

#define FAIL(...) do { fprintf(stderr, "reuse: " __VA_ARGS__); fprintf(stderr, " (errno %d %s)\n", errno, strerror(errno)); exit(1); } while (0)

static void sync_all(int fd)
{
	struct stat st;
	void *base = rmap(fd);
	if (!base || fstat(fd, &st) != 0)
		FAIL("rmap");
	if (rmsync(base, st.st_size, MS_SYNC) != 0)
		FAIL("rmsync");
}

int main(int argc, char **argv)
{
	if (argc != 3)
		FAIL("usage: reuse REGION_PATH first|second|check");
	const char *mode = argv[2];
	int first = strcmp(mode, "first") == 0;
	int fd = open(argv[1], first ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0644);
	if (fd < 0)
		FAIL("open %s", argv[1]);
	if (first) {
		/* rmalloc maps the region itself; rmap returns the same mapping. */
		char *a = rmalloc(fd, 64), *b = rmalloc(fd, 64);
		char *big = rmalloc(fd, 100000);
		if (!a || !b || !big)
			FAIL("rmalloc");
		if (a == b || ((uintptr_t)a & 15) || ((uintptr_t)big & 4095))
			FAIL("bad blocks %p %p %p", a, b, big);
		memset(a, 1, 64);
		memset(big, 2, 100000);
		if (rfree(a) != 0)
			FAIL("rfree(a)");
		char *a2 = rmalloc(fd, 64);
		if (a2 != a)
			FAIL("a freed 64-byte block was not reused: %p then %p", a, a2);
		if (rfree(big) != 0)
			FAIL("rfree(big)");
		char *big2 = rmalloc(fd, 90000);
		if (big2 != big)
			FAIL("freed pages were not reused: %p then %p", big, big2);
		/* rmalloc_at names the same heap by an address of its mapping. */
		char *c = rmalloc_at(b, 64);
		if (!c || c == b || rfree(c) != 0)
			FAIL("rmalloc_at in the mapping of %p gave %p", b, c);
		if (rmalloc_at(c, 64) != c)
			FAIL("rmalloc_at did not reuse the block it freed");
		if (rfree(c) != 0)
			FAIL("rfree(c)");
		if (rfree(a2) != 0)
			FAIL("rfree(a2)");
		errno = 0;
		if (rfree(a2) != -1 || errno != EINVAL)
			FAIL("a double free was not refused with EINVAL");
		int local;
		errno = 0;
		if (rfree(&local) != -1 || errno != EINVAL)
			FAIL("rfree of a stack address was not refused with EINVAL");
		char *base = rmap(fd);
		if (!base)
			FAIL("rmap");
		struct record *r = (struct record *)b;
		r->freed = (uint64_t)(a2 - base);
		r->second = 0;
		r->magic = 0x5245555345ull;
		if (rsetroot(fd, r) != 0)
			FAIL("rsetroot");
	} else {
		errno = 0;
		struct record *r = rgetroot(fd);
		char *base = rmap(fd);
		if (!r || !base || r->magic != 0x5245555345ull)
			FAIL("no root record");
		if (strcmp(mode, "second") == 0) {
			char *p = rmalloc(fd, 64);
			if (p != base + r->freed)
				FAIL("another process did not continue the heap: got %p, freed block %p", p, base + r->freed);
			memset(p, 3, 64);
			r->second = (uint64_t)(p - base);
		} else {
			if (!r->second)
				FAIL("the second process's allocation is not visible");
			char *second = base + r->second;
			char *p = rmalloc(fd, 64);
			if (!p || p == second)
				FAIL("rmalloc returned a live block %p", p);
			if (second[0] != 3)
				FAIL("the second process's data is not visible");
			if (rfree(second) != 0 || rfree(p) != 0)
				FAIL("rfree");
		}
	}
	sync_all(fd);
	printf("ok %s\n", mode);
	return 0;
}
