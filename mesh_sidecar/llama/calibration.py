"""How fast each device of this node's rpc-server is: measured once, right after it starts.

The planner gives layers to fast devices first, so every member announces, per device, the rate at
which it reads quantized weights for one token (decode) and per token of a prompt batch (prefill).
The node asks its own rpc-server before anyone else connects (it serves one client at a time);
wire/rpc_calibration.py draws the buffer, the graph and the commands.

Per device, on one connection (a failure there closes it: rpc-server then frees the buffer): HELLO,
GET_ALIGNMENT, ALLOC_BUFFER, BUFFER_GET_BASE, BUFFER_CLEAR; then for decode and for prefill:

1. GRAPH_COMPUTE of one pass (warms the device up), then one timed GRAPH_RECOMPUTE (:func:`passes_for`
   sizes the graph from it, so that a sample lasts about SAMPLE_TARGET_S whatever the device);
2. GRAPH_COMPUTE of that many passes, then timed GRAPH_RECOMPUTEs until :func:`settled`;
3. the rate: every sample's bytes over every sample's time (a mean, not the best sample: a CPU under a
   CFS quota runs at full speed in bursts, and only time spanning several periods shows its pace).

A device takes 0.6 to 1 s on 2 CPU cores, 1.6 s at a quarter core; the samples take at most
MAX_MEASURE_S per kind (and one sample more), everything at most DEVICE_TIMEOUT_S. Any failure
(timeout, a closed connection, an answer we cannot read) is logged and leaves that device
unmeasured (None): never an error of the node's. If rpc-server aborts on the graph (a backend that
cannot run it), the node starts it again, unmeasured (node/lifecycle.py).

One calibration is one sample of the machine as it was for a second: another program hashing a
model on the same cores, or a CPU quota for a while, made two identical members measure 2.7 and
14.7 GiB/s. Noise only ever slows a measurement, so :class:`SpeedRecord` keeps a device's last
KEPT_CALIBRATIONS calibrations, taken at different times while its rpc-server has no client (the
machine idle for it), and rates the device at the best of them; the speed is *settled* once two of
them agree within AGREE_RATIO. Until then the node measures again after RECHECK_S, doubling the wait
each time, and every IDLE_RECHECK_S once settled (so a device that became slower for good is rated
so within a few rechecks). An unsettled speed is announced as such, and planning never weighs a
device below another on it (serve/speeds.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ProtocolVersionError, WireError
from ..ports import LOOPBACK
from ..wire.gossip import MAX_BYTES_PER_S
from ..wire.rpc_calibration import (
    ALIGNMENT_REPLY_BYTES,
    ALLOC_BUFFER_REPLY_BYTES,
    BUFFER_BASE_REPLY_BYTES,
    CALIBRATION_RPC_MAJOR,
    DECODE_COLUMNS,
    MAX_PASSES,
    PREFILL_COLUMNS,
    WEIGHT_BYTES,
    BufferLayout,
    RemoteBuffer,
    alloc_buffer_request,
    buffer_clear_request,
    buffer_get_base_request,
    decode_alignment,
    decode_alloc_buffer,
    decode_buffer_base,
    free_buffer_request,
    get_alignment_request,
    graph_compute_request,
    graph_recompute_request,
    reply_size,
)
from ..wire.rpc_framing import REPLY_SIZE_BYTES
from ..wire.rpc_hello import HELLO_REQUEST, decode_hello_reply, hello_reply_size

log = logging.getLogger(__name__)

SAMPLE_TARGET_S = 0.02  # one timed sample: long against a loopback round trip (tens of microseconds)
MIN_SAMPLES = 3
MIN_MEASURE_S = 0.2  # per kind: two CFS periods (100 ms) at least
MAX_MEASURE_S = 0.6  # per kind: then the samples so far decide
STABLE_SPREAD = 0.1  # settled once the median sample is within this share of the mean
DEVICE_TIMEOUT_S = 4.0  # everything on one device, connecting included
TOTAL_TIMEOUT_S = 10.0  # every device; those not reached by then are unmeasured
# Two calibrations agree when the faster is within this factor of the slower (a busy 2-core machine moves one by
# tens of percent; the load that misled the members, 5x).
AGREE_RATIO = 1.25
KEPT_CALIBRATIONS = 4  # a device's latest calibrations, the best of which rates it
RECHECK_S = 5.0  # after a calibration that left the speed unsettled: the next, the wait doubling each time
IDLE_RECHECK_S = 600.0  # after a settled one: the longest wait between two calibrations
TCP_ESTABLISHED = "01"  # a connection's state in /proc/net/tcp


@dataclass(frozen=True, slots=True)
class DeviceSpeed:
    """How fast a device reads quantized weights, as the calibration measured it."""

    decode_bytes_per_s: int
    """Weight bytes per second through one token's matrix-vector products."""
    prefill_bytes_per_s: int
    """Weight bytes per second per prompt token, in a batch of PREFILL_COLUMNS tokens."""


@dataclass
class SpeedRecord:
    """One device's latest calibrations: it is as fast as the best of them, settled once two of them agree."""

    taken: list[DeviceSpeed] = dataclasses.field(default_factory=list)  # oldest first

    def add(self, speed: DeviceSpeed) -> None:
        self.taken = [*self.taken, speed][-KEPT_CALIBRATIONS:]

    def best(self) -> DeviceSpeed | None:
        """The fastest calibration kept (by decode speed, what plans weigh); None before any."""
        return max(self.taken, key=lambda speed: speed.decode_bytes_per_s, default=None)

    def settled(self) -> bool:
        """Whether two calibrations kept agree with the best (within AGREE_RATIO): one sample rates nothing."""
        best = self.best()
        return best is not None and sum(
            speed.decode_bytes_per_s * AGREE_RATIO >= best.decode_bytes_per_s for speed in self.taken) >= 2

    def recheck_after_s(self) -> float:
        """How long after the last calibration to measure again (when the rpc-server has no client then)."""
        if self.settled():
            return IDLE_RECHECK_S
        return min(IDLE_RECHECK_S, RECHECK_S * 2 ** max(0, len(self.taken) - 1))


def has_client(port: int, tcp_tables: Sequence[str]) -> bool:
    """Whether a connection to local TCP ``port`` is established, in the text of /proc/net/tcp and tcp6: the
    rpc-server on it serves one client at a time, so a calibration then would wait for llama-server to let go."""
    for table in tcp_tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == TCP_ESTABLISHED and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def rpc_server_has_client(port: int) -> bool:
    """Whether the rpc-server on loopback ``port`` serves a client now (on a system without /proc/net: True,
    so nothing is measured under a client)."""
    try:
        return has_client(port, [Path(f"/proc/net/{name}").read_text() for name in ("tcp", "tcp6")])
    except OSError:
        return True


def passes_for(probe_s: float) -> int:
    """Passes in one graph, so that a sample lasts about SAMPLE_TARGET_S, from one pass's round trip."""
    return max(1, min(MAX_PASSES, math.ceil(SAMPLE_TARGET_S / max(probe_s, 1e-9))))


def settled(sample_times_s: Sequence[float]) -> bool:
    """Whether the samples so far are enough: MAX_MEASURE_S spent, or MIN_MEASURE_S and MIN_SAMPLES steady ones."""
    spent_s = sum(sample_times_s)
    if spent_s >= MAX_MEASURE_S:
        return True
    if spent_s < MIN_MEASURE_S or len(sample_times_s) < MIN_SAMPLES:
        return False
    mean_s = spent_s / len(sample_times_s)
    return abs(statistics.median(sample_times_s) - mean_s) <= STABLE_SPREAD * mean_s


def rate(bytes_per_sample: int, sample_times_s: Sequence[float]) -> int:
    """Bytes per second over every sample (at most what gossip carries)."""
    return min(MAX_BYTES_PER_S, round(bytes_per_sample * len(sample_times_s) / max(sum(sample_times_s), 1e-9)))


async def calibrate_devices(port: int, device_count: int, *, device_timeout_s: float = DEVICE_TIMEOUT_S,
                            total_timeout_s: float = TOTAL_TIMEOUT_S) -> tuple[DeviceSpeed | None, ...]:
    """Each of the first ``device_count`` devices of the rpc-server on 127.0.0.1:``port`` measured, in order.

    None for a device that could not be measured (logged why). Call it while no other client is connected.
    """
    speeds: list[DeviceSpeed | None] = []
    deadline = time.monotonic() + total_timeout_s
    for device in range(device_count):
        speed = None
        try:
            async with asyncio.timeout(min(device_timeout_s, deadline - time.monotonic())):
                speed = await _calibrate(port, device)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, WireError) as exc:
            log.warning("could not measure device %d of the rpc-server on port %d: %r", device, port, exc)
        speeds.append(speed)
    return tuple(speeds)


async def measure_while_idle(port: int, records: Sequence[SpeedRecord],
                             measured: Callable[[Sequence[bool]], None]) -> None:
    """Until cancelled: calibrate the devices of the rpc-server on ``port`` again whenever their ``records`` ask
    for it (``recheck_after_s``) and it has no client then (else at the next such time), adding each speed to
    its device's record; after a calibration that changed a device's rating or whether it is settled,
    ``measured(settled_before)``, each device's ``settled()`` before it."""
    while True:
        await asyncio.sleep(min(record.recheck_after_s() for record in records))
        if rpc_server_has_client(port):
            continue  # it serves a llama-server: a calibration would wait for it, and would not be of it idle
        before = [(record.best(), record.settled()) for record in records]
        for record, speed in zip(records, await calibrate_devices(port, len(records)), strict=True):
            if speed is not None:
                record.add(speed)
        if [(record.best(), record.settled()) for record in records] != before:
            measured([was_settled for _, was_settled in before])


async def _calibrate(port: int, device: int) -> DeviceSpeed | None:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        client = _Client(reader, writer)
        writer.write(HELLO_REQUEST)
        hello = decode_hello_reply(await reader.readexactly(hello_reply_size(
            await reader.readexactly(REPLY_SIZE_BYTES))))
        if hello.version.major != CALIBRATION_RPC_MAJOR:
            raise ProtocolVersionError(f"rpc-server speaks RPC {hello.version}; the calibration speaks "
                                       f"{CALIBRATION_RPC_MAJOR}.x")
        layout = BufferLayout(decode_alignment(await client.ask(get_alignment_request(device),
                                                                ALIGNMENT_REPLY_BYTES, "GET_ALIGNMENT")))
        buffer = decode_alloc_buffer(await client.ask(alloc_buffer_request(device, layout.size_bytes),
                                                      ALLOC_BUFFER_REPLY_BYTES, "ALLOC_BUFFER"))
        if not buffer.remote_ptr:
            log.warning("could not measure device %d of the rpc-server on port %d: no room for %d bytes",
                        device, port, layout.size_bytes)
            return None
        buffer = dataclasses.replace(buffer, base=decode_buffer_base(await client.ask(
            buffer_get_base_request(buffer.remote_ptr), BUFFER_BASE_REPLY_BYTES, "BUFFER_GET_BASE")))
        writer.write(buffer_clear_request(buffer.remote_ptr))
        decode = await client.measure(device, buffer, layout, DECODE_COLUMNS)
        prefill = await client.measure(device, buffer, layout, PREFILL_COLUMNS)
        await client.ask(free_buffer_request(buffer.remote_ptr) + get_alignment_request(device),
                         ALIGNMENT_REPLY_BYTES, "GET_ALIGNMENT")
        return DeviceSpeed(decode, prefill)
    finally:
        writer.close()


class _Client:
    """One calibration connection: a command and its reply, and the timed graph runs."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def ask(self, requests: bytes, reply_bytes: int, what: str) -> bytes:
        """Send ``requests`` (only the last of them answers) and read that answer's payload."""
        self._writer.write(requests)
        size = reply_size(await self._reader.readexactly(REPLY_SIZE_BYTES), reply_bytes, what)
        return await self._reader.readexactly(size)

    async def _timed(self, requests: bytes, device: int) -> float:
        """Seconds until the sync point behind ``requests`` answers."""
        start = time.perf_counter()
        await self.ask(requests + get_alignment_request(device), ALIGNMENT_REPLY_BYTES, "GET_ALIGNMENT")
        return time.perf_counter() - start

    async def measure(self, device: int, buffer: RemoteBuffer, layout: BufferLayout, columns: int) -> int:
        """Weight bytes per second per column (token) over graphs of ``columns`` columns."""
        await self._timed(graph_compute_request(device, buffer, layout, columns, 1), device)
        passes = passes_for(await self._timed(graph_recompute_request(device), device))
        await self._timed(graph_compute_request(device, buffer, layout, columns, passes), device)
        samples: list[float] = []
        while not settled(samples):
            samples.append(await self._timed(graph_recompute_request(device), device))
        log.info("device %d, %d column(s): %d samples of %d passes, %.3f s", device, columns, len(samples),
                 passes, sum(samples))
        return rate(passes * columns * WEIGHT_BYTES, samples)
