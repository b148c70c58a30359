/* ibckpt-front: the compiled first step of ibckpt-hook and ibckpt-runc.
 *
 * The runtime starts the hook for every container of the node (hooks.d
 * `always`) and the wrapper for every runc call of an ibckpt pod. Most of
 * those calls are not ours: a container without RDMA, or a runc subcommand
 * other than create, run and start. This program answers them without
 * starting Python (0.4-0.8 s a start in the testbed's guests) and execs the
 * Python launcher for the rest. Its decisions are the Python code's fast
 * paths (ibckpt_node/hook/main.py, runc.py): anything it cannot decide goes
 * to Python.
 *
 * Installed as PREFIX/bin/ibckpt-hook and PREFIX/bin/ibckpt-runc (the file's
 * name says which); Python's launchers are PREFIX/lib/ibckpt/launch/<name>,
 * and PREFIX/lib/ibckpt/runc links to the node's runc ($IBCKPT_RUNC wins).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_READ (64u << 20) /* a config.json or a state past this is not plain */

static const char *const MARKERS[] = {"/dev/infiniband", "ibckpt.io/"};
/* runc's global flags that take a value, and create's (runc.py) */
static const char *const GLOBAL_VALUE_FLAGS[] = {"root", "log", "log-format", "criu", "rootless", NULL};
static const char *const CREATE_VALUE_FLAGS[] = {"bundle", "b", "console-socket", "pid-file", "preserve-fds", NULL};

struct buf {
	char *data;
	size_t len;
};

static int read_all_into(int fd, struct buf *out, size_t cap)
{
	out->len = 0;
	out->data = malloc(cap + 1);
	if (!out->data)
		return -1;
	for (;;) {
		ssize_t n;

		if (out->len == cap) {
			char *more;

			if (cap >= MAX_READ)
				return -1;
			cap *= 2;
			more = realloc(out->data, cap + 1);
			if (!more)
				return -1;
			out->data = more;
		}
		n = read(fd, out->data + out->len, cap - out->len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -1;
		if (n == 0)
			break;
		out->len += (size_t)n;
	}
	out->data[out->len] = '\0';
	return 0;
}

static int read_all(int fd, struct buf *out)
{
	if (read_all_into(fd, out, 1 << 14) == 0)
		return 0;
	free(out->data);
	out->data = NULL;
	return -1;
}

static const char *find_bytes(const struct buf *b, size_t from, const char *s)
{
	return memmem(b->data + from, b->len - from, s, strlen(s));
}

/* Whether the bundle's config.json shows the container cannot be ours: none
 * of the markers in its bytes (a writer that escapes "/" could hide them). */
static int plain_bundle(const char *bundle)
{
	char path[PATH_MAX];
	struct buf spec;
	int fd, plain = 0;
	size_t i;

	if (snprintf(path, sizeof(path), "%s/config.json", bundle) >= (int)sizeof(path))
		return 0;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	if (read_all(fd, &spec) == 0) {
		plain = !find_bytes(&spec, 0, "\\/");
		for (i = 0; plain && i < sizeof(MARKERS) / sizeof(MARKERS[0]); i++)
			plain = !find_bytes(&spec, 0, MARKERS[i]);
	}
	free(spec.data);
	close(fd);
	return plain;
}

/* The state's "bundle" value into `out` when it is plain (once, no escapes);
 * else -1: the Python hook then parses the JSON properly. */
static int state_bundle(const struct buf *state, char *out, size_t len)
{
	const char *key = "\"bundle\"";
	const char *at = find_bytes(state, 0, key);
	const char *p, *end;

	if (!at || find_bytes(state, (size_t)(at - state->data) + 1, key))
		return -1;
	p = at + strlen(key);
	p += strspn(p, " \t\r\n");
	if (*p != ':')
		return -1;
	p++;
	p += strspn(p, " \t\r\n");
	if (*p != '"')
		return -1;
	end = strchr(p + 1, '"');
	if (!end || memchr(p + 1, '\\', (size_t)(end - p - 1)) || (size_t)(end - p - 1) >= len)
		return -1;
	memcpy(out, p + 1, (size_t)(end - p - 1));
	out[end - p - 1] = '\0';
	return 0;
}

static int named(const char *name, const char *const *list)
{
	for (; *list; list++)
		if (!strcmp(name, *list))
			return 1;
	return 0;
}

/* An argument's flag name (dashes off, up to '='), into `name`; whether it
 * carries its value after '='. */
static int flag_name(const char *arg, char *name, size_t len)
{
	const char *eq;
	size_t n;

	arg += strspn(arg, "-");
	eq = strchr(arg, '=');
	n = eq ? (size_t)(eq - arg) : strlen(arg);
	if (n >= len)
		n = len - 1;
	memcpy(name, arg, n);
	name[n] = '\0';
	return eq != NULL;
}

static int is_flag(const char *arg)
{
	return arg[0] == '-' && strcmp(arg, "-");
}

/* The index of runc's subcommand in argv (after the global flags), or -1. */
static int find_command(int argc, char **argv)
{
	char name[64];
	int i = 1;

	while (i < argc) {
		if (!strcmp(argv[i], "--"))
			return i + 1 < argc ? i + 1 : -1;
		if (!is_flag(argv[i]))
			return i;
		i += !flag_name(argv[i], name, sizeof(name)) && named(name, GLOBAL_VALUE_FLAGS) ? 2 : 1;
	}
	return -1;
}

/* create's or run's bundle: --bundle/-b, else the working directory (NULL
 * when it cannot be told). */
static const char *create_bundle(int argc, char **argv, int at, char *cwd, size_t len)
{
	char name[64];
	int i;

	for (i = at + 1; i < argc && is_flag(argv[i]); i++) {
		int inline_value = flag_name(argv[i], name, sizeof(name));

		if (!strcmp(name, "bundle") || !strcmp(name, "b")) {
			if (inline_value)
				return strchr(argv[i], '=') + 1;
			return i + 1 < argc ? argv[i + 1] : NULL;
		}
		if (!inline_value && named(name, CREATE_VALUE_FLAGS))
			i++;
	}
	return getcwd(cwd, len);
}

/* This program's path. An install that replaced the file since the exec
 * leaves " (deleted)" after it: the path is still the right one. */
static int self_path(char *out, size_t len)
{
	static const char deleted[] = " (deleted)";
	ssize_t n = readlink("/proc/self/exe", out, len - 1);
	size_t d = sizeof(deleted) - 1;

	if (n <= 0)
		return -1;
	out[n] = '\0';
	if ((size_t)n > d && !strcmp(out + n - d, deleted))
		out[n - d] = '\0';
	return 0;
}

/* PREFIX/lib/ibckpt/<rest>, PREFIX being two levels above this file. */
static int lib_path(char *out, size_t len, const char *rest)
{
	char exe[PATH_MAX];
	char *slash;
	int i;

	if (self_path(exe, sizeof(exe)))
		return -1;
	for (i = 0; i < 2; i++) {
		slash = strrchr(exe, '/');
		if (!slash)
			return -1;
		*slash = '\0';
	}
	return snprintf(out, len, "%s/lib/ibckpt/%s", exe, rest) < (int)len ? 0 : -1;
}

static int fail(const char *self, const char *what, const char *path)
{
	fprintf(stderr, "%s: %s %s: %s\n", self, what, path, strerror(errno));
	return 127;
}

/* Hand the call to Python's launcher, with `state` (if any) as its stdin. */
static int slow_path(const char *self, char **argv, const struct buf *state)
{
	char launcher[PATH_MAX], rest[NAME_MAX + 8];

	snprintf(rest, sizeof(rest), "launch/%s", self);
	if (lib_path(launcher, sizeof(launcher), rest))
		return fail(self, "cannot find", "its launcher");
	if (state) {
		int fd = memfd_create("ibckpt-hook-state", MFD_CLOEXEC);
		size_t off = 0;

		if (fd < 0)
			return fail(self, "cannot keep", "the state");
		while (off < state->len) {
			ssize_t n = write(fd, state->data + off, state->len - off);

			if (n < 0 && errno == EINTR)
				continue;
			if (n <= 0)
				return fail(self, "cannot keep", "the state");
			off += (size_t)n;
		}
		if (lseek(fd, 0, SEEK_SET) < 0 || dup2(fd, STDIN_FILENO) < 0)
			return fail(self, "cannot pass", "the state");
	}
	argv[0] = launcher;
	execv(launcher, argv);
	return fail(self, "cannot run", launcher);
}

static int hook(char **argv)
{
	char bundle[PATH_MAX];
	struct buf state;

	if (read_all(STDIN_FILENO, &state))
		return fail("ibckpt-hook", "cannot read", "the state on stdin");
	if (state_bundle(&state, bundle, sizeof(bundle)) == 0 && plain_bundle(bundle)) {
		free(state.data);
		return 0;
	}
	return slow_path("ibckpt-hook", argv, &state);
}

static int runc(int argc, char **argv)
{
	char real[PATH_MAX], cwd[PATH_MAX];
	const char *command, *bundle, *chosen = getenv("IBCKPT_RUNC");
	int at = find_command(argc, argv);

	command = at > 0 ? argv[at] : "";
	if (strcmp(command, "create") && strcmp(command, "run") && strcmp(command, "start"))
		goto pass;
	if (!strcmp(command, "start")) /* a restored container's start is answered there */
		return slow_path("ibckpt-runc", argv, NULL);
	bundle = create_bundle(argc, argv, at, cwd, sizeof(cwd));
	if (!bundle || !plain_bundle(bundle))
		return slow_path("ibckpt-runc", argv, NULL);
pass:
	if (!chosen || !*chosen) {
		if (lib_path(real, sizeof(real), "runc"))
			return fail("ibckpt-runc", "cannot find", "runc");
		chosen = real;
	}
	argv[0] = (char *)chosen;
	execv(chosen, argv);
	return fail("ibckpt-runc", "cannot run", chosen);
}

int main(int argc, char **argv)
{
	char exe[PATH_MAX];
	const char *name;

	if (self_path(exe, sizeof(exe)))
		return fail("ibckpt-front", "cannot read", "/proc/self/exe");
	name = strrchr(exe, '/') ? strrchr(exe, '/') + 1 : exe;
	if (!strcmp(name, "ibckpt-hook"))
		return hook(argv);
	if (!strcmp(name, "ibckpt-runc"))
		return runc(argc, argv);
	fprintf(stderr, "ibckpt-front: installed as %s; it runs as ibckpt-hook or ibckpt-runc\n", name);
	return 2;
}
