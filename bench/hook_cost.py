"""What ibckpt-hook and ibckpt-runc cost a container that is NOT an RDMA container.

Run: .venv/bin/python bench/hook_cost.py [--runs 20] [--host-only]

Host part (no runtime needed): the hook process alone, given a non-RDMA container's state on
stdin and its config.json, as the runtime calls it, against /bin/true given the same stdin (the
cost of any hook at all): as installed on a node, the compiled front (native/front) and Python's
`python3 -IS` launcher, and as a virtualenv console script would start it.

Guest part (a Soft-RoCE guest with the real runc; TCG makes every number ~20x the host's, so read
the ratios): `runc run` of a trivial container (/bin/true):
  runc        plain runc, no hook: the baseline;
  wrapper     ibckpt-runc as the handler: create is edited only for RDMA containers, so this is
              the wrapper's start-up plus one exec;
  hooks.d     plain runc with ibckpt-hook at createRuntime and poststop in config.json, which is
              what podman or CRI-O do for every container with hooks.d's `always`;
the last two each with the compiled front and with Python's launchers alone (no front).
Prints the median per container start and each ratio to the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FRONT = REPO / "native" / "build" / "ibckpt-front"  # make native
PYTHON_PREFIX = "/opt/ibckpt-python"  # the guest's second install: Python's launchers, no front
sys.path.insert(0, str(REPO / "tests"))

PLAIN_SPEC = {
    "ociVersion": "1.0.2",
    "process": {"args": ["/bin/true"], "env": ["PATH=/usr/bin"], "cwd": "/"},
    "root": {"path": "rootfs"},
    "annotations": {"io.kubernetes.cri.container-type": "container"},
    "linux": {"devices": [{"path": "/dev/null", "type": "c", "major": 1, "minor": 3}]},
}


def timed(cmd: list[str], runs: int, stdin: bytes = b"", env: dict[str, str] | None = None) -> float:
    """Median wall seconds of one run of cmd."""
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, input=stdin, stdout=subprocess.DEVNULL, check=True, env=env)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def host_part(runs: int) -> None:
    from ibckpt_node.hook import install

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        install.install(root, "/usr/local", "/usr/bin/python3", None, {"runc": "/bin/true"})
        # the launchers name their library by the node's path; point them at this copy instead
        for name in ("ibckpt-hook", "ibckpt-runc"):
            path = root / "usr/local/bin" / name
            path.write_text(path.read_text().replace("'/usr/local/lib", f"'{root}/usr/local/lib"))
        launcher = root / "usr/local/bin/ibckpt-hook"
        wrapper = root / "usr/local/bin/ibckpt-runc"
        bundle = root / "bundle"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(PLAIN_SPEC))
        state = json.dumps(
            {"id": "c1", "pid": os.getpid(), "status": "creating", "bundle": str(bundle)}
        ).encode()
        env = {"PATH": "/usr/bin:/bin", "IBCKPT_NODE_CONFIG": str(root / "node.json")}
        (root / "node.json").write_text(json.dumps({"state_dir": str(root / "state")}))
        venv = [sys.executable, "-m", "ibckpt_node.hook.main", "createRuntime"]
        base = timed(["/bin/true"], runs, state, env)
        interpreter = timed(["/usr/bin/python3", "-IS", "-c", "pass"], runs, state, env)
        installed = timed([str(launcher), "createRuntime"], runs, state, env)
        in_venv = timed(venv, runs, state, {**env, **{"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
        passthrough = timed([str(wrapper), "--root", "/run/runc", "state", "c1"], runs, b"", env)
        assert not (root / "state" / "containers").exists(), "a plain container must not be registered"
        fronted = root / "front"
        install.install(fronted, "/usr/local", "/usr/bin/python3", None, {"runc": "/bin/true"}, front=FRONT)
        front_hook = timed([str(fronted / "usr/local/bin/ibckpt-hook"), "createRuntime"], runs, state, env)
        front_runc = [str(fronted / "usr/local/bin/ibckpt-runc"), "--root", "/run/runc", "state", "c1"]
        front_pass = timed(front_runc, runs, b"", env)
    print(f"host, hook process for a non-RDMA container (median of {runs}):")
    print(f"  /bin/true (any hook at all)        {base * 1e3:7.1f} ms")
    print(f"  python3 -IS -c pass (the floor)    {interpreter * 1e3:7.1f} ms  ({interpreter / base:.1f}x)")
    print(f"  ibckpt-hook, installed (-IS)       {installed * 1e3:7.1f} ms  ({installed / base:.1f}x)")
    print(f"  ibckpt-hook, virtualenv python     {in_venv * 1e3:7.1f} ms  ({in_venv / base:.1f}x)")
    print(f"  ibckpt-runc state (exec of 'runc') {passthrough * 1e3:7.1f} ms  ({passthrough / base:.1f}x)")
    print(f"  ibckpt-hook, compiled front        {front_hook * 1e3:7.1f} ms  ({front_hook / base:.1f}x)")
    print(f"  ibckpt-runc state, compiled front  {front_pass * 1e3:7.1f} ms  ({front_pass / base:.1f}x)")


GUEST_SCRIPT = """
set -e
sh {repo}/tests/hook/guest-cgroups.sh
{python} -m ibckpt_node.hook.install --config '{{"runc": "/usr/sbin/runc"}}' --front {front} >/dev/null
{python} -m ibckpt_node.hook.install --prefix {python_prefix} >/dev/null
{python} {repo}/bench/hook_cost.py --inside --runs {runs}
"""


def guest_inside(runs: int) -> None:
    work = Path(tempfile.mkdtemp())
    rootfs = work / "rootfs"
    for d in ("proc", "dev", "sys", "tmp", "usr"):
        (rootfs / d).mkdir(parents=True)
    for link in ("bin", "lib", "lib64"):
        (rootfs / link).symlink_to(f"usr/{link}")
    subprocess.run(["runc", "spec", "--bundle", str(work)], check=True)
    spec = json.loads((work / "config.json").read_text())
    spec["process"].update(terminal=False, args=["/bin/true"])
    spec["root"] = {"path": str(rootfs), "readonly": True}
    spec["mounts"].append(
        {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}
    )
    plain = json.dumps(spec)
    hooked = {}
    for name, prefix in (("front", "/usr/local"), ("python", PYTHON_PREFIX)):
        spec["hooks"] = {
            stage: [{"path": f"{prefix}/bin/ibckpt-hook", "args": ["ibckpt-hook", stage]}]
            for stage in ("createRuntime", "poststop")
        }
        hooked[name] = json.dumps(spec)
    results = {}
    for name, runtime, config in (
        ("runc", "runc", plain),
        ("wrapper, front", "/usr/local/bin/ibckpt-runc", plain),
        ("wrapper, Python", f"{PYTHON_PREFIX}/bin/ibckpt-runc", plain),
        ("hooks.d, front", "runc", hooked["front"]),
        ("hooks.d, Python", "runc", hooked["python"]),
    ):
        samples = []
        for i in range(runs):
            (work / "config.json").write_text(config)
            t0 = time.perf_counter()
            subprocess.run(
                [
                    runtime,
                    "run",
                    "--bundle",
                    str(work),
                    f"{name.replace(', ', '-').replace('.', '').lower()}-{i}",
                ],
                check=True,
            )
            samples.append(time.perf_counter() - t0)
        results[name] = statistics.median(samples)
        assert json.loads((work / "config.json").read_text()) == json.loads(config), "plain: no edit"
    assert not Path("/run/ibckpt/containers").exists() or not os.listdir("/run/ibckpt/containers")
    results["python3 -IS -c pass"] = timed(["/usr/bin/python3", "-IS", "-c", "pass"], runs)
    base = results["runc"]
    print(f"guest (TCG), `runc run` of /bin/true, non-RDMA (median of {runs}):")
    for name, value in results.items():
        print(f"  {name:20} {value * 1e3:8.1f} ms  ({value / base:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--host-only", action="store_true")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        guest_inside(args.runs)
        return 0
    host_part(args.runs)
    if args.host_only:
        return 0
    from testbed import guest

    script = GUEST_SCRIPT.format(
        repo=REPO, python=sys.executable, runs=args.runs, front=FRONT, python_prefix=PYTHON_PREFIX
    )
    result = guest.run(guest.GuestSpec(command=script), timeout=1800)
    lines = result.output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("guest (TCG)")), None)
    if result.returncode != 0 or start is None:
        print("\n".join(lines[-40:]))
        return 1
    print("\n".join(lines[start : start + 7]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
