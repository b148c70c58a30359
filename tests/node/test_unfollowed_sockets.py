"""The agent reaches a rank's control socket without following a link the container planted (N23)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from ibckpt_native.control import AsyncShimControl, ShimControl
from ibckpt_node import control_sockets


async def test_a_symlink_in_place_of_a_control_socket_is_never_followed(tmp_path: Path) -> None:
    node_socket = tmp_path / "node.sock"  # some socket of the node the container must not reach
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as target:
        target.bind(str(node_socket))
        target.listen()
        target.setblocking(False)
        ctl = tmp_path / "ctl"
        ctl.mkdir()
        planted = ctl / "1.sock"
        os.symlink(node_socket, planted)
        with pytest.raises(OSError) as refused:
            await AsyncShimControl(str(planted), 1 << 20).command("quiesce 1000", 2)
        assert refused.value.errno == errno.ENOTSOCK
        with pytest.raises(OSError):
            ShimControl(str(planted), timeout=2).status()
        assert not control_sockets.listening(str(planted))  # taken for stale, not for a rank
        with pytest.raises(BlockingIOError):
            target.accept()  # nothing ever connected to it
        # the real socket in the container's directory is reached as before
        os.unlink(planted)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rank:
            rank.bind(str(planted))
            rank.listen()
            assert control_sockets.listening(str(planted))
