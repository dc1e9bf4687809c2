/*
 * mmap_fault.c - first-touch latency of 4 KiB pages of a MAP_SHARED file
 * mapping, for benches/regionfs.sh (compiled there at run time with cc).
 *
 *   mmap_fault read  FILE [--pages N] [--order seq|rand] [--seed S]
 *   mmap_fault write FILE [--pages N] [--order seq|rand] [--seed S]
 *   mmap_fault info  FILE
 *
 * read/write map the whole file MAP_SHARED and touch one byte of each of N
 * pages (default: every page), timing each first touch with
 * CLOCK_MONOTONIC. "seq" touches pages 0..N-1 in order with the default
 * readahead (what a program streaming through a mapping sees); "rand"
 * touches N distinct pages in a seeded random order after
 * madvise(MADV_RANDOM), so that every touch is its own fault. write
 * stores a byte derived from the page index and ends with msync(MS_SYNC)
 * (timed separately). Prints one line of key=value pairs:
 *
 *   pages=N p50_us=.. p99_us=.. mean_us=.. max_us=.. total_s=.. sum=.. [msync_ms=..]
 *
 * sum is a checksum of the bytes read (read) or written (write): the same
 * file, pages and seed give the same sum on any file system, which the
 * script uses to check that a mapping of a region reads what tmpfs reads.
 *
 * info opens FILE read-only and prints what the RINFO ioctl of regionfs
 * says about that open (placement, passthrough).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "regions_ioctl.h"

#define PAGE 4096UL
/* The byte touched inside each page. */
#define TOUCH_AT 64UL

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static uint64_t xorshift(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static void die(const char *what, const char *file)
{
	fprintf(stderr, "mmap_fault: %s %s: %s\n", what, file, strerror(errno));
	exit(1);
}

static void usage(void)
{
	fprintf(stderr,
		"usage: mmap_fault read|write FILE [--pages N] [--order seq|rand] [--seed S]\n"
		"       mmap_fault info FILE\n");
	exit(2);
}

static int info(const char *file)
{
	int fd = open(file, O_RDONLY);
	if (fd < 0)
		die("cannot open", file);
	struct regions_info ri;
	memset(&ri, 0, sizeof ri);
	if (ioctl(fd, RINFO, &ri) != 0)
		die("RINFO failed on", file);
	printf("ino=%llu size=%llu allocated=%llu owner_host=%u local=%d passthrough=%d hosts=",
	       (unsigned long long)ri.ino, (unsigned long long)ri.size,
	       (unsigned long long)ri.allocated, ri.owner_host,
	       !!(ri.flags & REGIONS_INFO_LOCAL), !!(ri.flags & REGIONS_INFO_PASSTHROUGH));
	uint32_t n = ri.nhosts < REGIONS_INFO_MAX_HOSTS ? ri.nhosts : REGIONS_INFO_MAX_HOSTS;
	for (uint32_t i = 0; i < n; i++)
		printf("%s%u", i ? "," : "", ri.hosts[i]);
	printf("\n");
	close(fd);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 3)
		usage();
	const char *mode = argv[1], *file = argv[2];
	if (strcmp(mode, "info") == 0)
		return info(file);
	int write_mode;
	if (strcmp(mode, "read") == 0)
		write_mode = 0;
	else if (strcmp(mode, "write") == 0)
		write_mode = 1;
	else
		usage();
	uint64_t want = 0, seed = 0x9e3779b97f4a7c15ULL;
	int random_order = 0;
	for (int i = 3; i < argc; i++) {
		if (strcmp(argv[i], "--pages") == 0 && i + 1 < argc)
			want = strtoull(argv[++i], NULL, 0);
		else if (strcmp(argv[i], "--order") == 0 && i + 1 < argc) {
			const char *o = argv[++i];
			if (strcmp(o, "rand") == 0)
				random_order = 1;
			else if (strcmp(o, "seq") != 0)
				usage();
		} else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
			seed = strtoull(argv[++i], NULL, 0) | 1;
		else
			usage();
	}

	int fd = open(file, write_mode ? O_RDWR : O_RDONLY);
	if (fd < 0)
		die("cannot open", file);
	struct stat st;
	if (fstat(fd, &st) != 0)
		die("cannot stat", file);
	uint64_t npages = (uint64_t)st.st_size / PAGE;
	if (npages == 0) {
		fprintf(stderr, "mmap_fault: %s is smaller than one page\n", file);
		return 1;
	}
	if (want == 0 || want > npages)
		want = npages;

	/* The order of pages: 0..want-1, or want distinct pages at random. */
	uint64_t *order = malloc(npages * sizeof *order);
	uint64_t *lat = malloc(want * sizeof *lat);
	if (!order || !lat) {
		fprintf(stderr, "mmap_fault: out of memory\n");
		return 1;
	}
	for (uint64_t i = 0; i < npages; i++)
		order[i] = i;
	if (random_order) {
		uint64_t s = seed;
		for (uint64_t i = 0; i < want; i++) {
			uint64_t j = i + xorshift(&s) % (npages - i);
			uint64_t t = order[i];
			order[i] = order[j];
			order[j] = t;
		}
	}

	int prot = PROT_READ | (write_mode ? PROT_WRITE : 0);
	unsigned char *map = mmap(NULL, npages * PAGE, prot, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		die("cannot mmap", file);
	if (random_order && madvise(map, npages * PAGE, MADV_RANDOM) != 0)
		die("madvise(MADV_RANDOM) failed on", file);

	uint64_t sum = 0;
	uint64_t start = now_ns();
	if (write_mode) {
		for (uint64_t i = 0; i < want; i++) {
			uint64_t page = order[i];
			unsigned char v = (unsigned char)(page * 131 + 7);
			uint64_t t0 = now_ns();
			*(volatile unsigned char *)(map + page * PAGE + TOUCH_AT) = v;
			uint64_t t1 = now_ns();
			lat[i] = t1 - t0;
			sum += v;
		}
	} else {
		for (uint64_t i = 0; i < want; i++) {
			uint64_t page = order[i];
			uint64_t t0 = now_ns();
			unsigned char v = *(volatile unsigned char *)(map + page * PAGE + TOUCH_AT);
			uint64_t t1 = now_ns();
			lat[i] = t1 - t0;
			sum += v * (page % 251 + 1);
		}
	}
	uint64_t touched = now_ns();
	double msync_ms = -1;
	if (write_mode) {
		uint64_t m0 = now_ns();
		if (msync(map, npages * PAGE, MS_SYNC) != 0)
			die("msync failed on", file);
		msync_ms = (double)(now_ns() - m0) / 1e6;
	}
	if (munmap(map, npages * PAGE) != 0)
		die("munmap failed on", file);
	if (write_mode && fsync(fd) != 0)
		die("fsync failed on", file);
	close(fd);

	double total = 0;
	for (uint64_t i = 0; i < want; i++)
		total += (double)lat[i];
	qsort(lat, want, sizeof *lat, cmp_u64);
	uint64_t p50 = lat[(want - 1) * 50 / 100];
	uint64_t p99 = lat[(want - 1) * 99 / 100];
	printf("pages=%llu p50_us=%.3f p99_us=%.3f mean_us=%.3f max_us=%.1f total_s=%.3f sum=%llu",
	       (unsigned long long)want, p50 / 1e3, p99 / 1e3, total / want / 1e3,
	       lat[want - 1] / 1e3, (double)(touched - start) / 1e9,
	       (unsigned long long)sum);
	if (write_mode)
		printf(" msync_ms=%.1f", msync_ms);
	printf("\n");
	free(order);
	free(lat);
	return 0;
}
