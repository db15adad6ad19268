"""Tables for people, built from the same JSON that `--json` prints.

Every view fits an 80-column terminal: a table there has the columns a person reads at a glance
(names, states, round trips, sizes), its cells wrap instead of being cut, and a name of up to
``NAME_CHARS`` characters is never wrapped. ``wide=True`` (``status --wide``, ``plan --wide``) adds
what needs more room: ids, addresses, paths, ports and byte counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..units import GIB, MIB, devices_line, format_gib

NAME_CHARS = 12  # a node name this long always shows whole in 80 columns
STATE_STYLES = {"ready": "green", "loading": "yellow", "unavailable": "red", "connected": "green",
                "degraded": "yellow", "lost": "red"}
HERE = " (here)"  # after this node's name, where a table lists several nodes


def _table(*columns: str, title: str | None = None, caption: str | None = None) -> Table:
    """A table in the compact style of every view: a rule under the header, no borders, two spaces
    between columns; a cell too long for its column wraps (or folds), never ends in "…"."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), title=title,
                  title_justify="left", title_style="bold", caption=caption, caption_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _add_row(table: Table, *cells: str | Text) -> None:
    """A row of plain text: names and addresses come from other machines, and "[fd00::2]:47470" is no markup."""
    table.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in cells))


def _whole(table: Table, *indexes: int) -> None:
    """These columns (names, ids, addresses) are read whole: never wrapped, however narrow the terminal."""
    for index in indexes:
        table.columns[index].no_wrap = True


def _styled(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def _short(node_id: str) -> str:
    """The 8-character form of a 64-hex node id, as `status` and the logs show ids."""
    return node_id[:8]


# --- plan --------------------------------------------------------------------------------


def plan_table(plan: dict[str, Any], title: str = "Plan", *, wide: bool = False) -> Table:
    """node (and device), layers, weights, KV cache, needs, free (GiB): seed 001's startup summary; then the
    model tiers.
    The title names the K/V cache types the KV column assumes.

    ``wide`` adds each node's id."""
    model = f"{plan.get('model_name') or plan['model']}, " if plan.get("model") else ""
    kv_cache = f", KV cache {plan['kv_cache_type']}" if plan.get("kv_cache_type") else ""
    refused = [f"{node['name']} refused: {node['detail']}." for node in plan.get("refused", [])]
    projector_bytes = plan.get("projector_bytes") or 0
    size = f"{format_gib(projector_bytes)} GiB" if projector_bytes >= GIB else f"{projector_bytes / MIB:.1f} MiB"
    projector = (f"Image projector (--mmproj): {size} on the serving node's CPU, beside its layers."
                 if projector_bytes else None)
    # Speeds once measured (every device of a plan by speed, or with --plan-by memory).
    speeds = any(node.get("decode_bytes_per_s") or node.get("speed_settled") is False for node in plan["nodes"])
    unsettled = speeds and any(node.get("speed_settled") is False
                               for node in (*plan["nodes"], *plan.get("left_out", [])))
    headers = ["node", *(["id"] if wide else []), "layers", "weights GiB", "KV GiB", "needs GiB", "free GiB",
               *(["speed GiB/s", "ms/token"] if speeds else [])]
    caption = "\n".join(filter(None, [_speed_caption(plan), UNSETTLED_NOTE if unsettled else None,
                                      _tiers_caption(plan), projector, *refused]))
    table = _table(*headers, title=f"{title}: {model}{plan['n_layers']} layers{kv_cache}", caption=caption or None)
    _whole(table, 0)
    for column in table.columns[-6 if speeds else -4:]:
        column.justify = "right"

    def row(node: dict[str, Any], layers: str, *sizes: str) -> None:
        where = f"{node['name']} ({node['device']})" if node.get("device") else node["name"]
        speed = node.get("decode_bytes_per_s") or 0
        mark = "?" if node.get("speed_settled") is False else ""
        cells = [*sizes[:4], *([f"{speed / GIB:.1f}{mark}" if speed else mark or "-", sizes[4]] if speeds else [])]
        _add_row(table, where, *([_short(node["id"])] if wide else []), layers, *cells)

    for node in plan["nodes"]:
        start, end = node["layers"]
        output = " + output" if node.get("output_bytes") else ""
        token_ms = node.get("token_ms")
        row(node, f"[{start}, {end}){output}", format_gib(node["weights_bytes"]), format_gib(node["kv_bytes"]),
            format_gib(node["needed_bytes"]), format_gib(node["free_bytes"]),
            "-" if token_ms is None else f"{token_ms:.2f}")
    left_out = "left out (too small, or no faster)" if plan.get("by") == "speed" else "left out (too small)"
    for node in plan.get("left_out", []):
        row(node, left_out, "-", "-", "-", format_gib(node["free_bytes"]), "-")
    for node in plan.get("refused", []):
        row(node, f"refused: {node['reason']}", "-", "-", "-", format_gib(node["free_bytes"]), "-")
    return table


UNSETTLED_NOTE = ("?: one measurement of that device so far, uncertain until confirmed by traffic or a second "
                  "measurement (its node measures again while idle); plans weigh no device below another on it.")


def _speed_caption(plan: dict[str, Any]) -> str | None:
    """What the plan is expected to decode at, and against the memory plan when planned by speed."""
    expected = plan.get("expected_tokens_per_s")
    if not expected:
        return None
    if plan.get("by") == "speed":
        return (f"Planned by speed: expected {expected:g} tok/s "
                f"(by memory: {plan.get('memory_plan_tokens_per_s') or '?'} tok/s).")
    return f"Planned by memory: expected {expected:g} tok/s."


def assignment_table(plan: dict[str, Any], *, wide: bool = False) -> Table | None:
    """The plan's "assignment": each member of the mesh and why it is where it is; None without one."""
    assignment = plan.get("assignment")
    if not assignment:
        return None
    names = {member["id"]: member["name"] for member in assignment}
    names.update((node["id"], node["name"]) for node in plan.get("nodes", []))
    table = _table("member", *(["id", "serves with"] if wide else []), "why", title="Members")
    _whole(table, 0)
    for member in assignment:
        with_id = member.get("serves_with")
        extra = [_short(member["id"]), "-" if not with_id else names.get(with_id, _short(with_id))] if wide else []
        _add_row(table, member["name"], *extra, member.get("why") or "-")
    return table


def plan_view(plan: dict[str, Any], title: str = "Plan", *, wide: bool = False) -> RenderableType:
    """The plan table and, when the plan says, why each member is where it is."""
    table = plan_table(plan, title, wide=wide)
    members = assignment_table(plan, wide=wide)
    return table if members is None else Group(table, members)


def _tiers_caption(plan: dict[str, Any]) -> str | None:
    """With several --model tiers: what each needs, and a tier that does not fit against what the members
    it was weighed over offer (every worker this node could use, tiers.tier_claim)."""
    tiers = plan.get("tiers", [])
    if len(tiers) < 2:
        return None
    listed = "; ".join(f"{tier['model']} needs {format_gib(tier['needs_bytes'])} GiB"
                       + ("" if tier["fits"] else f" (does not fit in the {format_gib(tier['offered_bytes'])} GiB "
                                                  "offered)") for tier in tiers)
    return f"Tiers, largest first: {listed}."


# --- status ------------------------------------------------------------------------------


def status_view(snapshot: dict[str, Any], *, wide: bool = False) -> Group:
    """`mesh-inference status`: this node, its API, the models in the mesh, its plan, processes and peers."""
    node = snapshot["node"]
    parts: list[RenderableType] = [Text(f"{node['name']} {node['short_id']}  home {node['home']}", style="bold")]
    if wide:
        parts.append(Text(f"id: {node['id']}"))
    held = snapshot["model"]["path"] or "none held (a worker: the serving node sends the layers it plans here)"
    if name := snapshot["model"].get("name"):
        held = f"{name} ({held})"
    parts.append(Text(f"model: {held} (context {snapshot['model']['ctx_size']})"))
    if node["capacity"]:
        parts.append(Text(f"offers: {format_gib(node['capacity']['usable_bytes'])} GiB"))
    if node.get("devices"):
        parts.append(Text(f"devices ({node['backend']}): {devices_line(node['devices'])}"))
    if node.get("llama_build"):
        parts.append(Text(f"llama.cpp: {node['llama_build']}"))
    serving = snapshot["serving"]
    parts.append(Text(api_line(snapshot.get("api") or (serving or {}).get("api"), (serving or {}).get("counters"))))
    if snapshot.get("models") is not None:
        parts.append(models_table(snapshot["models"], wide=wide))
    if serving:
        if serving["plan"]:
            parts.append(plan_view(serving["plan"], title="Current plan", wide=wide))
        elif serving["refusal"]:
            parts.append(Text(f"Not serving: {serving['refusal']}", style="bold red"))
        if step_up := serving.get("step_up"):
            parts.append(Text(f"stepping up to {step_up['model']} in {step_up['in_s']:.0f} s if it keeps fitting"))
        if serving.get("speculation"):
            parts.append(Text(f"speculation: {serving['speculation']['reason']}"))
    parts.append(processes_table(snapshot["processes"], wide=wide))
    connected = sum(p["state"] == "connected" for p in snapshot["peers"])
    mesh = snapshot["mesh"]
    data_port = mesh.get("data_port")
    ports = f"UDP port {mesh['quic_port']}" + (f", TCP port {data_port} (data path)" if data_port else "")
    parts.append(Text(f"Mesh: {connected} peer(s) connected, {ports}, secret rotated "
                      f"{mesh.get('secret_epoch', 0)} time(s)"))
    if data_port and (quic_only := quic_only_peers(snapshot["peers"])):
        parts.append(Text(f"{', '.join(quic_only)}: reached over QUIC only, although both sides run the native "
                          f"data path: a firewall likely closes TCP (port {data_port} here, the peer's own there). "
                          "Open the mesh's port for TCP as well as UDP on both machines (docs/quickstart.md, "
                          "'Open the firewall'); the layers' round trip is about 20x over QUIC.", style="yellow"))
    lan = mesh.get("lan")
    if lan is None:
        parts.append(Text("LAN discovery (mDNS): off"))
    else:
        others = {r["mesh_id"] for r in lan if not r["this_mesh"]}
        parts.append(Text(f"LAN discovery (mDNS): on; {sum(r['this_mesh'] for r in lan)} member(s) and "
                          f"{len(others)} other mesh(es) seen (`mesh-inference --lan` lists them)"))
    if snapshot["peers"]:
        parts.append(peers_table(snapshot, wide=wide))
        parts.extend(Text(f"{peer['name']}: {peer['refused']}: {peer['refused_detail']}.", style="bold red")
                     for peer in snapshot["peers"] if peer.get("refused"))
    return Group(*parts)


def quic_only_peers(peers: list[dict[str, Any]]) -> list[str]:
    """The connected peers reached directly that run a data relay, whose RPC still goes over QUIC."""
    return [peer["name"] for peer in peers if peer["state"] == "connected" and peer.get("path") == "direct"
            and peer.get("data_port") and peer.get("data_path") == "quic"]


def api_line(api: dict[str, Any] | None, counters: dict[str, Any] | None) -> str:
    """Where this node's API is (or that it is off), and the serving counters."""
    if not api or api.get("enabled") is False:
        line = "API off (started with --no-api)" if api else "API off"
    else:
        notes = []
        if api.get("fallback_from"):
            notes.append(f"port {api['fallback_from']} was taken")
        if api.get("requires_key"):
            notes.append("needs the API key")
        line = f"API: {api['url']}" + (f" ({'; '.join(notes)})" if notes else "")
    if counters:
        line += (f"  requests {counters['requests']:.0f}, failovers {counters['failovers']:.0f}, "
                 f"retries {counters['retries']:.0f}, restarts {counters['restarts']:.0f}")
    return line


def models_table(models: list[dict[str, Any]], *, wide: bool = False) -> RenderableType:
    """The models in the mesh, a row per node serving one (a replica): its state, the members of its plan
    and the requests it has in flight."""
    if not models:
        return Text("Models in the mesh: none served now (a node serves one with --serve PORT).")
    default = next((model["id"] for model in models if model.get("default")), None)
    table = _table("model", "state", "served by", "plan members", "in flight", title="Models in the mesh",
                   caption=f"Requests naming no model go to {default}." if default and len(models) > 1 else None)
    _whole(table, 0)
    table.columns[-1].justify = "right"
    for model in models:
        replicas = model.get("replicas") or []
        if not replicas:
            _add_row(table, model["id"], _styled(model["state"]), "-", "-", "-")
        for index, replica in enumerate(replicas):
            node = replica["node"]
            served_by = node["name"] + (HERE if replica.get("local") else "")
            if wide:
                served_by += f" {_short(node['id'])}"
            members = ", ".join(member["name"] for member in replica.get("members", [])) or "-"
            name = model["id"] + (" (images)" if model.get("vision") else "") if index == 0 else ""
            _add_row(table, name, _styled(replica.get("state", model["state"])), served_by, members,
                     str(replica.get("in_flight", 0)))
    return table


def processes_table(processes: list[dict[str, Any]], *, wide: bool = False) -> Table:
    """This node's children: pid, state, port and log file (its full path with ``wide``)."""
    table = _table("process", "pid", "state", "port", "log")
    for p in processes:
        log = p["log"] if wide else PurePath(p["log"]).name
        _add_row(table, p["name"], str(p["pid"]), "running" if p["running"] else "exited", str(p["port"]), log)
    return table


def peers_table(snapshot: dict[str, Any], *, wide: bool = False) -> Table:
    """One row per peer: name, state, round trip, memory offered and role; ``wide`` adds id, address and path,
    round-trip percentiles, datagram size, tunnel port, whether its rpc-server is up, its devices and the
    bytes moved."""
    roles = _roles(snapshot)
    if wide:
        table = _table("peer", "id", "address", "path", "state", "rtt ms (p50/p95)", "datagram B", "tunnel",
                       "rpc", "offers GiB", "devices", "MiB to/from", "role")
        _whole(table, 0, 1, 2)
    else:
        table = _table("peer", "state", "RTT", "memory", "role")
        _whole(table, 0, 1)
    for peer in snapshot["peers"]:
        offers = peer["capacity"].get("usable_bytes")
        role = roles.get(peer["id"], "-")
        if not wide:
            rtt = "-" if peer["rtt_ms"] is None else f"{peer['rtt_ms']:.1f} ms"
            _add_row(table, peer["name"], _styled(_peer_state(peer)), rtt,
                     "-" if offers is None else f"{format_gib(offers)} GiB", role)
            continue
        rtt = "-" if peer["rtt_ms"] is None else f"{peer['rtt_ms']:.1f}"
        if peer.get("rtt_p50_ms") is not None:
            rtt += f" ({peer['rtt_p50_ms']:.1f}/{peer['rtt_p95_ms']:.1f})"
        path = peer.get("data_path") or (peer.get("path") or "-") + (f" via {peer['via']}" if peer.get("via") else "")
        _add_row(table, peer["name"], peer["short_id"], str(peer["address"] or "-"), path,
                 _styled(_peer_state(peer)), rtt,
                 str(peer.get("datagram_bytes") or "-"),
                 str(peer["tunnel_port"] or "-"), "up" if peer["rpc_server_up"] else "down",
                 "-" if offers is None else format_gib(offers),
                 ", ".join(d["name"] for d in peer.get("devices") or ()) or "-",
                 f"{peer['bytes_to_peer'] / MIB:.1f}/{peer['bytes_from_peer'] / MIB:.1f}", role)
    return table


def _peer_state(peer: dict[str, Any]) -> str:
    """One word: the membership state, or "degraded" for a connected peer whose heartbeats falter."""
    if peer.get("refused"):
        return "refused"
    if peer["state"] == "connected" and peer.get("health") == "degraded":
        return "degraded"
    return str(peer["state"])


def _roles(snapshot: dict[str, Any]) -> dict[str, str]:
    """What each peer does, by id: serves a model, works in someone's plan, refused or (absent) nothing."""
    roles: dict[str, list[str]] = {}

    def add(node_id: str, role: str) -> None:
        if role not in roles.setdefault(node_id, []):
            roles[node_id].append(role)

    plan = (snapshot.get("serving") or {}).get("plan") or {}
    # This node's plan says which layers each of its members holds.
    layers = {node["id"]: f"layers {node['layers'][0]}-{node['layers'][1]}" for node in plan.get("nodes", [])}
    here = snapshot["node"]["name"]
    for model in snapshot.get("models") or []:
        for replica in model.get("replicas") or []:
            server = replica["node"]
            add(server["id"], f"serves {model['id']}")
            for member in replica.get("members", []):
                if member["id"] != server["id"] and not (replica.get("local") and member["id"] in layers):
                    add(member["id"], f"works for {server['name']}")
    for node_id, held in layers.items():
        add(node_id, f"{held} for {here}")
    for peer in snapshot["peers"]:
        if peer.get("refused"):
            add(peer["id"], f"refused: {peer['refused']}")
        elif peer.get("serving") and not _serves_any(roles.get(peer["id"], ())):
            add(peer["id"], "serving")
    return {node_id: ", ".join(listed) for node_id, listed in roles.items()}


def _serves_any(roles: Iterable[str]) -> bool:
    return any(role.startswith("serves ") for role in roles)
