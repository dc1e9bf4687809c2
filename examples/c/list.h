/*
 * list.h - the data structures list_build.c creates in a region and
 * list_traverse.c walks on another host (Remote Regions paper, Fig. 14).
 *
 * Every pointer is a plain C pointer into the region: the region has the
 * FIXVADDR attribute, so it maps at the same virtual address on every host.
 */
#ifndef LIST_H
#define LIST_H

#include <stdint.h>

#define LIST_MAGIC 0x4c49535452474e31ull /* "1NGRTSIL" */

struct node {
	struct node *next;
	uint64_t value;
};

struct entry {
	struct entry *next;
	uint64_t key;
	uint64_t value;
};

/* The root object (rsetroot / rgetroot). */
struct root {
	uint64_t magic;
	uint64_t n;             /* list nodes and hash entries */
	struct node *head;      /* the linked list */
	struct entry **buckets; /* the hash table */
	uint64_t nbuckets;      /* a power of two */
	uint64_t checksum;      /* list_checksum of what was built */
};

static inline uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

/* The value stored for node/key i. */
static inline uint64_t value_of(uint64_t i) { return mix(i + 1); }

static inline uint64_t bucket_of(uint64_t key, uint64_t nbuckets)
{
	return mix(key ^ 0x9e3779b97f4a7c15ull) & (nbuckets - 1);
}

/* Order-sensitive checksum step. */
static inline uint64_t checksum_step(uint64_t sum, uint64_t v)
{
	return mix(sum ^ v) + v;
}

#endif
