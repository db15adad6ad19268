"""Why a serving node leaves a member out of its plan (an exclusion): other weights, an RPC build
it cannot talk to, corrupt layer outputs, or tokens held up.

Pure: both sides decide from the MemberInfo gossip carries, so the serving node
(plan, status) and the member left out (its own output and status) name the
same reason with the same words. Corrupt output is found at run time by the
serving node (wire/rpc_outputs.py's rule), and so is slowness (serve/pace.py): it lists the member
in its own gossip (``corrupt_outputs``, ``slow_workers``) with the member's run id, and a restart
clears it (verdicts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.gossip import LlamaBuild, MemberInfo
from ..wire.rpc_hello import accepts
from ..wire.rpc_outputs import ABSOLUTE_OUTLIER, NON_FINITE, NORM_OUTLIER, PROTOCOL_VIOLATION

# Why a serving node leaves a member out: it holds a different model file...
WEIGHTS_MISMATCH = "weights_mismatch"
# ...or its rpc-server speaks an RPC version the serving node's llama-server refuses (and would abort on).
LLAMA_BUILD_MISMATCH = "llama_build_mismatch"
# ...or its rpc-server returned layer outputs that were NaN/Inf or far off their usual scale, or broke the
# RPC protocol on the way (a reply nobody asked for, one of the wrong size), in this run.
CORRUPT_OUTPUT = "corrupt_output"
# ...or its rpc-server's replies held the serving node's tokens up far past their usual time, lately.
SLOW = "slow"
FAULT_TEXT = {NON_FINITE: "NaN or Inf values", NORM_OUTLIER: "values far outside their own recent range",
              ABSOLUTE_OUTLIER: "values far beyond any real model's", PROTOCOL_VIOLATION: "RPC protocol violations"}
SHA256_SHOWN_CHARS = 12
SLOW_EXCLUSION_S = 600.0  # a member left out as slow is given layers again after this long (verdicts.py)
SAME_BUILD_REMEDY = ("Run one llama.cpp build on every machine: ./scripts/bootstrap.sh (the pinned build; leave "
                     "--llama-bin unset), or --llama-bin pointing at builds of the same llama.cpp commit.")


@dataclass(frozen=True)
class Exclusion:
    """A member the serving node gives no layers, and why."""

    reason: str
    """WEIGHTS_MISMATCH, LLAMA_BUILD_MISMATCH, CORRUPT_OUTPUT or SLOW: what scripts and tests match on."""
    detail: str
    """What differs, naming both sides."""
    remedy: str
    """What the person at the member can do about it."""

    def message(self, member: str) -> str:
        """The line the member left out says to its user."""
        return f"{self.reason}: {self.detail}, so no layers will be placed on {member}. {self.remedy}"


def holds_other_weights(own_sha256: str, info: MemberInfo) -> bool:
    """True when both sides name a model file and the files differ."""
    return bool(own_sha256 and info.model_sha256 and own_sha256 != info.model_sha256)


def build_mismatch(client: LlamaBuild, server: LlamaBuild) -> bool:
    """Whether a llama-server of build ``client`` refuses an rpc-server of build ``server``.

    A client whose own version is unknown judges nobody: there is nothing to compare with.
    """
    if client.rpc is None:
        return False
    return server.rpc is None or not accepts(client.rpc, server.rpc)


def exclusion_of(member: MemberInfo, serving: MemberInfo) -> Exclusion | None:
    """Why ``serving`` (as the serving node) leaves ``member`` out of its plan, or None."""
    found = next((c for c in serving.corrupt_outputs
                  if c.node_id == member.node_id and c.run_id == member.run_id), None)
    if found is not None:
        return Exclusion(
            CORRUPT_OUTPUT,
            f"{serving.name} found {FAULT_TEXT.get(found.fault, found.fault)} in the layer outputs "
            f"{member.name}'s rpc-server returned",
            f"Check that {member.name} runs the pinned llama.cpp build and nothing else answers on its rpc-server's "
            "port, then restart mesh-inference there: a restarted member is given layers again."
            if found.fault == PROTOCOL_VIOLATION else
            f"Check {member.name}'s GPU and memory (a driver reset, a memory test), then restart mesh-inference "
            "there: a restarted member is given layers again.")
    held = next((w for w in serving.slow_workers if w.node_id == member.node_id and w.run_id == member.run_id), None)
    if held is not None:
        return Exclusion(
            SLOW,
            f"{serving.name} waited {held.owed_ms / 1000:.1f} s of {held.window_ms / 1000:.1f} s for the replies of "
            f"{member.name}'s rpc-server while a token takes about {held.token_ms} ms",
            f"Check what else runs on {member.name} (another program on its GPU or CPU) and its network; it is "
            f"given layers again in {SLOW_EXCLUSION_S / 60:.0f} minutes, or at once when mesh-inference restarts "
            "there.")
    # A member serving a model of its own is no worker for anyone (serve/assignment.py): its file is its own.
    if holds_other_weights(serving.model_sha256, member) and not member.serving:
        return Exclusion(
            WEIGHTS_MISMATCH,
            f"{member.name}'s model (sha256 {member.model_sha256[:SHA256_SHOWN_CHARS]}...) is not the one "
            f"{serving.name} serves (sha256 {serving.model_sha256[:SHA256_SHOWN_CHARS]}...)",
            f"Start {member.name} without --model, or with the same GGUF file.")
    client, server = serving.llama_build, member.llama_build
    if build_mismatch(client, server):
        own = client.rpc
        assert own is not None
        spoken = f"speaks RPC {server.rpc}" if server.rpc is not None else "answers no RPC HELLO this release reads"
        taken = f"{own.major}.0.x" if own.minor == 0 else f"{own.major}.0 to {own.major}.{own.minor}"
        return Exclusion(
            LLAMA_BUILD_MISMATCH,
            f"{member.name}'s rpc-server {spoken} ({server.llama_cpp}), but {serving.name}'s llama-server "
            f"speaks RPC {own} ({client.llama_cpp}) and accepts only RPC {taken}",
            SAME_BUILD_REMEDY)
    return None


def exclusion_between(own: MemberInfo, info: MemberInfo) -> Exclusion | None:
    """Why this node (``own``), serving, leaves member ``info`` out; or why ``info``, serving, leaves this node out."""
    if own.serving:
        return exclusion_of(info, own)
    return exclusion_of(own, info) if info.serving else None
