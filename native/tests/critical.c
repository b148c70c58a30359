/* critical: a library's use of ibckpt.h.  It declares the API weak (it also
 * runs without the shim), registers QUIESCE/RESUME callbacks, and holds a
 * critical section until a file appears; a checkpoint asked for meanwhile
 * must wait for it.  Each event is a line on stdout, in the order it
 * happened.
 *
 *   critical -d DIR    DIR/leave1 ends the first section; a second one is
 *                      then held until DIR/leave2; DIR/stop ends the run */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "ibckpt.h"
#include "common.h"

#pragma weak ibckpt_critical_enter
#pragma weak ibckpt_critical_leave
#pragma weak ibckpt_register_callback
#pragma weak ibckpt_phase

static char dir[200];

static int exists(const char *name)
{
	char p[300];

	snprintf(p, sizeof(p), "%s/%s", dir, name);
	return file_exists(p);
}

static void wait_for(const char *name)
{
	struct timespec nap = {0, 20 * 1000 * 1000};

	while (!exists(name))
		nanosleep(&nap, NULL);
}

static void on_event(enum ibckpt_event ev, void *arg)
{
	(void)arg;
	printf("CALLBACK %s\n", ev == IBCKPT_EV_QUIESCE ? "QUIESCE" : "RESUME");
}

int main(int argc, char **argv)
{
	struct ibv_context *ctx;
	struct ibv_pd *pd;

	if (argc != 3 || strcmp(argv[1], "-d"))
		DIE("usage: critical -d DIR");
	snprintf(dir, sizeof(dir), "%s", argv[2]);
	setvbuf(stdout, NULL, _IOLBF, 0);
	ctx = open_first_device(); /* the shim's control socket starts here */
	pd = ibv_alloc_pd(ctx);
	if (!pd)
		DIE("pd");
	if (!ibckpt_critical_enter) {
		printf("NO SHIM\n");
		return 0;
	}
	if (ibckpt_register_callback(on_event, NULL))
		DIE("register");
	ibckpt_critical_enter();
	printf("ENTERED 1\n");
	printf("READY\n");
	wait_for("leave1");
	printf("LEAVING 1\n");
	ibckpt_critical_leave();
	/* the next section opens only once the checkpoint has resumed */
	ibckpt_critical_enter();
	printf("ENTERED 2 %s\n", ibckpt_phase());
	wait_for("leave2");
	printf("LEAVING 2\n");
	ibckpt_critical_leave();
	wait_for("stop");
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("DONE\n");
	return 0;
}
