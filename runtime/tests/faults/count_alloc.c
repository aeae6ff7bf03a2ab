// Counts the bytes a process asks the allocator for, loaded with LD_PRELOAD, and writes the total
// (a decimal number) to the file named by SLUICE_ALLOC_REPORT at exit: a measure of the work an
// algorithm does in memory that does not depend on the machine's speed (a vector grown one
// element at a time by exact reserves asks for the square of its size).

#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

extern void * __libc_malloc(size_t n);
extern void * __libc_calloc(size_t count, size_t n);
extern void * __libc_realloc(void * p, size_t n);
extern void * __libc_memalign(size_t align, size_t n);

static _Atomic unsigned long long asked;

void * malloc(size_t n) {
    asked += n;
    return __libc_malloc(n);
}

void * calloc(size_t count, size_t n) {
    asked += (unsigned long long) count * n;
    return __libc_calloc(count, n);
}

void * realloc(void * p, size_t n) {
    asked += n;
    return __libc_realloc(p, n);
}

void * memalign(size_t align, size_t n) {
    asked += n;
    return __libc_memalign(align, n);
}

void * aligned_alloc(size_t align, size_t n) {
    asked += n;
    return __libc_memalign(align, n);
}

int posix_memalign(void ** out, size_t align, size_t n) {
    asked += n;
    void * p = __libc_memalign(align, n);
    if (p == NULL) {
        return ENOMEM;
    }
    *out = p;
    return 0;
}

__attribute__((destructor)) static void report(void) {
    const char * path = getenv("SLUICE_ALLOC_REPORT");
    if (path == NULL) {
        return;
    }
    unsigned long long total = asked;
    FILE * f = fopen(path, "w");
    if (f != NULL) {
        fprintf(f, "%llu\n", total);
        fclose(f);
    }
}
