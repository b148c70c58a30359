/* An iterative 1-D Jacobi solver split over MPI ranks: halo exchange with
 * neighbours (point-to-point) and a global residual (allreduce) per step.
 * The result is deterministic, so a checkpointed run must print exactly
 * what an uninterrupted one prints.  -s MS sleeps per step to give a
 * checkpoint time to land mid-run; with -f FILE rank 0 stops sleeping once
 * FILE exists, so a test can let the rest of the run go at full speed (the
 * allreduce paces every rank, and sleeping never changes the numbers). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CELLS_PER_RANK 4096

int main(int argc, char **argv)
{
	int rank, size, steps = 400, sleep_ms = 0, c;
	const char *fast_file = NULL;
	double *u, *v, residual = 0.0, sum, total;

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	while ((c = getopt(argc, argv, "n:s:f:")) != -1) {
		if (c == 'n')
			steps = atoi(optarg);
		else if (c == 's')
			sleep_ms = atoi(optarg);
		else if (c == 'f')
			fast_file = optarg;
	}
	u = calloc(CELLS_PER_RANK + 2, sizeof(*u));
	v = calloc(CELLS_PER_RANK + 2, sizeof(*v));
	/* boundary: left end held at 1.0, right end at 0.0 */
	for (int step = 0; step < steps; step++) {
		int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
		int right = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;

		if (rank == 0)
			u[0] = 1.0;
		if (rank == size - 1)
			u[CELLS_PER_RANK + 1] = 0.0;
		MPI_Sendrecv(&u[1], 1, MPI_DOUBLE, left, 0, &u[CELLS_PER_RANK + 1], 1, MPI_DOUBLE, right, 0,
			     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		MPI_Sendrecv(&u[CELLS_PER_RANK], 1, MPI_DOUBLE, right, 1, &u[0], 1, MPI_DOUBLE, left, 1,
			     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		if (rank == 0)
			u[0] = 1.0;
		sum = 0.0;
		for (int i = 1; i <= CELLS_PER_RANK; i++) {
			v[i] = 0.5 * (u[i - 1] + u[i + 1]);
			sum += (v[i] - u[i]) * (v[i] - u[i]);
		}
		memcpy(&u[1], &v[1], CELLS_PER_RANK * sizeof(*u));
		MPI_Allreduce(&sum, &residual, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
		if (rank == 0 && step % 50 == 0) {
			printf("step %d residual %.12e\n", step, residual);
			fflush(stdout);
		}
		if (sleep_ms && fast_file && rank == 0 && access(fast_file, F_OK) == 0)
			sleep_ms = 0;
		if (sleep_ms && (!fast_file || rank == 0)) {
			struct timespec ts = { sleep_ms / 1000, (sleep_ms % 1000) * 1000000L };
			nanosleep(&ts, NULL);
		}
	}
	sum = 0.0;
	for (int i = 1; i <= CELLS_PER_RANK; i++)
		sum += u[i];
	MPI_Reduce(&sum, &total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0)
		printf("RESULT steps=%d ranks=%d residual=%.12e total=%.12e\n", steps, size, residual, total);
	free(u);
	free(v);
	MPI_Finalize();
	return 0;
}
