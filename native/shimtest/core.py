"""cffi (ABI mode) binding of libibckpt's pure core: id tables, the private completion
queue, the exactly-once re-post planner and the rdma_cm id states. Loads build/libibckpt_core.so, which has no
libibverbs dependency, so it works on hosts without RDMA."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cffi

from . import CORE, NATIVE_DIR

# struct ibv_wc as libibverbs lays it out (imm_data shares a union with invalidated_rkey).
IBV_WC_CDEF = """
struct ibv_wc {
    uint64_t wr_id; int status; int opcode; uint32_t vendor_err; uint32_t byte_len;
    uint32_t imm_data; uint32_t qp_num; uint32_t src_qp; unsigned int wc_flags;
    uint16_t pkey_index; uint16_t slid; uint8_t sl; uint8_t dlid_path_bits;
};
"""
CFFI_REGION = re.compile(r"/\* cffi-begin[^*]*\*/\n(.*?)/\* cffi-end \*/", re.S)


def header_cdef(header: Path) -> str:
    """The declarations a header marks for cffi: every cffi-begin .. cffi-end region, in order."""
    return "".join(CFFI_REGION.findall(header.read_text()))


CDEF = IBV_WC_CDEF + "".join(header_cdef(NATIVE_DIR / "src" / h) for h in ("core.h", "cmstate.h"))

# Flags and verdicts, as in src/core.h.
SIGNALED = 1 << 0
CONSUMER = 1 << 1
FLAG_WR = 1 << 2
ATOMIC = 1 << 3
RDMA = 1 << 4
DELIVERED, REPOST, UNKNOWN = 1, 2, 3

ffi = cffi.FFI()
ffi.cdef(CDEF)


def load(path: Path = CORE) -> Any:
    return ffi.dlopen(str(path))


class IdMap:
    """A virtual->real id table."""

    def __init__(self, lib: Any, cap: int = 16) -> None:
        self.lib = lib
        self.m = ffi.new("struct ibk_idmap *")
        if lib.ibk_idmap_init(self.m, cap):
            raise MemoryError
        self.closed = False

    def put(self, vid: int, rid: int) -> None:
        if self.lib.ibk_idmap_put(self.m, vid, rid):
            raise MemoryError

    def get(self, vid: int) -> int | None:
        out = ffi.new("uint32_t *")
        return None if self.lib.ibk_idmap_get(self.m, vid, out) else int(out[0])

    def delete(self, vid: int) -> bool:
        return int(self.lib.ibk_idmap_del(self.m, vid)) == 0

    def choose(self, real: int, floor: int, mask: int) -> int:
        return int(self.lib.ibk_idmap_choose(self.m, real, floor, mask))

    def choose_qpn(self, real: int, reserved: IdMap) -> int:
        """ibk_qpn_choose: as choose, from 0x800000, never a QPN live in `reserved`."""
        return int(self.lib.ibk_qpn_choose(self.m, reserved.m, real))

    def qpn_taken(self, qpn: int, reserved: IdMap) -> bool:
        return bool(self.lib.ibk_qpn_taken(self.m, reserved.m, qpn))

    def was_used(self, vid: int) -> bool:
        return bool(self.lib.ibk_idmap_was_used(self.m, vid))

    @property
    def live(self) -> int:
        return int(self.m.live)

    def close(self) -> None:
        if not self.closed:
            self.lib.ibk_idmap_fini(self.m)
            self.closed = True


def plan_resend(
    lib: Any, flags: Sequence[int], peer_recvs: int, done_consumers: int
) -> tuple[int, list[int]]:
    """(UNKNOWN count or -1, verdict per entry) for a send log, oldest first."""
    n = len(flags)
    cflags = ffi.new("uint32_t[]", list(flags) or [0])
    verdict = ffi.new("uint8_t[]", max(n, 1))
    rc = int(lib.ibk_plan_resend(cflags, n, peer_recvs, done_consumers, verdict))
    return rc, [int(verdict[i]) for i in range(n)]


class CmIds:
    """The rdma_cm ids of one event channel, as the shim follows them (src/cmstate.c)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.ids = ffi.new("struct ibk_cm_ids *")

    def cmd(self, cmd: int, body: bytes, new_handle: int = 0) -> None:
        buf = ffi.from_buffer(body)
        if self.lib.ibk_cm_on_cmd(self.ids, cmd, buf, len(body), new_handle):
            raise MemoryError

    def event(self, resp: bytes) -> None:
        if self.lib.ibk_cm_on_event(self.ids, ffi.from_buffer(resp), len(resp)):
            raise MemoryError

    def forget(self, handle: int) -> int:
        return int(self.lib.ibk_cm_forget(self.ids, handle))

    def take(self, other: CmIds, handle: int) -> bool:
        """MIGRATE_ID as rdmacm.c does it: the id leaves other and goes on here as it was."""
        p = self.lib.ibk_cm_find(other.ids, handle)
        if p == ffi.NULL:
            return False
        moved = ffi.new("struct ibk_cm_id *", p[0])
        other.forget(handle)
        if self.lib.ibk_cm_adopt(self.ids, moved):
            raise MemoryError
        return True

    def get(self, handle: int) -> tuple[str, int, int, bool] | None:
        """(state, uid, events reported, a DISCONNECTED went out) of a handle."""
        p = self.lib.ibk_cm_find(self.ids, handle)
        if p == ffi.NULL:
            return None
        state = ffi.string(self.lib.ibk_cm_state_name(p.state)).decode()
        return state, int(p.uid), int(p.reported), bool(p.disc_out)

    def carried(self, handle: int) -> bool:
        p = self.lib.ibk_cm_find(self.ids, handle)
        return bool(self.lib.ibk_cm_carried(p.state))

    def close(self) -> None:
        self.lib.ibk_cm_ids_fini(self.ids)
