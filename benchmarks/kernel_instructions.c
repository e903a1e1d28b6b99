/* Drives cpu_linear.c's linear() over one decoder layer's four projections of the built-in model's shape (qkv
 * 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536), bf16 activations, one thread, REPS times, for
 * benchmarks/kernel_instructions.py to count instructions under valgrind. The weights are random bytes with small
 * fp16 scales: no path of the kernels branches on their values. Usage: kernel_instructions FMT ROWS REPS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int linear(const void *xin, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int fmt, int64_t N,
           const float *bias, void *yout, int64_t ldy, int y_bf16, int nthreads);
int64_t block_nbytes(int fmt);

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    const int fmt = atoi(argv[1]), rows = atoi(argv[2]), reps = atoi(argv[3]);
    const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    uint8_t *w[4];
    int64_t total = 0;
    uint32_t seed = 1;
    for (int i = 0; i < 4; i++) {
        const int64_t n = shapes[i][0], k = shapes[i][1];
        const int64_t bytes = fmt == 1 ? n * k * 2 : (n + 15) / 16 * ((k + 31) / 32) * block_nbytes(fmt);
        w[i] = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        for (int64_t j = 0; j < bytes; j++) w[i][j] = (uint8_t)((seed = seed * 1103515245u + 12345u) >> 24) & 0x3b;
        total += bytes;
    }
    uint16_t *x = malloc(sizeof(uint16_t) * 64 * 1536), *y = malloc(sizeof(uint16_t) * 64 * 3072);
    for (int j = 0; j < 64 * 1536; j++) x[j] = (uint16_t)(0x3f80 + j % 64);
    for (int r = 0; r < reps; r++)
        for (int i = 0; i < 4; i++)
            if (linear(x, shapes[i][1], 1, rows, shapes[i][1], w[i], fmt, shapes[i][0], NULL, y, shapes[i][0], 1, 1))
                return 1;
    printf("%lld\n", (long long)total);
    return 0;
}
