"""The testbed's RDMA device plugin: the vendor's part a real cluster gets from the RDMA shared device
plugin, spoken towards the real kubelet over its device-plugin gRPC API (v1beta1).

It advertises one resource, `rdma/hca`, in SLOTS units that share the node's RDMA devices (as the shared
device plugin's `rdmaHcaMax` does): each unit a container is allocated gives it every uverbs device node
of the node's HCAs and /dev/infiniband/rdma_cm, and nothing else. The container needs no privilege and no
hostPath; its device cgroup allows those nodes only.

Standalone on purpose: it runs in the testbed's apps image (python3 and python3-grpcio from Debian), from
a ConfigMap, so it imports only the standard library and grpc. The protobuf messages it needs are few
and small, so they are encoded here by hand (the field numbers are the API's, pluginapi v1beta1).

    python3 rdma_device_plugin.py [--slots N] [--resource rdma/hca] [--reverse-on NODE ...]

--reverse-on: on that node (NODE_NAME in the environment) a container is given its uverbs nodes in
the other order, the last HCA first, as a plugin that enumerates its node's devices otherwise does: a
restore between such nodes must find each device by its name, not by its place (ibckpt/devicemap.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

API_VERSION = "v1beta1"
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = PLUGIN_DIR / "kubelet.sock"
DEV_DIR = Path("/dev/infiniband")
SYS_VERBS = Path("/sys/class/infiniband_verbs")

# -- protobuf, the few shapes this API needs (varints and length-delimited fields) ------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string(number: int, text: str) -> bytes:
    return _field(number, text.encode()) if text else b""


def _bool(number: int, value: bool) -> bytes:
    return _varint(number << 3) + _varint(1) if value else b""


def _map(number: int, entries: dict[str, str]) -> bytes:
    return b"".join(_field(number, _string(1, k) + _string(2, v)) for k, v in sorted(entries.items()))


def decode(data: bytes) -> list[tuple[int, int | bytes]]:
    """A message's fields in order, as (number, value): ints for varints, bytes for the rest."""
    fields: list[tuple[int, int | bytes]] = []
    pos = 0

    def varint() -> int:
        nonlocal pos
        shift = value = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.append((number, varint()))
        elif wire == 2:
            size = varint()
            fields.append((number, data[pos : pos + size]))
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            fields.append((number, data[pos : pos + size]))
            pos += size
        else:
            raise ValueError(f"protobuf wire type {wire} not expected here")
    return fields


def register_request(endpoint: str, resource: str) -> bytes:
    """RegisterRequest{version=1, endpoint=2, resource_name=3, options=4}."""
    return _string(1, API_VERSION) + _string(2, endpoint) + _string(3, resource) + _field(4, b"")


def plugin_options() -> bytes:
    """DevicePluginOptions{pre_start_required=1, get_preferred_allocation_available=2}: neither."""
    return b""


def list_and_watch_response(ids: list[str], healthy: bool = True) -> bytes:
    """ListAndWatchResponse{devices=1: Device{ID=1, health=2}}."""
    health = "Healthy" if healthy else "Unhealthy"
    return b"".join(_field(1, _string(1, i) + _string(2, health)) for i in ids)


def allocate_request_ids(data: bytes) -> list[list[str]]:
    """AllocateRequest{container_requests=1: ContainerAllocateRequest{devicesIDs=1}}: ids per container."""
    out: list[list[str]] = []
    for number, value in decode(data):
        if number == 1 and isinstance(value, bytes):
            out.append([v.decode() for n, v in decode(value) if n == 1 and isinstance(v, bytes)])
    return out


def allocate_response(containers: list[list[str]]) -> bytes:
    """AllocateResponse{container_responses=1: ContainerAllocateResponse{envs=1, mounts=2, devices=3:
    DeviceSpec{container_path=1, host_path=2, permissions=3}, annotations=4}}, each container given
    the device paths in its list (read-write, as the verbs provider opens them)."""
    responses = b""
    for paths in containers:
        devices = b"".join(_field(3, _string(1, p) + _string(2, p) + _string(3, "rw")) for p in paths)
        responses += _field(1, devices)
    return responses


# -- the node's devices -----------------------------------------------------------------------------


def rdma_device_paths(reverse: bool = False) -> list[str]:
    """Every uverbs node of this node's HCAs, in index order (or the other way), then rdma_cm if the
    node has it."""
    names = sorted((p.name for p in SYS_VERBS.glob("uverbs*")), key=lambda n: int(n[len("uverbs") :]))
    if reverse:
        names.reverse()
    paths = [str(DEV_DIR / n) for n in names if (DEV_DIR / n).exists()]
    if (DEV_DIR / "rdma_cm").exists():
        paths.append(str(DEV_DIR / "rdma_cm"))
    return paths


# -- the gRPC side ----------------------------------------------------------------------------------


class Plugin:
    def __init__(self, resource: str, slots: int, reverse: bool = False) -> None:
        self.resource = resource
        self.reverse = reverse
        self.ids = [f"hca-{i}" for i in range(slots)]
        self.endpoint = "ibckpt-testbed-rdma.sock"
        self.stopped = threading.Event()

    def list_and_watch(self, _request: bytes, context: object) -> Iterator[bytes]:
        healthy = bool(rdma_device_paths())
        yield list_and_watch_response(self.ids, healthy)
        while not self.stopped.wait(5):  # the kubelet holds this stream open; health seldom changes
            now = bool(rdma_device_paths())
            if now != healthy:
                healthy = now
                yield list_and_watch_response(self.ids, healthy)

    def allocate(self, request: bytes, _context: object) -> bytes:
        containers = allocate_request_ids(request)
        paths = rdma_device_paths(self.reverse)
        print(f"allocate {containers}: {paths}", flush=True)
        return allocate_response([paths for _ in containers])

    def serve(self) -> None:
        from concurrent import futures

        import grpc  # type: ignore[import-untyped, import-not-found, unused-ignore]  # apps image only

        def ident(data: bytes) -> bytes:
            return data

        socket_path = PLUGIN_DIR / self.endpoint
        socket_path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        handlers = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                lambda _r, _c: plugin_options(), request_deserializer=ident, response_serializer=ident
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self.list_and_watch, request_deserializer=ident, response_serializer=ident
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self.allocate, request_deserializer=ident, response_serializer=ident
            ),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                lambda _r, _c: b"", request_deserializer=ident, response_serializer=ident
            ),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                lambda _r, _c: b"", request_deserializer=ident, response_serializer=ident
            ),
        }
        service = grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers)
        server.add_generic_rpc_handlers((service,))
        server.add_insecure_port(f"unix://{socket_path}")
        server.start()
        with grpc.insecure_channel(f"unix://{KUBELET_SOCKET}") as channel:
            register = channel.unary_unary(
                "/v1beta1.Registration/Register", request_serializer=ident, response_deserializer=ident
            )
            register(register_request(self.endpoint, self.resource), timeout=30)
        devices = rdma_device_paths()
        print(f"registered {self.resource} x{len(self.ids)} at {socket_path}: {devices}", flush=True)
        # A kubelet that restarts removes every socket here and asks plugins to register again.
        while socket_path.exists():
            time.sleep(2)
        print("plugin socket removed (kubelet restarted): registering again", flush=True)
        self.stopped.set()
        server.stop(grace=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--resource", default="rdma/hca")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--reverse-on", action="append", default=[], metavar="NODE")
    args = parser.parse_args(argv)
    reverse = os.environ.get("NODE_NAME", "") in args.reverse_on
    while True:
        while not KUBELET_SOCKET.exists():
            time.sleep(1)
        try:
            Plugin(args.resource, args.slots, reverse).serve()
        except Exception as error:  # a kubelet mid-restart refuses Register: try again shortly
            print(f"device plugin: {error}", file=sys.stderr, flush=True)
            time.sleep(2)


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
