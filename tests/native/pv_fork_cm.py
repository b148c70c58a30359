"""An rdma_cm program on Debian's pyverbs written as a third party would write it: a parent that
forks its workers with multiprocessing, a server and a client, which connect over rdma_cm and
exchange messages (run by test_fork_guest.py with and without the shim, not collected by pytest).

Usage: pv_fork_cm.py MODE PORT, MODE one of
  fresh      the parent touches no verbs before it forks
  opened     the parent opens the device, an event channel and an id of its own before it forks
  fork_init  as opened, after ibv_fork_init()

Each worker also makes an event channel of its own and resolves an address on it (what failed in
the children under the shim: issue 29). After the workers, the parent itself connects to a new
server worker, so the parent keeps working too. The output must be the same with and without the
shim, but for the lines that start with "shim:": under the shim, what each worker's own control
socket says while it is connected (the status reply, its rdma_cm channels and QPs, and how many of
its `unsupported` entries are its parent's device or channel, which it still holds)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
from typing import Any

import pyverbs.cm_enums as ce
from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel
from pyverbs.device import Context
from pyverbs.qp import QPCap, QPInitAttr

ADDR = "10.77.0.1"  # rxe0's address in the guest
SIZE = 64
ROUNDS = 4


def qp_attr() -> QPInitAttr:
    return QPInitAttr(cap=QPCap(max_send_wr=4, max_recv_wr=4))


def own_channel(port: int) -> str:
    """An event channel made in this process, and an address resolved on it."""
    channel = CMEventChannel()
    cmid = CMID(creator=channel)
    cmid.resolve_addr(AddrInfo(dst=ADDR, dst_service=str(port), port_space=ce.RDMA_PS_TCP), 2000)
    event = CMEvent(channel)
    kind = event.event_type
    event.ack_cm_event()
    cmid.close()
    channel.close()
    return "addr resolved" if kind == ce.RDMA_CM_EVENT_ADDR_RESOLVED else f"event {kind}"


def shim_line(who: str) -> str:
    """What this process's own control socket (IBCKPT_CTL, "%p" the pid) answers to status."""
    template = os.environ.get("IBCKPT_CTL")
    if not template:
        return f"shim: {who} socket unset"
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(template.replace("%p", str(os.getpid())))
            s.sendall(b"status\n")
            reply = s.makefile().readline()
    except OSError as e:
        return f"shim: {who} socket {e.strerror}"
    status = json.loads(reply[3:])
    parents = sum("of the parent process" in entry for entry in status["unsupported"])
    return (
        f"shim: {who} status {reply[:2]} channels {status['rdma_cm']['channels']} qps {len(status['qps'])}"
        f" parent's {parents}"
    )


def text(mr: Any) -> str:
    return bytes(mr.read(SIZE, 0)).rstrip(b"\0").decode()


def put(mr: Any, msg: str) -> None:
    mr.write(msg.encode().ljust(SIZE, b"\0"), SIZE)


def server(port: int, ready: Any, out: Any) -> None:
    lines = [f"server: {own_channel(port)}"]
    listen = CMID(
        creator=AddrInfo(src=ADDR, src_service=str(port), port_space=ce.RDMA_PS_TCP, flags=ce.RAI_PASSIVE),
        qp_init_attr=qp_attr(),
    )
    listen.listen()
    ready.set()
    conn = listen.get_request()
    inbox, outbox = conn.reg_msgs(SIZE), conn.reg_msgs(SIZE)
    conn.post_recv(inbox, SIZE)
    conn.accept()
    for _ in range(ROUNDS):
        conn.get_recv_comp()
        got = text(inbox)
        conn.post_recv(inbox, SIZE)
        put(outbox, "echo " + got)
        conn.post_send(outbox, length=SIZE)
        conn.get_send_comp()
        lines.append(f"server: got {got}")
    conn.get_recv_comp()  # the client's last word: it is done reading
    lines.append(f"server: got {text(inbox)}")
    lines.append(shim_line("server"))
    conn.close()
    listen.close()
    out.put(lines)


def client(port: int, who: str) -> list[str]:
    lines = [f"{who}: {own_channel(port)}"]
    conn = CMID(
        creator=AddrInfo(dst=ADDR, dst_service=str(port), port_space=ce.RDMA_PS_TCP),
        qp_init_attr=qp_attr(),
    )
    inbox, outbox = conn.reg_msgs(SIZE), conn.reg_msgs(SIZE)
    conn.post_recv(inbox, SIZE)
    conn.connect()
    for i in range(ROUNDS):
        put(outbox, f"{who} message {i}")
        conn.post_send(outbox, length=SIZE)
        conn.get_send_comp()
        conn.get_recv_comp()
        lines.append(f"{who}: got {text(inbox)}")
        conn.post_recv(inbox, SIZE)
    lines.append(shim_line(who))
    put(outbox, "bye")
    conn.post_send(outbox, length=SIZE)
    conn.get_send_comp()
    conn.close()
    return lines


def client_worker(port: int, ready: Any, out: Any) -> None:
    ready.wait(60)
    out.put(client(port, "client"))


def pair(ctx: multiprocessing.context.BaseContext, port: int, parent_client: bool) -> list[str]:
    ready, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=server, args=(port, ready, out))]
    if not parent_client:
        workers.append(ctx.Process(target=client_worker, args=(port, ready, out)))
    for w in workers:
        w.start()
    lines: list[str] = []
    if parent_client:
        ready.wait(60)
        lines += client(port, "parent")
    for _ in workers:
        lines += out.get(timeout=120)
    for w in workers:
        w.join(60)
        lines.append(f"worker exit {w.exitcode}")
    return sorted(lines)


def main(mode: str, port: int) -> None:
    held: list[Any] = []
    if mode == "fork_init":
        from pyverbs.fork import fork_init

        fork_init()
    if mode in ("opened", "fork_init"):
        ctx = Context(name="rxe0")
        channel = CMEventChannel()
        held += [ctx, channel, CMID(creator=channel)]
    mp = multiprocessing.get_context("fork")
    for line in pair(mp, port, parent_client=False):
        print(line, flush=True)
    for line in pair(mp, port + 1, parent_client=True):
        print(line, flush=True)
    print(f"parent: held {len(held)} objects", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
