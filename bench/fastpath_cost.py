"""Summarise bench/native_perf.sh: instructions the shim adds per fast-path call, and perftest ratios.

  fastpath_cost.py callgrind DIR   reads DIR/cg-<mode>-<plain|shim>-<n>.out and .txt
  fastpath_cost.py perftest FILE   reads the TSV of perftest results written by native_perf.sh

Each fast-path mode ran at two loop sizes N and 2N; differencing the two removes start-up
and teardown, so (cost at 2N - cost at N) / N is the cost of one iteration.  Three numbers per mode:

  shim self   instructions executed inside libibckpt*.so (self cost of its functions)
  shim+libc   that plus libc helpers the shim calls (mutex lock/unlock, memcpy, ...), but not the
              libc write() that rings the doorbell, which the program without the shim makes too
  total delta all user-space instructions with the shim minus without it

Polling until a completion arrives makes a varying number of empty polls; in write/send the
empty polls are taken out at the per-call cost measured in mode poll, so what is left is
"post + completion retired at poll".  Standard library only (runs inside the guest).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SHIM_OBJ = re.compile(r"libibckpt[^/]*\.so")
LIBC_OBJ = re.compile(r"/libc\.so")
# libc functions the program without the shim calls just the same (the doorbell).
PASS_THROUGH = {"write", "__write", "__libc_write", "__GI___libc_write"}
NAME_RE = re.compile(r"^\((\d+)\)(?: (.*))?$")


@dataclass
class Profile:
    """What one callgrind out file says, reduced to what this bench needs."""

    total: int = 0
    self_by_obj: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    shim_fn_self: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    shim_to_libc: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def shim_self(self) -> int:
        return sum(v for k, v in self.self_by_obj.items() if SHIM_OBJ.search(k))

    @property
    def shim_libc(self) -> int:
        return sum(v for k, v in self.shim_to_libc.items() if k not in PASS_THROUGH)


def _name(table: dict[str, str], spec: str) -> tuple[str, str]:
    """Resolve callgrind's name compression: "(id) name" defines, "(id)" refers.  Returns (key, name):
    the key is the id when there is one, since one name can be two functions (the shim's write() and
    libc's)."""
    m = NAME_RE.match(spec)
    if not m:
        return spec, spec
    ident, name = m.groups()
    if name is not None:
        table[ident] = name
        return ident, name
    return ident, table.get(ident, f"({ident})")


def parse(path: Path) -> Profile:
    prof = Profile()
    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}, "fl": {}}
    ob = fn = ""
    fn_ob: dict[str, str] = {}  # function id -> object it lives in (from its fn= blocks)
    calls: list[tuple[str, str, int]] = []  # (caller object, callee id, inclusive Ir)
    cfn = ""
    in_call = False
    events_ir = 0  # index of Ir among the events
    npos = 1
    with path.open() as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                costs = parts[npos:]
                ir = int(costs[events_ir]) if len(costs) > events_ir else 0
                if in_call:
                    if SHIM_OBJ.search(ob):
                        calls.append((ob, cfn, ir))
                    in_call = False
                else:
                    prof.self_by_obj[ob] += ir
                    prof.total += ir
                    if SHIM_OBJ.search(ob):
                        prof.shim_fn_self[fn] += ir
                continue
            key, _, val = line.partition("=")
            if key == "ob":
                ob = _name(names["ob"], val)[1]
            elif key == "fn":
                ident, fn = _name(names["fn"], val)
                fn_ob[ident] = ob
            elif key == "cob":
                _name(names["ob"], val)
            elif key == "cfn":
                cfn = _name(names["fn"], val)[0]
            elif key in ("fl", "fi", "fe", "cfi", "cfl"):
                _name(names["fl"], val)
            elif key == "calls":
                in_call = True
            elif line.startswith("events:"):
                events_ir = line.split()[1:].index("Ir")
            elif line.startswith("positions:"):
                npos = len(line.split()) - 1
    for _caller, ident, ir in calls:
        if LIBC_OBJ.search(fn_ob.get(ident, "")):
            prof.shim_to_libc[names["fn"].get(ident, ident)] += ir
    return prof


def run_info(path: Path) -> dict[str, str]:
    """The key=value line that bench/fastpath printed."""
    for line in path.read_text().splitlines():
        if line.startswith("mode="):
            return dict(kv.split("=", 1) for kv in line.split())
    raise SystemExit(f"{path}: no result line (the run failed?)")


@dataclass
class PerIter:
    shim_self: float
    shim_libc: float
    total: float
    empty: float  # extra empty polls per iteration
    polls: float


def per_iter(d: Path, mode: str, cfg: str) -> PerIter:
    runs = []
    for f in sorted(d.glob(f"cg-{mode}-{cfg}-*.out")):
        info = run_info(f.with_suffix(".txt"))
        runs.append((int(info["n"]), parse(f), info))
    if len(runs) != 2:
        raise SystemExit(f"{d}: want two sizes of {mode}/{cfg}, found {len(runs)}")
    runs.sort(key=lambda r: r[0])
    (n1, p1, i1), (n2, p2, i2) = runs
    dn = n2 - n1
    return PerIter(
        shim_self=(p2.shim_self - p1.shim_self) / dn,
        shim_libc=(p2.shim_self + p2.shim_libc - p1.shim_self - p1.shim_libc) / dn,
        total=(p2.total - p1.total) / dn,
        empty=(int(i2["empty"]) - int(i1["empty"])) / dn,
        polls=(int(i2["polls"]) - int(i1["polls"])) / dn,
    )


def top_shim_functions(d: Path, mode: str, k: int = 8) -> str:
    runs = sorted(d.glob(f"cg-{mode}-shim-*.out"), key=lambda f: int(run_info(f.with_suffix(".txt"))["n"]))
    if len(runs) != 2:
        return ""
    n1 = int(run_info(runs[0].with_suffix(".txt"))["n"])
    n2 = int(run_info(runs[1].with_suffix(".txt"))["n"])
    a, b = parse(runs[0]), parse(runs[1])
    per = {fn: (b.shim_fn_self.get(fn, 0) - a.shim_fn_self.get(fn, 0)) / (n2 - n1) for fn in b.shim_fn_self}
    per.update(
        {
            f"{fn} [libc]": (b.shim_to_libc.get(fn, 0) - a.shim_to_libc.get(fn, 0)) / (n2 - n1)
            for fn in b.shim_to_libc
        }
    )
    best = sorted(((v, fn) for fn, v in per.items() if v >= 0.5), reverse=True)[:k]
    return ", ".join(f"{fn} {v:.0f}" for v, fn in best)


WHAT = {
    "poll": "ibv_poll_cq, empty CQ",
    "recv": "ibv_post_recv (QP in INIT)",
    "write": "RDMA WRITE inline: post_send + its completion",
    "send": "SEND inline: post_recv + post_send + 2 completions",
}


def callgrind(d: Path) -> None:
    modes = [m for m in WHAT if list(d.glob(f"cg-{m}-shim-*.out"))]
    if "poll" not in modes:
        raise SystemExit(f"{d}: no poll runs: empty-poll cost unknown")
    plain = {m: per_iter(d, m, "plain") for m in modes}
    shim = {m: per_iter(d, m, "shim") for m in modes}
    # Per empty poll, in each configuration.
    e_self, e_libc = shim["poll"].shim_self, shim["poll"].shim_libc
    e_tot_plain, e_tot_shim = plain["poll"].total, shim["poll"].total
    print("Instructions (Ir) per iteration, N->2N differencing; empty polls taken out in write/send")
    head = ("mode", "what", "plain", "shim self", "shim+libc", "total delta", "empty polls")
    print("{:<6} {:<52} {:>7} {:>9} {:>9} {:>11} {:>11}".format(*head))
    for m in modes:
        p, s = plain[m], shim[m]
        ss, sl, base = s.shim_self, s.shim_libc, p.total
        tot = s.total - p.total
        if m != "poll":
            ss -= e_self * s.empty
            sl -= e_libc * s.empty
            base = p.total - e_tot_plain * p.empty
            tot = (s.total - e_tot_shim * s.empty) - base
        empties = f"{p.empty:.1f}/{s.empty:.1f}" if m != "poll" else "-"
        print(f"{m:<6} {WHAT[m]:<52} {base:7.0f} {ss:9.1f} {sl:9.1f} {tot:11.1f} {empties:>11}")
    print("plain: Ir per iteration without the shim; empty polls per iteration: without/with the shim")
    print(f"plain Ir per empty poll: {e_tot_plain:.1f}; with the shim: {e_tot_shim:.1f}")
    for m in modes:
        top = top_shim_functions(d, m)
        if top:
            print(f"  {m}: where the shim's instructions go: {top}")


def perftest(path: Path) -> None:
    """TSV lines: test metric cfg round value.  perftest sometimes prints inf (its clock calibration
    failed under TCG): such values are dropped, and so is the round's ratio."""
    vals: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 5:
            continue
        test, metric, cfg, rnd, value = parts
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        if math.isfinite(v) and v > 0:
            vals[(test, metric, cfg)][rnd] = v
    keys = sorted({(t, m) for t, m, _ in vals})
    head = ("test", "metric", "plain", "shim", "ratio", "rnd ratio", "IQR", "rounds plain/shim")
    print("{:<14} {:<12} {:>10} {:>10} {:>6} {:>9} {:>11}  {}".format(*head))
    for t, m in keys:
        p, s = vals.get((t, m, "plain"), {}), vals.get((t, m, "shim"), {})
        if not p or not s:
            continue
        mp, ms = statistics.median(p.values()), statistics.median(s.values())
        both = sorted(set(p) & set(s), key=int)
        ratios = sorted(s[r] / p[r] for r in both)
        rr = statistics.median(ratios) if ratios else math.nan
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [math.nan] * 3
        iqr = f"{q[0]:.2f}-{q[2]:.2f}"
        rounds = " ".join(
            f"{p.get(r, math.nan):.4g}/{s.get(r, math.nan):.4g}" for r in sorted(set(p) | set(s))
        )
        print(f"{t:<14} {m:<12} {mp:10.4g} {ms:10.4g} {ms / mp:6.3f} {rr:9.3f} {iqr:>11}  {rounds}")
    print("plain, shim: medians over rounds; ratio = shim/plain of the medians; rnd ratio = median of the")
    print("per-round ratios (each round runs both back to back), IQR their interquartile range.")
    print("Mpps: higher is better; us, ns: lower.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("callgrind").add_argument("dir", type=Path)
    sub.add_parser("perftest").add_argument("file", type=Path)
    args = ap.parse_args()
    if args.cmd == "callgrind":
        callgrind(args.dir)
    else:
        perftest(args.file)


if __name__ == "__main__":
    main()
