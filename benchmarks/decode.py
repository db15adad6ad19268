"""Decode benchmark: the same three hosts, stock llama.cpp RPC over TCP vs. the QUIC mesh.

Three hosts a, b and c live in network namespaces on one bridge (``tests/helpers/netns.py``).
Two setups split the same model over the same three hosts, in the same order, and
answer the same greedy prompt from host c:

- mesh: three ``mesh_sidecar`` nodes as in ``tests/integration/test_mesh_netns.py`` (a works,
  b joins a, c joins b and serves the API on :8080 with ``--min-peers 2``);
- direct: a ``ggml-rpc-server`` on every host, listening on the host's address (the stock
  way, over TCP, only inside this private lab) with that mesh node's own rpc-server argv
  (binary, threads, devices, cache), and on c a ``llama-server`` with the mesh's own
  llama-server argv (binary, ``--tensor-split``, context size, flags), its ``--rpc``
  listing the same hosts in the same order over TCP.

With ``--loopback`` the three hosts are names on this machine's loopback instead
(ports of their own, no namespaces, no root, unshaped only): for a GPU machine
without namespaces, where the nodes use the backend ``setup --backend`` built and the
direct rpc-servers the same build.

The mesh starts first (its order is only known once it runs: it sorts peers by
node id, and the ids are new every run), then the direct setup beside it, and the
two take turns: one warm-up request each, then ``--reps`` rounds, each a plain
``/v1/completions`` request (llama-server's ``timings``) and a streamed request
(time to the first SSE chunk with text) to one setup, then the same to the other,
the first setup first in even rounds and last in odd ones (ABBA), so the machine's
drift between minutes hits both alike; all with ``cache_prompt: false`` so every
request evaluates the prompt. The idle setup stays up meanwhile: direct's idle
processes only wait, the mesh's sidecars keep their heartbeats and gossip, and the
report gives that CPU per direct token (``mesh_sidecar_cpu_ms_per_direct_token``).
With ``--streams N`` (at most llama-server's 4 automatic slots) the two then take
turns sending N different prompts at once, a warm-up round and ``--reps`` timed
rounds: their generated tokens over the round's wall time is the aggregate decode
rate. Each report entry holds the mesh/direct ratios of the medians (decode tok/s,
TTFT, aggregate tok/s) and, with ``--b2b``, b2b over stock mesh. The setups of
``--b2b`` and ``--quic`` run alone afterwards, each compared with the paired
direct's figures.

The comparison runs once per link profile (``--profiles``, names from
``tests/helpers/netns.py`` ``LINK_PROFILES``), each on a fresh lab: the plain bridge, tbf
rate limits on every link, or the delay switch that holds every frame between
hosts for a fixed time (both setups cross it alike).

Run as root: ``.venv/bin/python -m benchmarks.decode [--reps N] [--n-predict N]
[--profiles unshaped,1gbit,100mbit,5ms,20ms] [--model PATH|bench-1gb] [--json PATH] [--b2b]
[--streams N]``, or without root with ``--loopback`` (instead of ``--profiles``). With
``--b2b`` a third setup runs: the mesh with every node on the b2b build.
Figures are printed and written as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.report import (
    failed_row,
    make_table,
    publish,
    ratio_of_medians,
    round_ratios,
    sidecar_cpu_ms_per_token,
    summary,
    tunnel_bytes,
    wide_console,
)
from benchmarks.setup import (
    REPO_ROOT,
    LoopbackHost,
    Started,
    attempt,
    lacks_root,
    quiet,
    resolve_model,
    run_benchmark,
    start_direct,
    start_mesh,
)
from benchmarks.turns import GREEDY, LLAMA_SERVER_AUTO_SLOTS, PROMPT, STREAM_PROMPTS, run_client, run_mesh, run_streams

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "decode.json"
DEFAULT_PROFILES = "unshaped,1gbit,100mbit,5ms,20ms"


def run_profile(profile: str, model: Path, spec: dict[str, Any], workdir: Path,
                started: Started, b2b: bool = False, quic: bool = False, loopback: bool = False) -> dict[str, Any]:
    """The mesh, then the direct setup beside it (and with ``b2b`` the mesh on the b2b build, with ``quic`` the
    mesh with ``--data-path quic``), on a fresh lab with this link profile (``loopback``: every host on this
    machine's loopback, unshaped); its report entry."""
    from tests.helpers.netns import LINK_PROFILES, Lab

    workdir.mkdir(parents=True)
    began = datetime.now(UTC).isoformat(timespec="seconds")
    # The sniffer's per-frame loop would compete for the CPU.
    lab = None if loopback else Lab(**LINK_PROFILES[profile], sniff=False)
    try:
        hosts = {name: lab.add_host(name) if lab is not None else LoopbackHost(name) for name in "abc"}
        print(f"[{profile}] mesh: starting a, b, c (logs in {workdir})...", flush=True)
        # Plain decoding on both sides: speculation has its own benchmark (speculative.py).
        mesh = start_mesh(hosts, started, workdir, model, ("--speculation", "off"))
        order = mesh.order
        print(f"[{profile}] direct beside it: rpc-servers on a, b, c over TCP, order {','.join(order)}; "
              "the two take turns...", flush=True)
        direct = start_direct(hosts, started, workdir, order, mesh.info)
        sides, watched = {"mesh": mesh.side(), "direct": direct.side()}, mesh.watched + direct.watched
        paired = run_client(hosts["c"], spec, sides, watched)
        mesh_result, direct_result = mesh.finish(paired["mesh"]), paired["direct"]
        concurrent = run_streams(hosts["c"], spec, sides, watched)
        mesh_result["concurrent"], direct_result["concurrent"] = concurrent["mesh"], concurrent["direct"]
        mesh_info, direct_info = mesh.info, direct.info
        if b2b:
            started.stop_all()
            print(f"[{profile}] mesh with --b2b: workers pass activations to each other...", flush=True)
            b2b_result, _, b2b_info = run_mesh(hosts, started, workdir, spec, model,
                                                       ("--speculation", "off"), "mesh-b2b", ("--b2b",))
        if quic:
            started.stop_all()
            print(f"[{profile}] mesh with --data-path quic: every tunnel over QUIC...", flush=True)
            quic_result, _, quic_info = run_mesh(hosts, started, workdir, spec, model,
                                                 ("--speculation", "off"), "mesh-quic", ("--data-path", "quic"))
    finally:
        started.stop_all()
        if lab is not None:
            lab.close()
    entry = {
        "profile": profile,
        "link": "loopback" if loopback else LINK_PROFILES[profile],
        # To match against whatever else ran on the machine meanwhile.
        "began": began,
        "ended": datetime.now(UTC).isoformat(timespec="seconds"),
        "order": order,
        "direct": {**summary(direct_result), **direct_info},
        "mesh": {**summary(mesh_result), **mesh_info},
        "mesh_tunnels": tunnel_bytes(mesh_result),
        "mesh_sidecar_cpu_ms_per_token": sidecar_cpu_ms_per_token(mesh_result, mesh_result["cpu_s"]),
        # The idle mesh beside direct's turns (heartbeats, gossip): what it took from direct's CPU.
        "mesh_sidecar_cpu_ms_per_direct_token": sidecar_cpu_ms_per_token(direct_result, mesh_result["cpu_s_beside"]),
        "raw": {"direct": direct_result["reps"], "mesh": mesh_result["reps"]},
    }
    entry["decode_ratio_mesh_over_direct"] = ratio_of_medians(entry, "mesh", "direct", "decode_tok_s")
    entry["ttft_ratio_mesh_over_direct"] = ratio_of_medians(entry, "mesh", "direct", "ttft_ms")
    # The two took turns: each round's own ratio, whose spread says how far the medians' ratio can be trusted.
    entry["rounds_mesh_over_direct"] = {
        "decode": round_ratios(mesh_result, direct_result, lambda r: r["timings"]["predicted_per_second"]),
        "ttft": round_ratios(mesh_result, direct_result, lambda r: r["ttft_ms"])}
    entry["greedy_texts_identical"] = entry["direct"]["text"] == entry["mesh"]["text"]
    if spec["streams"]:
        entry["raw"]["direct_streams"] = direct_result["concurrent"]["reps"]
        entry["raw"]["mesh_streams"] = mesh_result["concurrent"]["reps"]
        entry["aggregate_ratio_mesh_over_direct"] = ratio_of_medians(entry, "mesh", "direct", "streams",
                                                                     "aggregate_tok_s")
        # Informational only: llama.cpp's batched decoding is not batch-invariant, so concurrent
        # greedy streams may part ways between two runs of the same setup too.
        entry["stream_texts_identical"] = [m == d for m, d in zip(entry["mesh"]["streams"]["texts"],
                                                                   entry["direct"]["streams"]["texts"], strict=True)]
    if quic:
        entry["mesh_quic"] = {**summary(quic_result), **quic_info}
        entry["decode_ratio_mesh_quic_over_direct"] = ratio_of_medians(entry, "mesh_quic", "direct", "decode_tok_s")
        entry["ttft_ratio_mesh_quic_over_direct"] = ratio_of_medians(entry, "mesh_quic", "direct", "ttft_ms")
    if b2b:
        entry["mesh_b2b"] = {**summary(b2b_result), **b2b_info}
        entry["mesh_b2b_tunnels"] = tunnel_bytes(b2b_result)
        entry["mesh_b2b_sidecar_cpu_ms_per_token"] = sidecar_cpu_ms_per_token(b2b_result, b2b_result["cpu_s"])
        entry["raw"]["mesh_b2b"] = b2b_result["reps"]
        entry["decode_ratio_b2b_over_direct"] = ratio_of_medians(entry, "mesh_b2b", "direct", "decode_tok_s")
        entry["b2b_over_stock"] = ratio_of_medians(entry, "mesh_b2b", "mesh", "decode_tok_s")
        entry["greedy_texts_identical"] &= entry["mesh_b2b"]["text"] == entry["direct"]["text"]
        if spec["streams"]:
            entry["raw"]["mesh_b2b_streams"] = b2b_result["concurrent"]["reps"]
    if lab is not None and lab.switch_stats is not None:
        entry["delay_switch"] = lab.switch_stats
    return entry


def _print(report: dict[str, Any]) -> None:
    console = wide_console(120)
    d, m = report["direct"], report["mesh"]
    streams = d.get("streams")
    table = make_table(f"decode on {report['profile']}: {report['model']}, {report['n_predict']} tokens, "
                       f"{report['reps']} reps, "
                       f"prompt {d['prompt_tokens']} tokens, rpc order {','.join(report['order'])}",
                       ("setup", "prompt tok/s (med)", "decode tok/s (med)", "decode min–max", "TTFT ms (med)",
                        "decode /direct", "TTFT /direct",
                        *((f"{streams['count']} streams tok/s (med)", "streams /direct") if streams else ())))
    setups = [("direct", d), ("mesh", m)] + ([("mesh --b2b", report["mesh_b2b"])] if "mesh_b2b" in report else [])

    def over_direct(name: str, s: dict[str, Any], *figure: str) -> str:
        return f"{ratio_of_medians({name: s, 'direct': d}, name, 'direct', *figure):.2f}" if name != "direct" else ""

    for name, s in setups:
        table.add_row(name, f"{s['prompt_tok_s']['median']:.1f}", f"{s['decode_tok_s']['median']:.1f}",
                      f"{s['decode_tok_s']['min']:.1f}–{s['decode_tok_s']['max']:.1f}",
                      f"{s['ttft_ms']['median']:.1f}", over_direct(name, s, "decode_tok_s"),
                      over_direct(name, s, "ttft_ms"),
                      *((f"{s['streams']['aggregate_tok_s']['median']:.1f}",
                         over_direct(name, s, "streams", "aggregate_tok_s")) if streams else ()))
    console.print(table)
    if "rounds_mesh_over_direct" in report:
        console.print("mesh/direct round by round (median, quartiles): " + "; ".join(
            f"{name} {r['median']:.2f} ({r['q1']:.2f}-{r['q3']:.2f})"
            for name, r in report["rounds_mesh_over_direct"].items()))
    if "b2b_over_stock" in report:
        console.print(f"decode mesh --b2b / stock mesh: {report['b2b_over_stock']:.2f}")
    tunnels = make_table("mesh tunnels on c, over the timed repetitions",
                         ("tunnel", "bytes c→peer / token", "bytes peer→c / token", "RPC commands / token"))
    for setup, key in (("", "mesh_tunnels"), (" (--b2b)", "mesh_b2b_tunnels")):
        for name, row in sorted(report.get(key, {}).items()):
            tunnels.add_row(name + setup, f"{row['to_peer_per_token']:,.0f}", f"{row['from_peer_per_token']:,.0f}",
                            f"{row['rpc_commands_per_token']:.1f}")
    console.print(tunnels)
    for setup, key in (("mesh", "mesh_sidecar_cpu_ms_per_token"), ("mesh --b2b", "mesh_b2b_sidecar_cpu_ms_per_token")):
        if key in report:
            console.print(f"{setup}: sidecar CPU ms per token " + ", ".join(
                f"{name} {ms:.2f}" for name, ms in sorted(report[key].items())))
    if "mesh_sidecar_cpu_ms_per_direct_token" in report:
        console.print("the idle mesh's sidecars during direct's turns, CPU ms per direct token " + ", ".join(
            f"{name} {ms:.2f}" for name, ms in sorted(report["mesh_sidecar_cpu_ms_per_direct_token"].items())))
    same = report["greedy_texts_identical"]
    console.print(f"greedy text direct == mesh: {'yes' if same else 'NO'}"
                  f" (every request within each setup identical: direct "
                  f"{'yes' if d['texts_all_identical'] else 'NO'}, mesh {'yes' if m['texts_all_identical'] else 'NO'})")
    if "stream_texts_identical" in report:
        console.print("concurrent streams' greedy text direct == mesh (informational: batched decoding is not "
                      "batch-invariant): " + ", ".join("yes" if s else "no" for s in report["stream_texts_identical"]))


def _print_summary(report: dict[str, Any]) -> None:
    table = make_table(f"decode across link profiles: {report['model']}, {report['n_predict']} tokens, "
                       f"{report['reps']} reps (medians)",
                       ("profile", "decode tok/s direct", "mesh", "mesh/direct", "mesh --b2b", "b2b/direct",
                        "b2b/mesh", "TTFT ms direct", "mesh", "mesh/direct", "streams tok/s direct", "mesh",
                        "mesh/direct", "prompt tok/s direct", "mesh", "same text"))
    for e in report["profiles"]:
        if "error" in e:
            failed_row(table, e["profile"])
            continue
        d, m, b = e["direct"], e["mesh"], e.get("mesh_b2b")
        streams = (*(f"{s['streams']['aggregate_tok_s']['median']:.1f}" for s in (d, m)),
                   f"{e['aggregate_ratio_mesh_over_direct']:.2f}") if "streams" in d else ("-",) * 3
        table.add_row(e["profile"], f"{d['decode_tok_s']['median']:.1f}", f"{m['decode_tok_s']['median']:.1f}",
                      f"{e['decode_ratio_mesh_over_direct']:.2f}",
                      f"{b['decode_tok_s']['median']:.1f}" if b else "-",
                      f"{e['decode_ratio_b2b_over_direct']:.2f}" if b else "-",
                      f"{e['b2b_over_stock']:.2f}" if b else "-", f"{d['ttft_ms']['median']:.0f}",
                      f"{m['ttft_ms']['median']:.0f}", f"{e['ttft_ratio_mesh_over_direct']:.2f}", *streams,
                      f"{d['prompt_tok_s']['median']:.1f}",
                      f"{m['prompt_tok_s']['median']:.1f}", "yes" if e["greedy_texts_identical"] else "NO")
    wide_console(180).print(table)
    for e in report["profiles"]:
        if "mesh_quic" in e:
            print(f"[{e['profile']}] mesh with --data-path quic: decode "
                  f"{e['mesh_quic']['decode_tok_s']['median']:.1f} tok/s, "
                  f"{e['decode_ratio_mesh_quic_over_direct']:.2f} of direct; TTFT "
                  f"{e['mesh_quic']['ttft_ms']['median']:.0f} ms, "
                  f"{e['ttft_ratio_mesh_quic_over_direct']:.2f} of direct")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--profiles",
                        help=f"comma-separated link profiles (default {DEFAULT_PROFILES}; also 0ms: the delay "
                             "switch with no delay)")
    parser.add_argument("--model", help="GGUF file, or a synthetic preset name such as bench-1gb "
                                        "(default: the default model)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quic", action="store_true",
                        help="also run the mesh with --data-path quic (every tunnel over QUIC), for the "
                             "native data path's gain in the same run")
    parser.add_argument("--b2b", action="store_true",
                        help="also run the mesh on the b2b build (workers pass activations to each other)")
    parser.add_argument("--streams", type=int, default=0, choices=range(LLAMA_SERVER_AUTO_SLOTS + 1),
                        metavar=f"0..{LLAMA_SERVER_AUTO_SLOTS}",
                        help="after the single-stream requests, also send this many different prompts at once, "
                             "--reps times, and report their aggregate decode tok/s (default 0: none)")
    parser.add_argument("--loopback", action="store_true",
                        help="every host on this machine's loopback instead of network namespaces: no root, "
                             "no link profiles (unshaped only); for a GPU machine without namespaces")
    args = parser.parse_args(argv)
    if not args.loopback and lacks_root():
        return 2
    sys.path.insert(0, str(REPO_ROOT))
    from mesh_sidecar.llama.backends import recorded_backend
    from mesh_sidecar.llama.build import B2B, STOCK, ensure_binaries
    from tests.helpers.netns import LINK_PROFILES

    profiles = (args.profiles or ("unshaped" if args.loopback else DEFAULT_PROFILES)).split(",")
    unknown = [p for p in profiles if p not in LINK_PROFILES]
    if unknown:
        print(f"unknown profile(s) {', '.join(unknown)}; choose from {', '.join(LINK_PROFILES)}", file=sys.stderr)
        return 2
    if args.loopback and profiles != ["unshaped"]:
        print("--loopback shapes no link: leave --profiles out (or give unshaped)", file=sys.stderr)
        return 2
    # Built now, not under a node's start timeout: the backend the nodes use (the last `setup --backend`);
    # the direct setup runs the nodes' own binaries.
    backend = recorded_backend()
    ensure_binaries(None, quiet, STOCK.on(backend))
    if args.b2b:
        ensure_binaries(None, quiet, B2B.on(backend))
    model = resolve_model(args.model)
    spec = {"prompt": PROMPT, "n_predict": args.n_predict, "reps": args.reps, "streams": args.streams}
    report = {
        "benchmark": "decode",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model.name,
        "prompt": PROMPT,
        "n_predict": args.n_predict,
        "reps": args.reps,
        "streams": args.streams,
        "stream_prompts": list(STREAM_PROMPTS[:args.streams]),
        "sampling": GREEDY,
        "cpu_count": os.cpu_count(),
        "profiles": [],
    }

    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-decode-"))

    def body() -> int:
        failed = False
        for profile in profiles:
            entry = attempt(profile, partial(run_profile, profile, model, spec, workdir / profile, started, args.b2b,
                                             args.quic, args.loopback))
            if "error" in entry:
                report["profiles"].append({"profile": profile, **entry})
                failed = True
                continue
            report["profiles"].append(entry)
            _print({**report, **entry})
        return publish(report, _print_summary, args.json, failed)

    return run_benchmark(body, started, workdir)


if __name__ == "__main__":
    sys.exit(main())
