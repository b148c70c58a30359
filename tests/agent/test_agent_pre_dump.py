"""A CheckpointJob's preDump reaches the node: a whole checkpoint session over the agent API on the host (as
test_agent_preupload.py), whose stand-in criu logs each call. The request's pre_dump makes the agent
pre-dump the rank's tree with its CRIU plugin dir, pass the PreDumped barrier, then dump on the pre-dump,
which the images keep as `parent/`. A rank whose release did not mark its device's pages (a shim build
older than the mark) is dumped in full; and an agent with no plugin dir passes the barrier and dumps in
full."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from agent.agent_harness import Running, stand_in_criu
from agent.test_agent_session import Shim, checkpoint_request, registered_shim, wait_finished

from ibckpt.agentapi import Mode
from ibckpt.vocabulary import Milestone
from testbed.coordinator import ThreadedCoordinator

PLUGINS = "/usr/local/lib/ibckpt/criu"


class MarkingShim(Shim):
    """Its release says it marked its MR pages, as a shim with native/src/redirty.c does."""

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        ok, reply = super().answer(verb)
        if verb == "release" and ok:
            reply = {**reply, "redirtied_pages": 8, "redirty_missed_bytes": 0}
        return ok, reply


@pytest.fixture
def criu_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A criu that writes a pages file into -D and logs its action, CRIU_LIBS_DIR and parent, one JSON
    line per call, in the returned file."""
    calls = tmp_path / "criu-calls"
    stand_in_criu(
        tmp_path,
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "if args[:1] not in (['pre-dump'], ['dump']):\n"
        "    sys.exit(0)\n"
        "images = args[args.index('-D') + 1]\n"
        "parent = args[args.index('--prev-images-dir') + 1] if '--prev-images-dir' in args else None\n"
        "name = 'pages-1.img' if args[0] == 'pre-dump' else 'pages-2.img'\n"
        "open(os.path.join(images, name), 'wb').write(args[0].encode())\n"
        "seen = parent is not None and os.path.isfile(os.path.join(images, parent, 'pages-1.img'))\n"
        "call = {'action': args[0], 'plugins': os.environ.get('CRIU_LIBS_DIR'), 'parent': parent,\n"
        "        'parent_has_pages': seen, 'images': images}\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(call) + '\\n')\n",
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return calls


@pytest.mark.parametrize(
    ("marks", "plugins"),
    [(True, PLUGINS), (False, PLUGINS), (True, "")],
    ids=["on-a-pre-dump", "unmarked-in-full", "no-plugin-in-full"],
)
def test_a_pre_dump_request_pre_dumps_the_tree_then_dumps_on_it(
    marks: bool,
    plugins: str,
    criu_calls: Path,
    agent: Running,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    tmp_path: Path,
) -> None:
    sessions = agent.server.sessions
    sessions.agent = dataclasses.replace(sessions.agent, criu_plugins=plugins)
    shim = registered_shim(tmp_path / "state", sleeper.pid)
    if marks:
        shim.__class__ = MarkingShim
    session, tokens = coordinator.create_session({"node-x"})
    request = checkpoint_request(coordinator, session, tokens["node-x"], Mode.STOP)
    client = agent.client()
    client.checkpoint(request.model_copy(update={"pre_dump": True}))
    report = wait_finished(client, session, timeout_s=60)
    assert (report.state, report.phase) == ("Succeeded", "Stopped"), report
    # the barrier was passed either way: the operator's PreDumping ends only there
    assert Milestone.PRE_DUMPED in report.phases, report.phases

    logged = [json.loads(line) for line in criu_calls.read_text().splitlines()]
    actions = [c["action"] for c in logged]
    if not plugins:
        assert actions == ["dump"] and logged[0]["parent"] is None
        return
    assert actions == ["pre-dump", "dump"]
    pre, final = logged
    assert pre["plugins"] == PLUGINS and final["plugins"] is None  # the plugin is for the pre-dump only
    if not marks:
        assert final["parent"] is None  # what the NIC wrote would be missing from a dump on the parent
        return
    assert final["parent"] is not None and final["parent_has_pages"], final
    # the pre-dump moved into the dump's image dir, so the images travel (and restore) as one tree
    kept = Path(final["images"]) / "parent" / "pages-1.img"
    assert kept.read_bytes() == b"pre-dump" and not Path(pre["images"]).exists()
