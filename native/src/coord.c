/* Client of the job coordinator (a key-value store with blocking get) and
 * the table of peers' virtual->real ids learnt from it.
 * Wire format, text lines; a connection may carry several requests, which
 * are answered in order:
 *   PUT <key> <value...>\n        -> OK\n
 *   GET <key> <timeout_ms>\n      -> VAL <value...>\n | NONE\n            */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "coord.h"
#include "fork.h"
#include "shim.h"

atomic_int ibk_translating;
atomic_int ibk_xlate_any;

int ibk_coord_configured(void)
{
	const char *c = getenv("IBCKPT_COORD");

	return c && *c;
}

/* Bounds connect (Linux applies SO_SNDTIMEO to it), every read and every
 * write on fd. */
static void set_io_timeout(int fd, int timeout_ms)
{
	struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};

	if (timeout_ms <= 0)
		tv.tv_usec = 1000;
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

static int coord_connect(int timeout_ms)
{
	const char *c = getenv("IBCKPT_COORD");
	int fd;

	if (!c || !*c)
		return -ENOTCONN;
	if (!strncmp(c, "unix:", 5)) {
		struct sockaddr_un sa;

		memset(&sa, 0, sizeof(sa));
		sa.sun_family = AF_UNIX;
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", c + 5);
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		set_io_timeout(fd, timeout_ms);
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
			close(fd);
			return -errno;
		}
		return fd;
	} else {
		char host[256], *port;
		struct addrinfo hints, *ai;

		snprintf(host, sizeof(host), "%s", c);
		port = strrchr(host, ':');
		if (!port)
			return -EINVAL;
		*port++ = 0;
		memset(&hints, 0, sizeof(hints));
		hints.ai_socktype = SOCK_STREAM;
		if (getaddrinfo(host, port, &hints, &ai))
			return -EHOSTUNREACH;
		fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd >= 0)
			set_io_timeout(fd, timeout_ms);
		if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen)) {
			close(fd);
			fd = -ECONNREFUSED;
		}
		freeaddrinfo(ai);
		return fd;
	}
}

/* The coordinator answers a GET within its own timeout: this much more is
 * the most a request may take, on the control thread or an app's. */
#define COORD_SLACK_MS 1000

static int coord_request(const char *req, char *reply, size_t len, int timeout_ms)
{
	int fd = coord_connect(timeout_ms + COORD_SLACK_MS);
	size_t got = 0, n = strlen(req);
	ssize_t r;

	if (fd < 0)
		return fd;
	while (n) {
		r = write(fd, req, n);
		if (r <= 0) {
			close(fd);
			return -EIO;
		}
		req += r;
		n -= (size_t)r;
	}
	while (got + 1 < len) {
		r = read(fd, reply + got, len - got - 1);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		got += (size_t)r;
		if (reply[got - 1] == '\n')
			break;
	}
	close(fd);
	reply[got] = 0;
	if (got && reply[got - 1] == '\n')
		reply[got - 1] = 0;
	return got ? 0 : -EIO;
}

int ibk_coord_get(const char *key, char *val, size_t len, int timeout_ms)
{
	char req[512];
	char *rep = malloc(len + 8);
	int rc;

	if (!rep)
		return -ENOMEM;
	snprintf(req, sizeof(req), "GET %s %d\n", key, timeout_ms);
	rc = coord_request(req, rep, len + 8, timeout_ms > 0 ? timeout_ms : 0);
	if (!rc) {
		if (!strncmp(rep, "VAL ", 4))
			snprintf(val, len, "%s", rep + 4);
		else
			rc = -ENOENT;
	}
	free(rep);
	return rc;
}

int ibk_coord_batch_put(struct ibk_coord_batch *b, const char *key, const char *val)
{
	size_t need = strlen(key) + strlen(val) + 8;

	if (b->len + need > b->cap) {
		size_t cap = b->cap ? b->cap : 4096;
		char *p;

		while (cap < b->len + need)
			cap *= 2;
		p = realloc(b->buf, cap);
		if (!p)
			return -ENOMEM;
		b->buf = p;
		b->cap = cap;
	}
	b->len += (size_t)snprintf(b->buf + b->len, b->cap - b->len, "PUT %s %s\n", key, val);
	b->n++;
	return 0;
}

/* Counts the complete "OK" lines in buf[0..*held), keeps a partial one. */
static int count_oks(char *buf, size_t *held, int *oks)
{
	char *line = buf, *nl;

	buf[*held] = 0;
	for (; (nl = strchr(line, '\n')); line = nl + 1) {
		*nl = 0;
		if (strcmp(line, "OK"))
			return -EPROTO;
		(*oks)++;
	}
	*held -= (size_t)(line - buf);
	memmove(buf, line, *held);
	return 0;
}

static long coord_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The PUTs are written while the OKs are read: written first and read
 * after, the coordinator's thousands of small OKs filled the socket's
 * buffer, it stopped reading, and both sides waited until the rebuild's
 * timeout (2,048 QPs publish 8,192 records). */
int ibk_coord_batch_send(struct ibk_coord_batch *b, int timeout_ms)
{
	long deadline = coord_ms() + timeout_ms;
	size_t off = 0, held = 0;
	char rep[4096];
	int fd, rc = 0, oks = 0;

	if (!b->n)
		goto out;
	fd = coord_connect(timeout_ms + COORD_SLACK_MS);
	if (fd < 0) {
		rc = fd;
		goto out;
	}
	while (!rc && oks < b->n) {
		struct pollfd pf = {.fd = fd, .events = (short)(POLLIN | (off < b->len ? POLLOUT : 0))};
		long left = deadline - coord_ms();

		if (left <= 0) {
			rc = -ETIMEDOUT;
			break;
		}
		if (poll(&pf, 1, (int)left) < 0) {
			if (errno != EINTR)
				rc = -EIO;
			continue;
		}
		if (pf.revents & POLLOUT) {
			ssize_t w = send(fd, b->buf + off, b->len - off, MSG_DONTWAIT | MSG_NOSIGNAL);

			if (w > 0)
				off += (size_t)w;
			else if (w < 0 && errno != EAGAIN && errno != EINTR)
				rc = -EIO;
		}
		if (!rc && (pf.revents & (POLLIN | POLLHUP | POLLERR))) {
			ssize_t r = recv(fd, rep + held, sizeof(rep) - 1 - held, MSG_DONTWAIT);

			if (r > 0) {
				held += (size_t)r;
				rc = count_oks(rep, &held, &oks);
				if (!rc && held == sizeof(rep) - 1)
					rc = -EPROTO; /* no OK is that long */
			} else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
				rc = -EIO;
			}
		}
	}
	close(fd);
out:
	free(b->buf);
	memset(b, 0, sizeof(*b));
	return rc;
}

/* ---- peers ------------------------------------------------------------------ */

static pthread_mutex_t peers_lock = PTHREAD_MUTEX_INITIALIZER;
static struct ibk_peer_map *peers;
static size_t npeers, cap_peers;

/* A thread of the parent may have held it: the table itself stays, the
 * peers' ids are the same for the child. */
void ibk_peers_fork_child(void)
{
	pthread_mutex_init(&peers_lock, NULL);
}

void ibk_peers_put(const struct ibk_peer_map *p)
{
	static const union ibv_gid zero;
	union ibv_gid prev = zero;
	size_t i;

	pthread_mutex_lock(&peers_lock);
	for (i = 0; i < npeers; i++)
		if (peers[i].vqpn == p->vqpn && !memcmp(&peers[i].vgid, &p->vgid, sizeof(p->vgid)))
			break;
	if (i < npeers)
		prev = memcmp(&peers[i].rgid, &p->rgid, sizeof(prev)) && memcmp(&peers[i].rgid, &zero, sizeof(prev))
			       ? peers[i].rgid
			       : peers[i].prev_rgid;
	if (i == npeers) {
		if (npeers == cap_peers) {
			size_t nc = cap_peers ? cap_peers * 2 : 16;
			struct ibk_peer_map *np = realloc(peers, nc * sizeof(*np));

			if (!np) {
				pthread_mutex_unlock(&peers_lock);
				return;
			}
			peers = np;
			cap_peers = nc;
		}
		npeers++;
	}
	peers[i] = *p;
	peers[i].prev_rgid = prev;
	pthread_mutex_unlock(&peers_lock);
}

static void peers_forget(const struct ibk_peer_map *p)
{
	size_t i;

	pthread_mutex_lock(&peers_lock);
	for (i = 0; i < npeers; i++)
		if (peers[i].vqpn == p->vqpn && !memcmp(&peers[i].vgid, &p->vgid, sizeof(p->vgid))) {
			peers[i] = peers[--npeers];
			break;
		}
	pthread_mutex_unlock(&peers_lock);
}

int ibk_peers_lookup(const union ibv_gid *vgid, uint32_t vqpn, struct ibk_peer_map *out)
{
	size_t i;
	int rc = -ENOENT;

	pthread_mutex_lock(&peers_lock);
	for (i = 0; i < npeers; i++)
		if (peers[i].vqpn == vqpn && !memcmp(&peers[i].vgid, vgid, sizeof(*vgid))) {
			*out = peers[i];
			rc = 0;
			break;
		}
	pthread_mutex_unlock(&peers_lock);
	return rc;
}

int ibk_peers_lookup_gid(const union ibv_gid *vgid, union ibv_gid *rgid)
{
	size_t i;
	int rc = -ENOENT;

	pthread_mutex_lock(&peers_lock);
	for (i = 0; i < npeers; i++)
		if (!memcmp(&peers[i].vgid, vgid, sizeof(*vgid))) {
			*rgid = peers[i].rgid;
			rc = 0;
			break;
		}
	pthread_mutex_unlock(&peers_lock);
	return rc;
}

int ibk_peers_reverse_qpn(uint32_t rqpn, uint32_t *vqpn)
{
	size_t i;
	int rc = -ENOENT;

	pthread_mutex_lock(&peers_lock);
	for (i = 0; i < npeers; i++)
		if (peers[i].rqpn == rqpn) {
			*vqpn = peers[i].vqpn;
			rc = 0;
			break;
		}
	pthread_mutex_unlock(&peers_lock);
	return rc;
}

/* A peer's virtual GID from the real one its packets carry; the peer
 * that also has this virtual QPN first (processes on one node share a
 * real GID but may have brought different virtual ones). */
int ibk_peers_reverse_gid(const union ibv_gid *rgid, uint32_t vqpn, int past, union ibv_gid *vgid)
{
	size_t i;
	int rc = -ENOENT;

	pthread_mutex_lock(&peers_lock);
	for (i = 0; i < npeers; i++)
		if (!memcmp(past ? &peers[i].prev_rgid : &peers[i].rgid, rgid, sizeof(*rgid)) &&
		    (rc || peers[i].vqpn == vqpn)) {
			*vgid = peers[i].vgid;
			rc = 0;
			if (peers[i].vqpn == vqpn)
				break;
		}
	pthread_mutex_unlock(&peers_lock);
	return rc;
}

int ibk_peers_fetch(const union ibv_gid *vgid, uint32_t vqpn, int timeout_ms)
{
	char key[128], val[256];
	struct ibk_peer_map p;
	struct ibk_record r;

	if (!ibk_coord_configured())
		return -ENOTCONN;
	ibk_record_key_map(key, sizeof(key), vgid, vqpn);
	if (ibk_coord_get(key, val, sizeof(val), timeout_ms))
		return -ENOENT;
	if (ibk_record_parse(val, 0, &r))
		return -EPROTO;
	p.vgid = *vgid;
	p.vqpn = vqpn;
	p.rgid = r.rgid;
	p.rqpn = r.rqpn;
	p.rlid = r.rlid;
	p.vlid = 0;
	p.epoch = 0;
	ibk_peers_put(&p);
	return 0;
}

void ibk_peers_refresh(uint64_t epoch, int timeout_ms)
{
	struct ibk_peer_map *copy;
	size_t n, i;

	pthread_mutex_lock(&peers_lock);
	n = npeers;
	copy = n ? malloc(n * sizeof(*copy)) : NULL;
	if (copy)
		memcpy(copy, peers, n * sizeof(*copy));
	pthread_mutex_unlock(&peers_lock);
	for (i = 0; copy && i < n; i++) {
		char key[128], hex[IBK_GID_HEX], val[256];
		struct ibk_peer_map *p = &copy[i];
		struct ibk_record r;
		/* a peer that is gone must not hold the rebuild for long */
		int wait = timeout_ms < 5000 ? timeout_ms : 5000;

		if (p->epoch == epoch)
			continue;
		ibk_gid_hex(&p->vgid, hex);
		ibk_record_key_qp(key, sizeof(key), epoch, &p->vgid, p->vqpn);
		/* val holds the record's head; the rkeys that may not fit are not needed */
		if (ibk_coord_get(key, val, sizeof(val), wait > 0 ? wait : 0) || ibk_record_parse(val, 1, &r)) {
			ibk_log("rebuild: peer %s/%u published nothing in epoch %llu: forgotten", hex, p->vqpn,
				(unsigned long long)epoch);
			peers_forget(p);
			continue;
		}
		p->rgid = r.rgid;
		p->rqpn = r.rqpn;
		p->rlid = r.rlid;
		p->epoch = epoch;
		ibk_peers_put(p);
	}
	free(copy);
}
