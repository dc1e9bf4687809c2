/*
 * list_traverse - walks the linked list and the hash table that list_build
 * made, by plain pointer chasing, possibly on another host (Remote Regions paper,
 * Fig. 14). The region maps at its fixed address, so the pointers stored in
 * it are valid here too; pages are fetched on first touch.
 *
 *   list_traverse REGION_PATH
 *
 * Prints "checksum <hex>" and exits 0 when it matches the one list_build
 * stored, 1 otherwise.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <regions.h>

#include "list.h"

static void die(const char *what)
{
	fprintf(stderr, "list_traverse: %s: %s\n", what, strerror(errno));
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s REGION_PATH\n", argv[0]);
		return 2;
	}
	int fd = open(argv[1], O_RDONLY);
	if (fd < 0)
		die(argv[1]);
	void *base = rmap(fd);
	if (!base)
		die("rmap");
	errno = 0;
	struct root *root = rgetroot(fd);
	if (!root) {
		if (errno == 0)
			fprintf(stderr, "list_traverse: %s has no root (run list_build first)\n", argv[1]);
		else
			die("rgetroot");
		return 1;
	}
	if (root->magic != LIST_MAGIC) {
		fprintf(stderr, "list_traverse: the root is not a list_build root\n");
		return 1;
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	uint64_t sum = 0, count = 0;
	for (struct node *p = root->head; p; p = p->next) {
		sum = checksum_step(sum, p->value);
		count++;
	}
	uint64_t found = 0;
	for (uint64_t i = 0; i < root->n; i++) {
		struct entry *e = root->buckets[bucket_of(i, root->nbuckets)];
		while (e && e->key != i)
			e = e->next;
		if (e) {
			sum = checksum_step(sum, e->value);
			found++;
		}
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
	printf("traversed %llu nodes, found %llu of %llu keys in %.1f ms (region at %p)\n",
	       (unsigned long long)count, (unsigned long long)found,
	       (unsigned long long)root->n, ms, base);
	printf("checksum %016llx\n", (unsigned long long)sum);
	if (count != root->n || found != root->n || sum != root->checksum) {
		fprintf(stderr, "list_traverse: checksum mismatch (stored %016llx)\n",
			(unsigned long long)root->checksum);
		return 1;
	}
	runmap(base);
	close(fd);
	return 0;
}
