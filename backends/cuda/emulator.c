/* A CPU emulation of the CUDA execution model, for checking llmc's CUDA kernels without a GPU.
 *
 * The kernels are the same LLVM IR as the PTX, compiled for the host, with the
 * `llvm.nvvm.*` thread-id, barrier and shuffle intrinsics replaced by the `emu_*`
 * functions below (backends/cuda/device.py, class Emulated). `emu_launch` runs the
 * grid one block at a time; a block's threads are cooperative contexts that switch
 * only at a barrier or a shuffle (a dozen instructions: callee-saved registers and the
 * stack pointer, x86-64 System V), so shared memory is a plain global and a warp's
 * shuffle is a write, a warp barrier, a read and a warp barrier.
 *
 * A thread that has returned counts as arrived at every later barrier (as on Volta and
 * later GPUs). A block whose threads can no longer all meet is reported, not hung.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 1024
#define STACK_BYTES (64 * 1024)

typedef void (*entry_fn)(void **params);

/* emu_switch(&from, to): save the callee-saved registers, MXCSR and x87 control word on
 * this stack, store the stack pointer in *from, continue on the stack `to`. */
void emu_switch(void **from, void *to);
__asm__(".text\n.globl emu_switch\n.type emu_switch,@function\nemu_switch:\n"
        "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
        "subq $8, %rsp\nstmxcsr (%rsp)\nfnstcw 4(%rsp)\n"
        "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
        "ldmxcsr (%rsp)\nfldcw 4(%rsp)\naddq $8, %rsp\n"
        "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
        ".size emu_switch, .-emu_switch\n");

static void *scheduler, *contexts[MAX_THREADS];
static char *stacks;
static int threads, current, done[MAX_THREADS], waiting[MAX_THREADS];
static int live[MAX_THREADS / 32 + 1];  /* threads not returned, per warp, then the block */
static int block_dim[3], block_idx[3];
static int arrived[MAX_THREADS / 32 + 1], generation[MAX_THREADS / 32 + 1];  /* warps, then the block */
static float exchange[MAX_THREADS];
static entry_fn entry;
static void **entry_params;
static long progress;  /* arrivals, releases and exits: a pass without any is a deadlock */

static void run_thread(void) {
    entry(entry_params);
    done[current] = 1;
    live[current / 32]--;
    live[MAX_THREADS / 32]--;
    progress++;
    emu_switch(&contexts[current], scheduler);  /* never resumed */
}

/* A fresh context whose first switch enters run_thread with the stack aligned as by a call. */
static void *fresh_context(char *stack) {
    uintptr_t top = ((uintptr_t)(stack + STACK_BYTES)) & ~(uintptr_t)15;
    void **slot = (void **)(top - 16);
    slot[0] = (void *)run_thread;           /* popped by `ret` */
    for (int i = 1; i <= 6; i++) slot[-i] = 0;  /* rbp, rbx, r12–r15 */
    uint32_t *control = (uint32_t *)(slot - 7);
    control[0] = 0x1F80;                    /* MXCSR default */
    control[1] = 0x037F;                    /* x87 control word default */
    return slot - 7;
}

/* Wait until every live thread of the warp (slot < MAX_THREADS/32) or block has arrived. */
static void meet(int slot) {
    int gen = generation[slot];
    arrived[slot]++;
    progress++;
    waiting[current] = 1;
    for (;;) {
        if (generation[slot] != gen) break;
        if (arrived[slot] >= live[slot]) {
            arrived[slot] = 0;
            generation[slot]++;
            progress++;
            break;
        }
        emu_switch(&contexts[current], scheduler);
    }
    waiting[current] = 0;
}

int emu_tid_x(void) { return current % block_dim[0]; }
int emu_ctaid_x(void) { return block_idx[0]; }
int emu_ctaid_y(void) { return block_idx[1]; }
int emu_ctaid_z(void) { return block_idx[2]; }

void emu_barrier(void) { meet(MAX_THREADS / 32); }

float emu_shfl_xor_f32(float value, int mask) {
    int warp = current / 32, lane = current % 32, partner = warp * 32 + (lane ^ mask);
    exchange[current] = value;
    meet(warp);
    float got = partner < threads ? exchange[partner] : value;
    meet(warp);
    return got;
}

int emu_shfl_xor_i32(int value, int mask) {
    float bits, got;
    memcpy(&bits, &value, 4);
    got = emu_shfl_xor_f32(bits, mask);
    memcpy(&value, &got, 4);
    return value;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: normalise */
            exp = 113;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint32_t mma_a[MAX_THREADS][4], mma_b[MAX_THREADS][2];

static float half_of(uint32_t reg, int high) { return half_to_float((uint16_t)(high ? reg >> 16 : reg)); }

/* mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 across the warp: each lane gives its fragments
 * (PTX ISA layout: groupID = lane / 4, t = lane % 4; A regs (row g | g+8, col 2t | 2t+8, pairs),
 * B regs (k 2t | 2t+8, pairs; n g), C/D (row g | g+8, col 2t, 2t+1)) and gets its part of
 * D = A·B + C, summed in f32 in k order. */
void emu_mma_f16(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1, float *c) {
    int warp = current / 32, lane = current % 32;
    mma_a[current][0] = a0; mma_a[current][1] = a1; mma_a[current][2] = a2; mma_a[current][3] = a3;
    mma_b[current][0] = b0; mma_b[current][1] = b1;
    meet(warp);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        int g = l / 4, t = l % 4, src = warp * 32 + l;
        for (int i = 0; i < 2; i++) {
            A[g][2 * t + i] = half_of(mma_a[src][0], i);
            A[g + 8][2 * t + i] = half_of(mma_a[src][1], i);
            A[g][2 * t + 8 + i] = half_of(mma_a[src][2], i);
            A[g + 8][2 * t + 8 + i] = half_of(mma_a[src][3], i);
            B[2 * t + i][g] = half_of(mma_b[src][0], i);
            B[2 * t + 8 + i][g] = half_of(mma_b[src][1], i);
        }
    }
    meet(warp);
    int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 2; i++) {
            float acc = c[2 * r + i];
            for (int k = 0; k < 16; k++) acc += A[g + 8 * r][k] * B[k][2 * t + i];
            c[2 * r + i] = acc;
        }
}

/* Run `fn` over the grid; returns 0, or -1 if the block is too large, -2 on a deadlock. */
int emu_launch(entry_fn fn, void **params, int gx, int gy, int gz, int bx, int by, int bz) {
    threads = bx * by * bz;
    if (threads < 1 || threads > MAX_THREADS) return -1;
    if (!stacks && !(stacks = malloc((size_t)MAX_THREADS * STACK_BYTES))) return -1;
    entry = fn;
    entry_params = params;
    block_dim[0] = bx; block_dim[1] = by; block_dim[2] = bz;
    for (int z = 0; z < gz; z++)
        for (int y = 0; y < gy; y++)
            for (int x = 0; x < gx; x++) {
                block_idx[0] = x; block_idx[1] = y; block_idx[2] = z;
                memset(arrived, 0, sizeof arrived);
                memset(live, 0, sizeof live);
                for (int t = 0; t < threads; t++) {
                    contexts[t] = fresh_context(stacks + (size_t)t * STACK_BYTES);
                    done[t] = waiting[t] = 0;
                    live[t / 32]++;
                }
                live[MAX_THREADS / 32] = threads;
                for (;;) {
                    int live = 0;
                    long before = progress;
                    for (int t = 0; t < threads; t++) {
                        if (done[t]) continue;
                        live++;
                        current = t;
                        emu_switch(&scheduler, contexts[t]);
                    }
                    if (!live) break;
                    if (progress == before) return -2;
                }
            }
    return 0;
}
