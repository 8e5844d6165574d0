/* The peer of `zeropp bench collectives`: the same collectives, sizes and
 * bus-bandwidth formulas through Open MPI (MPI_Allgather,
 * MPI_Reduce_scatter_block, MPI_Allreduce, MPI_Alltoall). Built with mpicc
 * and started with mpirun by rank 0 of the bench after its own rows.
 * Usage: mpi_collectives ITERS SIZE... ; prints "size ag rs ar a2a" in GB/s
 * (one line per size, from rank 0). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void once(int which, void *a, void *b, long size, int p) {
    switch (which) {
    case 0: MPI_Allgather(a, (int)(size / p), MPI_BYTE, b, (int)(size / p), MPI_BYTE, MPI_COMM_WORLD); break;
    case 1: MPI_Reduce_scatter_block(a, b, (int)(size / 4 / p), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case 2: MPI_Allreduce(a, b, (int)(size / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    default: MPI_Alltoall(a, (int)(size / p), MPI_BYTE, b, (int)(size / p), MPI_BYTE, MPI_COMM_WORLD); break;
    }
}

/* As the zeropp side times: WARMUP runs, then the mean of ITERS runs, the
 * slowest rank's. */
#define WARMUP 5
static double timed(int iters, int which, void *a, void *b, long size, int p) {
    for (int i = 0; i < WARMUP; i++) once(which, a, b, size, p);
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    for (int i = 0; i < iters; i++) once(which, a, b, size, p);
    t = (MPI_Wtime() - t) / iters;
    double slowest;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int me, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    int iters = atoi(argv[1]);
    for (int s = 2; s < argc; s++) {
        long size = atol(argv[s]);
        void *a = malloc(size), *b = malloc(size);
        memset(a, 1, size);
        memset(b, 0, size);
        double moved = (double)size * (p - 1) / p;
        double t[4];
        for (int w = 0; w < 4; w++) t[w] = timed(iters, w, a, b, size, p);
        if (me == 0)
            printf("%ld %.6f %.6f %.6f %.6f\n", size, moved / t[0] / 1e9, moved / t[1] / 1e9,
                   2 * moved / t[2] / 1e9, moved / t[3] / 1e9);
        fflush(stdout);
        free(a);
        free(b);
    }
    MPI_Finalize();
    return 0;
}
