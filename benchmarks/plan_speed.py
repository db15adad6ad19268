"""Planning by speed against planning by memory, and against the best split there is.

Three plain ``ggml-rpc-server`` processes on 127.0.0.1, one thread each (one member, one core):
a (a worker) slowed by a CPU quota (``tests/helpers/cpu_quota.py``'s cgroup: ``--slow-cores`` of a
core, over a short period: see :func:`slow_down`),
b (a worker) and c (the serving node: last in ``--rpc``, it holds the output head). Before anyone
connects, the calibration (``mesh_sidecar/llama/calibration.py``) measures each device's speed, as
a node does at start. Each member is offered the same memory cap, chosen so that the model needs
all three: about 45 % of what the three devices need together (blocks, output head and K/V cache,
three compute margins; the input embeddings stay in llama-server), lowered in small steps while b
and c alone could hold the model. The memory plan then gives about a third each, the speed plan
fills the fast members first and leaves a the rest.

Each split is measured with llama.cpp's own transport: ``llama-server --rpc a,b,c -ngl 99
--tensor-split W`` (``Plan.tensor_split``, or for a split of layer counts the counts with one more
on the last device: the same weights), restarted per split; one warm-up, then ``--reps`` greedy
``/v1/completions`` requests (``cache_prompt: false``, ``ignore_eos``: every answer is
``--n-predict`` tokens long), decode tok/s from llama-server's ``timings.predicted_per_second``
(median). With ``--brute-force`` (default for models of at most BRUTE_FORCE_MAX_LAYERS layers)
every split into three contiguous runs within the caps is measured too (the survey: each distinct
split once, the plans' included), then the survey's best split is measured again beside the two
plans (the final round, which the table shows: the best of many noisy medians, taken from the
survey itself, would be flattered by its own pick).

Run as root (the cpu cgroup): ``.venv/bin/python -m benchmarks.plan_speed [--model PATH|tier-test|
bench-1gb] [--slow-cores 0.25] [--quota-period-ms MS] [--reps N] [--n-predict N] [--brute-force/--no-brute-force]
[--json PATH]``. Figures are printed and written as JSON (one entry per model and quota in the file);
nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report import make_table, wide_console
from benchmarks.setup import Started, run_benchmark
from benchmarks.turns import GREEDY, PROMPT
from tests.helpers.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "plan_speed.json"
DEFAULT_MODEL = "tier-test"
MEMBERS = ("a", "b", "c")  # --rpc order; a is slowed, c serves (the output head)
CTX_SIZE = 4096  # the node's default --ctx-size: the estimate and llama-server agree on it
CAP_SHARE = 0.45  # of what the three devices need together, lowered by CAP_SHARE_STEP while b and c hold it
CAP_SHARE_STEP = 0.005
BRUTE_FORCE_MAX_LAYERS = 12
LLAMA_SERVER_THREADS = 1  # every layer is on the rpc-servers: llama-server itself only feeds them
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
GOAL_OVER_MEMORY = 1.3
GOAL_OF_BEST = 0.9


@dataclass(frozen=True)
class Split:
    """Layer counts per member (in MEMBERS order) and the --tensor-split weights that give them."""

    counts: tuple[int, ...]
    weights: tuple[int, ...]  # one per member in ``endpoints``' order
    members: tuple[int, ...]  # indices into MEMBERS of the rpc-servers llama-server gets

    @property
    def label(self) -> str:
        return "/".join(map(str, self.counts))


def split_of_counts(counts: Sequence[int]) -> Split:
    """The weights Plan.tensor_split would give: the counts, one more on the last (the output head)."""
    members = tuple(i for i, n in enumerate(counts) if n > 0 or i == len(counts) - 1)
    weights = tuple(counts[i] + (1 if i == len(counts) - 1 else 0) for i in members)
    return Split(tuple(counts), weights, members)


def split_of_plan(plan, names: Sequence[str]) -> Split:
    """The plan's runs as counts per member, with the plan's own tensor_split()."""
    by_name = {node.name: node.n_layers for node in plan.nodes}
    index = {name: i for i, name in enumerate(names)}
    members = tuple(index[node.name] for node in plan.nodes)
    return Split(tuple(by_name.get(name, 0) for name in names), tuple(plan.tensor_split()), members)


def expected_token_s(counts: Sequence[int], speeds: Sequence[float], estimate) -> float:
    """The planner's model of a token's time: each run's weight bytes (and the head on the last) over
    its device's speed, the stages one after another (link_s 0 here: loopback)."""
    total = 0.0
    start = 0
    for i, (count, speed) in enumerate(zip(counts, speeds, strict=True)):
        last = i == len(counts) - 1
        weights = sum(estimate.layer_weight_bytes[start:start + count]) + (estimate.output_bytes if last else 0)
        if count or last:
            total += weights / speed
        start += count
    return total


def every_split(estimate, caps: Sequence[int]) -> list[tuple[int, ...]]:
    """Every split into contiguous runs, one per member in order, whose bytes fit each member's cap."""
    n = estimate.n_layers
    found = []
    for x in range(n + 1):
        for y in range(n + 1 - x):
            counts = (x, y, n - x - y)
            start, fits = 0, True
            for i, count in enumerate(counts):
                last = i == len(counts) - 1
                fits &= estimate.range_bytes(start, start + count, with_output=last) <= caps[i]
                start += count
            if fits:
                found.append(counts)
    return found


def choose_caps(estimate, names: Sequence[str]) -> tuple[int, float, int]:
    """(usable bytes per member, its share of the three devices' need, that need): the largest share, from
    CAP_SHARE down, at which the last two members alone cannot hold the model."""
    from mesh_sidecar.errors import PlanError
    from mesh_sidecar.serve.planner import NodeCapacity, plan_layers

    need = estimate.range_bytes(0, estimate.n_layers, with_output=True) + 2 * estimate.compute_margin_bytes
    share = CAP_SHARE
    while share > 0.34:
        cap = int(need * share)
        try:
            plan_layers([NodeCapacity(n.encode(), n, cap) for n in names[1:]], estimate)
        except PlanError:
            return cap, share, need
        share -= CAP_SHARE_STEP
    raise SystemExit("no equal cap makes this model need all three members")


def start_rpc_server(started: Started, binaries, name: str, port: int, workdir: Path) -> subprocess.Popen:
    """A plain rpc-server on 127.0.0.1 with one thread, returned once it listens (watched by its sockets:
    a probe connection would be its one client)."""
    import psutil

    log = workdir / f"rpc-{name}.log"
    proc = started.popen(f"rpc-server {name}", [str(binaries.rpc_server), "-H", "127.0.0.1", "-p", str(port),
                                                "-t", "1"], log)

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server {name} exited:\n{log.read_text()[-2000:]}")
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(proc.pid).net_connections(kind="tcp"))

    wait_until(listening, 30, f"rpc-server {name} listens on {port}")
    return proc


def slow_down(quota, cores: float, period_ms: float | None) -> float:
    """At most ``cores`` of a core per period: ``period_ms``, by default the shortest the kernel takes
    for that share (4 ms for 0.25), so the device is slow throughout (see CpuQuota.limit: with a
    100 ms period, a with a third of the layers decoded as fast as with one). Returns the period in ms."""
    period_us = round(period_ms * 1000) if period_ms else quota.shortest_period_us(cores)
    quota.limit(cores, period_us=period_us)
    return period_us / 1000


def calibrate(ports: Sequence[int]) -> list[Any]:
    """Each rpc-server's one device, measured one after the other (nobody else connected)."""
    from mesh_sidecar.llama.calibration import calibrate_devices

    async def every() -> list[Any]:
        return [(await calibrate_devices(port, 1))[0] for port in ports]

    return asyncio.run(every())


def measure(started: Started, binaries, model: Path, split: Split, rpc_ports: Sequence[int], spec: dict[str, Any],
            workdir: Path, rpc_procs: Sequence[subprocess.Popen]) -> dict[str, Any]:
    """llama-server over the rpc-servers with this split: a warm-up, then spec['reps'] timed requests."""
    import httpx

    from mesh_sidecar.llama.launch import llama_server_argv
    from mesh_sidecar.ports import free_tcp_port

    port = free_tcp_port()
    endpoints = [f"127.0.0.1:{rpc_ports[i]}" for i in split.members]
    argv = llama_server_argv(binaries, model, endpoints, port, tensor_split=split.weights,
                             extra=["--ctx-size", str(CTX_SIZE), "--threads", str(LLAMA_SERVER_THREADS),
                                    "--threads-batch", str(LLAMA_SERVER_THREADS)])
    log = workdir / f"llama-server-{split.label.replace('/', '-')}.log"
    began = time.monotonic()
    proc = started.popen(f"llama-server {split.label}", argv, log)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        for p in (proc, *rpc_procs):
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, START_TIMEOUT_S, f"llama-server with split {split.label} ready")
        load_s = time.monotonic() - began
        body = {"prompt": PROMPT, "max_tokens": spec["n_predict"], "cache_prompt": False, "ignore_eos": True,
                **GREEDY}

        def ask() -> dict[str, Any]:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
            r.raise_for_status()
            data = r.json()
            return {"text": data["choices"][0]["text"], "timings": data["timings"]}

        warmup = ask()
        reps = [ask() for _ in range(spec["reps"])]
    finally:
        started.stop(proc)
    rates = [r["timings"]["predicted_per_second"] for r in reps]
    buffers = [line.strip() for line in log.read_text(errors="replace").splitlines()
               if "model buffer size" in line]
    return {
        "counts": list(split.counts), "tensor_split": list(split.weights),
        "rpc": [MEMBERS[i] for i in split.members], "load_s": round(load_s, 2),
        "decode_tok_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
        "decode_tok_s_reps": rates, "prompt_tok_s": statistics.median(r["timings"]["prompt_per_second"] for r in reps),
        "text": warmup["text"], "texts_all_identical": len({warmup["text"], *(r["text"] for r in reps)}) == 1,
        "model_buffers": buffers,
    }


def _resolve_model(given: str) -> Path:
    from benchmarks.synthetic_model import PRESETS, ensure_synthetic_model

    return ensure_synthetic_model(PRESETS[given]) if given in PRESETS else Path(given)


def _quiet(message: str, done: int, total: int) -> None:
    pass


def _print(entry: dict[str, Any]) -> None:
    console = wide_console(140)
    speeds = entry["calibration"]
    console.print("calibrated decode speeds (GB/s): " + ", ".join(
        f"{n} {s['decode_bytes_per_s'] / 1e9:.2f}" for n, s in speeds.items())
        + f"; slow/fast {entry['slow_over_fast']:.3f} (1/{1 / entry['slow_over_fast']:.1f}); "
        f"ranked a slowest: {'yes' if entry['calibration_ranks_a_slowest'] else 'NO'}")
    caps = entry["caps"]
    console.print(f"memory caps: {caps['usable_bytes'] / 2**20:.0f} MiB each = {caps['share']:.3f} of "
                  f"{caps['need_bytes'] / 2**20:.0f} MiB (the three devices' need); "
                  f"layer {caps['layer_bytes'] / 2**20:.1f} MiB, margin {caps['margin_bytes'] / 2**20:.0f} MiB, "
                  f"output head {caps['output_bytes'] / 2**20:.0f} MiB")
    table = make_table(f"plan_speed: {entry['model']}, a at {entry['slow_cores']} core per "
                       f"{entry['quota_period_ms']:g} ms, {entry['n_predict']} "
                       f"tokens, {entry['reps']} reps (medians"
                       + (", final round)" if entry["brute_force"] else ")"),
                       ("plan", "layers a/b/c", "expected tok/s", "measured tok/s", "min-max", "/ memory plan",
                        "/ best split"), left=2)
    rows = [("memory plan", entry["memory_plan"]), (f"speed plan ({entry['speed_plan']['by']})", entry["speed_plan"])]
    if entry.get("best_split"):
        rows.append(("best split (brute force)", entry["best_split"]))
    for name, row in rows:
        m = row["measured"]["decode_tok_s"]
        table.add_row(name, "/".join(map(str, row["counts"])), f"{row['expected_tok_s']:.1f}", f"{m['median']:.1f}",
                      f"{m['min']:.1f}-{m['max']:.1f}", f"{row['over_memory']:.2f}",
                      f"{row['of_best']:.2f}" if row.get("of_best") is not None else "-")
    console.print(table)
    if entry.get("splits"):
        every = make_table("survey: every split within the caps (brute force), best first",
                           ("layers a/b/c", "expected tok/s", "measured tok/s", "min-max", "load s"), left=0)
        for s in sorted(entry["splits"], key=lambda s: -s["decode_tok_s"]["median"]):
            every.add_row("/".join(map(str, s["counts"])), f"{s['expected_tok_s']:.1f}",
                          f"{s['decode_tok_s']['median']:.1f}",
                          f"{s['decode_tok_s']['min']:.1f}-{s['decode_tok_s']['max']:.1f}", f"{s['load_s']:.1f}")
        console.print(every)
    goals = entry["goals"]
    console.print(f"speed plan / memory plan {goals['speed_over_memory']:.2f} (goal >= {GOAL_OVER_MEMORY}: "
                  f"{'met' if goals['speed_over_memory'] >= GOAL_OVER_MEMORY else 'NOT met'})"
                  + ("" if goals.get("speed_of_best") is None else
                     f"; speed plan / best split {goals['speed_of_best']:.2f} (goal >= {GOAL_OF_BEST}: "
                     f"{'met' if goals['speed_of_best'] >= GOAL_OF_BEST else 'NOT met'})"))
    console.print(f"greedy text, speed plan == memory plan: {'yes' if entry['greedy_texts_identical'] else 'NO'}")


def _write(entry: dict[str, Any], path: Path) -> None:
    """This model's entry into the JSON file, beside the other models' entries."""
    report = json.loads(path.read_text()) if path.exists() else {}
    report.setdefault("benchmark", "plan_speed")
    key = f"{entry['model_arg']}, {entry['slow_cores']:g} core per {entry['quota_period_ms']:g} ms"
    report.setdefault("runs", {})[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {path}")


def run(args, binaries, model: Path, started: Started, workdir: Path, quotas: list) -> dict[str, Any]:
    from mesh_sidecar.llama.estimate import estimate_model
    from mesh_sidecar.ports import free_tcp_port
    from mesh_sidecar.serve.planner import NodeCapacity, PlanBy, plan_layers
    from tests.helpers.cpu_quota import CpuQuota

    estimate = estimate_model(model, CTX_SIZE)
    brute = args.brute_force if args.brute_force is not None else estimate.n_layers <= BRUTE_FORCE_MAX_LAYERS
    ports = [free_tcp_port() for _ in MEMBERS]
    rpc = [start_rpc_server(started, binaries, name, port, workdir) for name, port in zip(MEMBERS, ports, strict=True)]
    quota = CpuQuota("plan-speed")
    quotas.append(quota)
    quota.add(rpc[0].pid)
    period_ms = slow_down(quota, args.slow_cores, args.quota_period_ms)
    print(f"rpc-servers a, b, c on {', '.join(map(str, ports))}; a at {args.slow_cores} core per {period_ms:g} ms; "
          "calibrating...",
          flush=True)
    calibrated = calibrate(ports)
    if any(s is None for s in calibrated):
        raise RuntimeError(f"calibration left a device unmeasured: {calibrated}")
    speeds = [float(s.decode_bytes_per_s) for s in calibrated]
    cap, share, need = choose_caps(estimate, MEMBERS)
    members = [NodeCapacity(name.encode(), name, cap, "CPU", decode_bytes_per_s=speed)
               for name, speed in zip(MEMBERS, speeds, strict=True)]
    plans = {"memory": plan_layers(members, estimate, by=PlanBy.MEMORY),
             "speed": plan_layers(members, estimate, by=PlanBy.SPEED)}
    spec = {"n_predict": args.n_predict, "reps": args.reps}
    survey: dict[tuple[int, ...], dict[str, Any]] = {}
    final: dict[tuple[int, ...], dict[str, Any]] = {}

    def measured(split: Split, into: dict[tuple[int, ...], dict[str, Any]]) -> dict[str, Any]:
        if split.counts not in into:
            print(f"split {split.label} (--tensor-split {','.join(map(str, split.weights))})...", flush=True)
            into[split.counts] = measure(started, binaries, model, split, ports, spec, workdir, rpc)
            into[split.counts]["expected_tok_s"] = 1 / expected_token_s(split.counts, speeds, estimate)
            print(f"  {into[split.counts]['decode_tok_s']['median']:.1f} tok/s", flush=True)
        return into[split.counts]

    splits = {key: split_of_plan(plan, MEMBERS) for key, plan in plans.items()}
    rows: dict[str, dict[str, Any]] = {
        key: {"counts": list(splits[key].counts), "tensor_split": list(plan.tensor_split()), "by": plan.by.value,
              "expected_tok_s": 1 / plan.token_s, "measured": measured(splits[key], survey)}
        for key, plan in plans.items()}
    if brute:
        for counts in every_split(estimate, [cap] * len(MEMBERS)):
            measured(split_of_counts(counts), survey)
        # The best of the survey is measured again beside the two plans, and the table shows that final
        # round: a split chosen as the best of many noisy medians would otherwise be flattered by its pick.
        best_counts = tuple(max(survey.values(), key=lambda r: r["decode_tok_s"]["median"])["counts"])
        splits["best"] = split_of_counts(best_counts)
        rows["best"] = {"counts": list(best_counts), "tensor_split": list(splits["best"].weights),
                        "expected_tok_s": survey[best_counts]["expected_tok_s"]}
        print("final round: the two plans and the survey's best split again...", flush=True)
        for key in rows:
            rows[key]["survey"] = rows[key].pop("measured", survey[best_counts])
            rows[key]["measured"] = measured(splits[key], final)
    memory_rate = rows["memory"]["measured"]["decode_tok_s"]["median"]
    best_rate = rows["best"]["measured"]["decode_tok_s"]["median"] if brute else None
    for row in rows.values():
        rate = row["measured"]["decode_tok_s"]["median"]
        row["over_memory"] = rate / memory_rate
        row["of_best"] = rate / best_rate if best_rate else None
    slow_over_fast = speeds[0] / max(speeds[1:])
    return {
        "model_arg": args.model, "model": model.name, "n_layers": estimate.n_layers, "ctx_size": CTX_SIZE,
        "slow_cores": args.slow_cores, "quota_period_ms": period_ms,
        "n_predict": args.n_predict, "reps": args.reps, "brute_force": brute,
        "prompt": PROMPT, "sampling": GREEDY, "cpu_count": os.cpu_count(),
        "calibration": {n: {"decode_bytes_per_s": s.decode_bytes_per_s, "prefill_bytes_per_s": s.prefill_bytes_per_s}
                        for n, s in zip(MEMBERS, calibrated, strict=True)},
        "slow_over_fast": slow_over_fast, "calibration_ranks_a_slowest": speeds[0] < min(speeds[1:]),
        "caps": {"usable_bytes": cap, "share": round(share, 4), "need_bytes": need,
                 "layer_bytes": estimate.layer_bytes(0), "margin_bytes": estimate.compute_margin_bytes,
                 "output_bytes": estimate.output_bytes},
        "plans": {key: plan.to_json() for key, plan in plans.items()},
        "memory_plan": rows["memory"], "speed_plan": rows["speed"], "best_split": rows.get("best"),
        "splits": list(survey.values()) if brute else [],
        "goals": {"speed_over_memory": rows["speed"]["over_memory"], "speed_of_best": rows["speed"]["of_best"]},
        "greedy_texts_identical": rows["speed"]["measured"]["text"] == rows["memory"]["measured"]["text"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file or synthetic preset (default tier-test)")
    parser.add_argument("--slow-cores", type=float, default=0.25, help="a's CPU quota in cores (default 0.25)")
    parser.add_argument("--quota-period-ms", type=float,
                        help="a's CFS period (default: the shortest the kernel takes, 4 ms at 0.25 core; "
                             "tests/helpers/cpu_quota.py's is 100); see slow_down()")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--brute-force", action=argparse.BooleanOptionalAction, default=None,
                        help=f"measure every split within the caps (default: on for <= {BRUTE_FORCE_MAX_LAYERS} "
                             "layers)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    from tests.helpers.cpu_quota import cgroup_cpu_available

    if os.geteuid() != 0 or not cgroup_cpu_available():
        print("needs root and a writable cgroup v1 cpu controller (/sys/fs/cgroup/cpu): run with sudo",
              file=sys.stderr)
        return 2
    from mesh_sidecar.llama.build import ensure_binaries

    binaries = ensure_binaries(None, _quiet)
    model = _resolve_model(args.model)
    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-plan-speed-"))
    quotas: list = []

    def body() -> int:
        began = datetime.now(UTC).isoformat(timespec="seconds")
        entry = run(args, binaries, model, started, workdir, quotas)
        entry["began"], entry["ended"] = began, datetime.now(UTC).isoformat(timespec="seconds")
        _print(entry)
        _write(entry, args.json)
        return 0

    def close_quotas() -> None:
        for quota in quotas:
            quota.close()

    try:
        return run_benchmark(body, started, workdir, close_quotas)
    except Exception:
        print(f"logs kept in {workdir}", file=sys.stderr)
        raise


if __name__ == "__main__":
    sys.exit(main())
