/* A CRIU plugin that lets a pre-dump pass over a process whose verbs
 * device is still open.
 *
 * CRIU refuses any mapping of a character device it does not know, and a
 * live verbs context maps its uverbs device (queues, doorbells). A pre-dump
 * copies only private memory, so such a mapping needs no contents: the
 * plugin claims mappings of the uverbs devices and CRIU keeps just their
 * layout. The final dump runs after the shim released the device, so it
 * never meets one. The plugin claims nothing else, and CRIU loads it only
 * where the node agent points CRIU_LIBS_DIR (docs/node-agent.md).
 *
 * CRIU's plugin ABI, as of its version 0.2 (CRIU 3.16 and later): a
 * descriptor named CR_PLUGIN_DESC with a table of hooks by number; hook 7
 * is called with the mapping's fd and stat, and answers 0 to claim it or
 * -ENOTSUP to pass. Declared here so that building needs no CRIU headers. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#define PLUGIN_VERSION ((0 << 16) + (2 << 8) + 0)
#define HOOK_HANDLE_DEVICE_VMA 7
#define HOOKS (HOOK_HANDLE_DEVICE_VMA + 1)
/* The kernel's fixed major for /dev/infiniband/uverbsN (include/rdma/ib_verbs.h
 * and drivers/infiniband/core/uverbs_main.c: IB_UVERBS_MAJOR); a node with
 * many devices may also get dynamic majors, named in /proc/devices. */
#define UVERBS_MAJOR 231

struct plugin_desc {
	const char *name;
	int (*init)(int stage);
	void (*exit)(int stage, int ret);
	unsigned int version;
	unsigned int max_hooks;
	void *hooks[HOOKS];
};

static unsigned int dynamic_major;

/* The dynamic major of "infiniband_verbs", if the kernel gave one. */
static void read_dynamic_major(void)
{
	char line[128], name[64];
	unsigned int major;
	FILE *f;

	f = fopen("/proc/devices", "r");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "%u %63s", &major, name) == 2 && major != UVERBS_MAJOR &&
		    !strcmp(name, "infiniband_verbs"))
			dynamic_major = major;
	fclose(f);
}

static int plugin_init(int stage)
{
	(void)stage;
	read_dynamic_major();
	return 0;
}

static void plugin_exit(int stage, int ret)
{
	(void)stage;
	(void)ret;
}

static int handle_device_vma(int fd, const struct stat *st)
{
	unsigned int major;

	(void)fd;
	if (!S_ISCHR(st->st_mode))
		return -ENOTSUP;
	major = major(st->st_rdev);
	if (major == UVERBS_MAJOR || (dynamic_major && major == dynamic_major))
		return 0;
	return -ENOTSUP;
}

__attribute__((visibility("default"))) struct plugin_desc CR_PLUGIN_DESC = {
	.name = "ibckpt_uverbs",
	.init = plugin_init,
	.exit = plugin_exit,
	.version = PLUGIN_VERSION,
	.max_hooks = HOOKS,
	.hooks = { [HOOK_HANDLE_DEVICE_VMA] = (void *)handle_device_vma },
};
