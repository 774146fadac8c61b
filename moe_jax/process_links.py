"""The TCP links between the processes of an expert-parallel generation run: a socket between every two processes
for the steps' sums over processes (host_kernels/csrc/xla_process_sum.c), and one from process 0 to each other
process for its orders (generation/lockstep.py). Each process publishes where it listens through JAX's distributed
key-value store; a later process connects to each earlier one.

How it works and why: docs/INTERNALS.md, moe_jax/process_links.py.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
import socket
import struct
from dataclasses import dataclass, field

import numpy as np

from moe_jax import distributed
from moe_jax.distributed import HEARTBEAT_TIMEOUT_S, START_TIMEOUT_S, PeerFailed, World
from moe_jax.planning import environment

SUM, ORDERS = 0, 1  # what a connection carries: the steps' sums, or process 0's orders
_HELLO = struct.Struct("<ii16s")  # (the connecting process, SUM or ORDERS, the run's token)
_HEADER = struct.Struct("<QQ")  # the Python sum's (call, bytes), as the native handler's
_python_sums = 0  # python_sum's calls in this process
_connections = itertools.count()  # each connect() of a process: its keys in the store apart from earlier ones'


@dataclass
class Links:
    """This process's links: `sums[p]` to process p (None for itself), `orders[p]` from process 0 to p (on process
    0; on the others `orders[0]` only)."""

    world: World
    sums: list[socket.socket | None]
    orders: dict[int, socket.socket] = field(default_factory=dict)
    native: bool = False  # handed to the native handler (else the Python sum reads them)
    calls: int = 0  # the Python sum's calls

    def close(self):
        if self.native:
            _library().moe_jax_process_links_clear()
        for s in [*self.sums, *self.orders.values()]:
            if s is not None:
                s.close()


def connect(world: World) -> Links:
    """Connects this process to every other of the run (call it on all of them, at the same point)."""
    n = next(_connections)
    host = _reachable_address()
    listener = socket.create_server((host, 0), backlog=2 * world.count)
    listener.settimeout(START_TIMEOUT_S)
    # only the run's processes know the token (from the coordinator's store): a stranger connecting is turned away
    if world.is_main:
        _store_set(f"moe_jax/links/{n}/token", secrets.token_hex(16))
    token = bytes.fromhex(_store_get(f"moe_jax/links/{n}/token"))
    _store_set(f"moe_jax/links/{n}/{world.index}", f"{host}:{listener.getsockname()[1]}")
    sums: list[socket.socket | None] = [None] * world.count
    orders: dict[int, socket.socket] = {}
    try:
        for peer in range(world.index):  # earlier processes listen for this one
            address = _store_get(f"moe_jax/links/{n}/{peer}")
            sums[peer] = _dial(address, _HELLO.pack(world.index, SUM, token))
            if peer == 0:
                orders[0] = _dial(address, _HELLO.pack(world.index, ORDERS, token))
        expected = world.count - 1 - world.index + (world.count - 1 if world.is_main else 0)
        while expected:
            connection, _ = listener.accept()
            connection.settimeout(START_TIMEOUT_S)
            try:
                peer, kind, given = _HELLO.unpack(_read(connection, _HELLO.size, "the run's start"))
            except PeerFailed:
                given = None
            if (
                given != token
                or not world.index < peer < world.count
                or kind not in ((SUM, ORDERS) if world.is_main else (SUM,))
            ):
                connection.close()  # not one of the run's processes
                continue
            expected -= 1
            connection.settimeout(None)
            _tune(connection)
            (orders if kind == ORDERS else sums)[peer] = connection  # type: ignore[index]
    except TimeoutError:
        raise PeerFailed(
            f"{world.describe()}: the other processes did not connect within {START_TIMEOUT_S} s"
        ) from None
    finally:
        listener.close()
    links = Links(world, sums, orders)
    if _library() is not None:
        fds = (ctypes.c_int * world.count)(*[-1 if s is None else s.fileno() for s in sums])
        if _library().moe_jax_process_links_set(world.index, world.count, fds, HEARTBEAT_TIMEOUT_S * 1000):
            raise PeerFailed(f"{world.describe()}: the native sum refused the links")
        links.native = True
    return links


def sums_made() -> int:
    """The sums over processes this process has made (the native handler's count; every process makes the same)."""
    library = _library()
    return int(library.moe_jax_process_links_calls()) if library is not None else _python_sums


def bytes_sent() -> tuple[int, int]:
    """(the bytes this process sent for its sums over processes, those it would have sent had every row gone to
    every process) since its links were connected; (0, 0) without the native handler."""
    library = _library()
    if library is None:
        return 0, 0
    return int(library.moe_jax_process_links_bytes_sent()), int(library.moe_jax_process_links_dense_bytes())


def python_sum(links: Links, mine: np.ndarray) -> np.ndarray:
    """The sum over processes of `mine` as the native handler computes it (the same bits: float32, in process
    order), on blocking sockets: where the native library is not built."""
    world, payload = links.world, np.ascontiguousarray(mine)
    header = _HEADER.pack(links.calls, payload.nbytes)
    theirs: dict[int, np.ndarray] = {}
    # a link's two ends both send first: the lower process sends then reads, the higher reads then sends
    for peer, s in enumerate(links.sums):
        if s is None:
            continue
        where = f"process {peer} of {world.count}"
        if world.index < peer:
            _send(s, header + payload.tobytes(), where)
            theirs[peer] = _receive(s, where, links, payload)
        else:
            theirs[peer] = _receive(s, where, links, payload)
            _send(s, header + payload.tobytes(), where)
    links.calls += 1
    global _python_sums
    _python_sums += 1
    total = None
    for p in range(world.count):
        part = (payload if p == world.index else theirs[p]).astype(np.float32)
        total = part if total is None else total + part
    return total.astype(mine.dtype)


def _send(s: socket.socket, data: bytes, where: str):
    try:
        s.sendall(data)
    except OSError as e:
        raise PeerFailed(f"{where}: the link closed ({e}: the process has stopped, see its output)") from None


def _receive(s: socket.socket, where: str, links: Links, like: np.ndarray) -> np.ndarray:
    call, size = _HEADER.unpack(_read(s, _HEADER.size, where))
    if call != links.calls or size != like.nbytes:
        raise PeerFailed(f"{where} is out of step: its call {call} of {size} bytes, ours {links.calls}")
    return np.frombuffer(_read(s, size, where), like.dtype).reshape(like.shape)


def _read(s: socket.socket, size: int, where: str) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = s.recv(size - len(data))
        if not chunk:
            raise PeerFailed(f"{where}: the link closed (the process has stopped: see its output)")
        data += chunk
    return bytes(data)


def _dial(address: str, hello: bytes) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=START_TIMEOUT_S)
    s.sendall(hello)
    s.settimeout(None)
    _tune(s)
    return s


def _tune(s: socket.socket):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a decode step's sums are a few kB: no batching


def _reachable_address() -> str:
    """This host's address on the route to the coordinator (127.0.0.1 where that runs here)."""
    coordinator = environment.distributed().get(environment.COORDINATOR) or _jax_coordinator()
    host = coordinator.rsplit(":", 1)[0] if coordinator else "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent: it only picks a route
        probe.connect((host, 1))
        return probe.getsockname()[0]


def _jax_coordinator() -> str | None:
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.coordinator_address


def _store_set(key: str, value: str):
    from jax._src import distributed as jax_distributed

    jax_distributed.global_state.client.key_value_set(key, value)


def _store_get(key: str) -> str:
    from jax._src import distributed as jax_distributed

    try:
        return jax_distributed.global_state.client.blocking_key_value_get(key, START_TIMEOUT_S * 1000)
    except Exception as e:  # the runtime's deadline error
        raise PeerFailed(f"{distributed.world().describe()}: no address for {key} ({e})") from e


def _library():
    """The native library with the links' functions, or None."""
    from host_kernels import xla_ffi_library

    library, _ = xla_ffi_library(("moe_jax_process_sum",))
    if library is not None:
        library.moe_jax_process_links_set.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        for name in ("calls", "bytes_sent", "dense_bytes"):
            getattr(library, f"moe_jax_process_links_{name}").restype = ctypes.c_uint64
    return library
