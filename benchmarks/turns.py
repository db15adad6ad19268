"""The benchmarks' run: setups taking turns, measured from one host.

``client(spec)`` runs inside a host's namespace (``python -m benchmarks.turns SPEC``, one JSON
object out): every setup in ``spec["sides"]`` gets a warm-up request, then ``spec["reps"]`` rounds
of a plain ``/v1/completions`` request (llama-server's ``timings``) and a streamed one (time to the
first SSE chunk with text), the setups taking turns ABBA (the first setup first in even rounds, last
in odd ones) so the machine's drift hits each alike, all with ``cache_prompt: false``; the CPU of
each setup's processes is counted over its own turns and over the others'. With
``spec["stream_prompts"]`` it sends those prompts at once instead, a warm-up round and ``reps`` timed
rounds. ``run_client`` runs it from the orchestrator, ``run_mesh`` and ``run_direct`` start one
setup (``benchmarks/setup.py``) and measure it alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.setup import (
    START_TIMEOUT_S,
    Started,
    Watched,
    check_alive,
    cpu_seconds,
    run_watched,
    start_direct,
    start_mesh,
)

GREEDY = {"temperature": 0, "top_k": 1, "seed": 42}
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into one workshop process. "
    "Explain in a few paragraphs how this invention changed the way knowledge spread across Europe:"
)


# ``--streams``: that many of these at once (the first is PROMPT), each a different text of about
# PROMPT's length, so every slot evaluates a prompt of its own.
STREAM_PROMPTS = (
    PROMPT,
    "The steam engine did not appear all at once: Newcomen's atmospheric pump drained mines for decades "
    "before James Watt added a separate condenser and made it efficient enough for mills. Describe in a "
    "few paragraphs how steam power reshaped the factories and towns of Britain:",
    "Long before satellites, sailors crossed oceans with a compass, a log line and the stars, and the "
    "marine chronometer finally let them fix their longitude at sea. Explain in a few paragraphs why "
    "measuring time precisely was the key to finding a ship's position:",
    "Vaccination began with Edward Jenner's observation that milkmaids who caught cowpox were spared "
    "from smallpox, and within two centuries the disease was gone from the world. Describe in a few "
    "paragraphs how vaccines teach the immune system to recognise a threat:",
)


# Neither llama-server is given --parallel: both run with the pinned build's automatic slot count
# (its log: "initializing, n_slots = 4"). More streams than slots would queue in llama-server and
# time its queue, not the links.
LLAMA_SERVER_AUTO_SLOTS = 4


def client(spec: dict[str, Any]) -> dict[str, Any]:
    """Every setup in ``spec["sides"]`` (label -> port, optional status_home and cpu_pids), its
    requests taking turns with the others' (ABBA: the first setup first in even rounds, last in odd
    ones), so the machine's drift hits each alike; returns label -> that setup's result."""
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    sides: dict[str, dict[str, Any]] = spec["sides"]
    bases = {label: f"http://127.0.0.1:{side['port']}" for label, side in sides.items()}
    body = {"prompt": spec["prompt"], "max_tokens": spec["n_predict"], "cache_prompt": False, **GREEDY}

    deadline = time.monotonic() + START_TIMEOUT_S
    for base in bases.values():
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{base}/health not 200 within {START_TIMEOUT_S} s")
            time.sleep(0.2)

    def plain(label: str, prompt: str = spec["prompt"]) -> dict[str, Any]:
        started = time.perf_counter()
        r = httpx.post(f"{bases[label]}/v1/completions", json={**body, "prompt": prompt}, timeout=600)
        r.raise_for_status()
        data = r.json()
        timings = data.get("timings")
        if timings is None:
            raise SystemExit(f"/v1/completions returned no timings: {sorted(data)}")
        # Beside timings' prompt_ms + predicted_ms: what the request spent outside llama-server's work.
        return {"text": data["choices"][0]["text"], "completion_tokens": data["usage"]["completion_tokens"],
                "prompt_tokens": data["usage"]["prompt_tokens"], "timings": timings,
                "elapsed_ms": (time.perf_counter() - started) * 1000}

    def streamed(label: str) -> dict[str, Any]:
        ttft = None
        pieces: list[str] = []
        started = time.perf_counter()
        with httpx.stream("POST", f"{bases[label]}/v1/completions", json={**body, "stream": True},
                          timeout=600) as r:
            r.raise_for_status()
            for chunk in sse_events(r.iter_lines()):
                text = event_text(chunk)
                if text and ttft is None:
                    ttft = (time.perf_counter() - started) * 1000
                pieces.append(text)
        return {"ttft_ms": ttft, "text": "".join(pieces)}

    def status(label: str) -> dict[str, Any] | None:
        if not sides[label].get("status_home"):
            return None
        out = subprocess.run([sys.executable, "-m", "mesh_sidecar", "status", "--home",
                              sides[label]["status_home"], "--json"],
                             capture_output=True, text=True, check=True, timeout=60)
        return json.loads(out.stdout)

    def concurrent(label: str, prompts: list[str]) -> dict[str, Any]:
        """One plain request per prompt, all at once: the wall time until the last answer is in."""
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(partial(plain, label), prompts))
        return {"wall_s": time.perf_counter() - started, "streams": answers}

    # Each setup's processes' CPU (cpu_pids: name -> pid) over its own turns, and over the others'
    # turns: what an idle setup took from the one measured.
    own: dict[str, Counter[str]] = {label: Counter() for label in sides}
    beside: dict[str, Counter[str]] = {label: Counter() for label in sides}

    def cpu_now() -> dict[str, dict[str, float]]:
        return {label: {name: cpu_seconds(pid) for name, pid in side.get("cpu_pids", {}).items()}
                for label, side in sides.items()}

    def turn(label: str, request: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before = cpu_now()
        answer = request()
        for other, after in cpu_now().items():
            for name, seconds in after.items():
                (own if other == label else beside)[other][name] += seconds - before[other][name]
        return answer

    def rounds() -> list[list[str]]:
        labels = list(sides)
        return [labels if i % 2 == 0 else labels[::-1] for i in range(spec["reps"])]

    if spec.get("stream_prompts"):  # the concurrent phase, a client call of its own (see run_streams)
        prompts = spec["stream_prompts"]
        for label in sides:
            concurrent(label, prompts)  # warm-up
        reps: dict[str, list[dict[str, Any]]] = {label: [] for label in sides}
        for order in rounds():
            for label in order:
                reps[label].append(concurrent(label, prompts))
        return {label: {"reps": reps[label]} for label in sides}

    def warm_up(label: str) -> dict[str, Any]:
        answer = plain(label)
        streamed(label)
        return answer

    warmups = {label: turn(label, partial(warm_up, label)) for label in sides}
    before = {label: status(label) for label in sides}
    reps = {label: [] for label in sides}

    def rep(label: str) -> dict[str, Any]:
        answer = plain(label)
        s = streamed(label)
        return {**answer, "ttft_ms": s["ttft_ms"], "stream_text": s["text"]}

    for order in rounds():
        for label in order:
            reps[label].append(turn(label, partial(rep, label)))
    return {label: {"warmup_text": warmups[label]["text"], "reps": reps[label], "status_before": before[label],
                    "status_after": status(label), "cpu_s": dict(own[label]),
                    "cpu_s_beside": dict(beside[label])}
            for label in sides}


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed ``/v1/completions`` answer, up to its ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def event_text(event: dict[str, Any]) -> str:
    """The text one event of a streamed answer carries (its choices' together)."""
    return "".join(c.get("text") or "" for c in event.get("choices", []))


def run_client(host, spec: dict[str, Any], sides: dict[str, dict[str, Any]], watched: Watched) -> dict:
    """Run the client in ``host``'s namespace against ``sides`` (label -> port, optional status_home
    and cpu_pids), their requests taking turns; label -> result. Gives up if a watched process dies."""
    argv = host.exec_argv(sys.executable, "-m", "benchmarks.turns", json.dumps({**spec, "sides": sides}))
    returncode, out, err = run_watched(argv, partial(check_alive, watched), 0.2)
    if returncode != 0:
        raise RuntimeError(f"client in {host.name} failed ({returncode}):\n{err[-3000:]}")
    return json.loads(out)


def run_streams(host, spec: dict[str, Any], sides: dict[str, dict[str, Any]], watched: Watched) -> dict:
    """With ``spec["streams"]``, that many prompts sent at once, ``spec["reps"]`` times after a warm-up,
    per side (label -> result, or None without). A client call after the single-stream one, so the
    tunnel, RPC command and CPU counts per token stay those of one stream."""
    if not spec.get("streams"):  # other benchmarks' specs (speculative.py) have none
        return dict.fromkeys(sides)
    prompts = list(STREAM_PROMPTS[:spec["streams"]])
    return run_client(host, {**spec, "stream_prompts": prompts}, sides, watched)


def run_mesh(lab_hosts, started: Started, workdir: Path, spec: dict[str, Any],
             model: Path | None = None, serve_args: tuple[str, ...] = (),
             label: str = "mesh", node_args: tuple[str, ...] = ()) -> tuple[dict, list[str], dict]:
    """``start_mesh``, then measure it alone through c's :8080; (client result, order, info)."""
    mesh = start_mesh(lab_hosts, started, workdir, model, serve_args, label, node_args)
    sides = {"mesh": mesh.side()}
    result = mesh.finish(run_client(lab_hosts["c"], spec, sides, mesh.watched)["mesh"])
    result["concurrent"] = run_streams(lab_hosts["c"], spec, sides, mesh.watched)["mesh"]
    return result, mesh.order, mesh.info


def run_direct(lab_hosts, started: Started, workdir: Path, spec: dict[str, Any], order: list[str],
               mesh_info: dict[str, Any]) -> tuple[dict, dict]:
    """``start_direct``, then measure it alone; (client result, info)."""
    direct = start_direct(lab_hosts, started, workdir, order, mesh_info)
    sides = {"direct": direct.side()}
    result = run_client(lab_hosts["c"], spec, sides, direct.watched)["direct"]
    result["concurrent"] = run_streams(lab_hosts["c"], spec, sides, direct.watched)["direct"]
    return result, direct.info


if __name__ == "__main__":
    print(json.dumps(client(json.loads(sys.argv[1]))))
