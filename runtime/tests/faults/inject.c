// A storage fault injector for sluice's tests, loaded with LD_PRELOAD: reads of one file that
// touch a byte range fail with EIO, stall, or first rewrite a byte of the file in place with its
// modification time restored (what `cp --preserve=timestamps` or `rsync --inplace -t` leave).
//
//   SLUICE_FAULT_FILE  the file (its path as /proc/self/fd shows it)
//   SLUICE_FAULT_FROM, SLUICE_FAULT_TO  the byte range [FROM, TO) whose reads fault
//   SLUICE_FAULT_KIND  eio | stall | rewrite
//
// Every way sluice and llama.cpp read a file goes through here: pread/pread64 (the I/O lanes),
// read (llama.cpp's loader) and fread (ggml's GGUF parser; glibc's own read under fread cannot
// be interposed).

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <sys/syscall.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int targets(int fd, off_t at, size_t len) {
    const char * file = getenv("SLUICE_FAULT_FILE");
    const char * from_s = getenv("SLUICE_FAULT_FROM");
    const char * to_s = getenv("SLUICE_FAULT_TO");
    if (file == NULL || from_s == NULL || to_s == NULL || at < 0) {
        return 0;
    }
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) {
        return 0;
    }
    path[n] = '\0';
    if (strcmp(path, file) != 0) {
        return 0;
    }
    unsigned long long from = strtoull(from_s, NULL, 10), to = strtoull(to_s, NULL, 10);
    return (unsigned long long) at < to && (unsigned long long) at + len > from;
}

// Applies the fault; returns 0 when the read should go on (after a rewrite), -1 (errno set) when
// it fails.
static int fault(void) {
    const char * kind = getenv("SLUICE_FAULT_KIND");
    if (kind != NULL && strcmp(kind, "stall") == 0) {
        for (;;) {
            pause();
        }
    }
    if (kind != NULL && strcmp(kind, "rewrite") == 0) {
        static int done = 0;
        if (!done) {
            done = 1;
            const char * file = getenv("SLUICE_FAULT_FILE");
            off_t at = (off_t) strtoull(getenv("SLUICE_FAULT_FROM"), NULL, 10);
            struct stat st;
            int w = open(file, O_RDWR);
            unsigned char b;
            if (w >= 0 && fstat(w, &st) == 0 && pread(w, &b, 1, at) == 1) {
                b ^= 0x55;
                if (pwrite(w, &b, 1, at) == 1) {
                    struct timespec times[2] = { st.st_atim, st.st_mtim };
                    futimens(w, times);
                }
            }
            if (w >= 0) {
                close(w);
            }
        }
        return 0;
    }
    errno = EIO;
    return -1;
}

typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);
typedef ssize_t (*read_fn)(int, void *, size_t);
typedef size_t (*fread_fn)(void *, size_t, size_t, FILE *);

#define REAL(name, type) static type real_##name; if (!real_##name) real_##name = (type) dlsym(RTLD_NEXT, #name)

ssize_t pread64(int fd, void * buf, size_t count, off_t offset) {
    REAL(pread64, pread_fn);
    if (targets(fd, offset, count) && fault() < 0) {
        return -1;
    }
    return real_pread64(fd, buf, count, offset);
}

ssize_t pread(int fd, void * buf, size_t count, off_t offset) {
    REAL(pread, pread_fn);
    if (targets(fd, offset, count) && fault() < 0) {
        return -1;
    }
    return real_pread(fd, buf, count, offset);
}

ssize_t read(int fd, void * buf, size_t count) {
    REAL(read, read_fn);
    if (targets(fd, lseek(fd, 0, SEEK_CUR), count) && fault() < 0) {
        return -1;
    }
    return real_read(fd, buf, count);
}

size_t fread(void * buf, size_t size, size_t n, FILE * stream) {
    REAL(fread, fread_fn);
    if (targets(fileno(stream), ftello(stream), size * n) && fault() < 0) {
        return 0;
    }
    return real_fread(buf, size, n, stream);
}

// Reads through io_uring would pass the injector by: the process sees a kernel without io_uring
// (as where `kernel.io_uring_disabled` is set) and reads with pread, where the faults are.
long syscall(long number, ...) {
    if (number == SYS_io_uring_setup) {
        errno = ENOSYS;
        return -1;
    }
    static long (*real)(long, ...) = NULL;
    if (real == NULL) {
        real = (long (*)(long, ...)) dlsym(RTLD_NEXT, "syscall");
    }
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; i++) {
        a[i] = va_arg(ap, long);
    }
    va_end(ap);
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
