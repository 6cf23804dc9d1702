/* What `llmc_barrier`'s protocol costs two threads with no work between: the floor of a decode step's barriers.

       gcc -O2 -pthread benchmarks/barrier_pingpong.c -o /tmp/barrier_pingpong && /tmp/barrier_pingpong

   Two threads, pinned to CPUs 0 and 1, pass the barrier of `backends/cpu/kernels.py: _barrier_function` (an
   arrival count, the last arrival bumps a generation the other watches with `pause`) a million times back to
   back. Time a decode step spends in `llmc_barrier` beyond this times its barriers per call is one thread waiting
   for the other: the step's imbalance, not the barrier.
*/
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#define N 1000000L
static _Alignas(64) atomic_long count;
static _Alignas(64) atomic_long generation;

static void barrier(void) {
  long seen = atomic_load_explicit(&generation, memory_order_acquire);
  if (atomic_fetch_add_explicit(&count, 1, memory_order_acq_rel) == 1) {
    atomic_store_explicit(&count, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    return;
  }
  while (atomic_load_explicit(&generation, memory_order_acquire) == seen) _mm_pause();
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static void *other(void *unused) {
  (void)unused;
  pin(1);
  for (long i = 0; i < N; i++) barrier();
  return NULL;
}

int main(void) {
  pin(0);
  pthread_t thread;
  pthread_create(&thread, NULL, other, NULL);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < N; i++) barrier();
  clock_gettime(CLOCK_MONOTONIC, &b);
  pthread_join(thread, NULL);
  printf("%.0f ns a barrier (2 threads, back to back)\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / N);
  return 0;
}
