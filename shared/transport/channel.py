"""ZeroMQ control channel: the coordinator's ROUTER and the children's DEALER sockets.

Every socket is created with ``LINGER`` set (so ``close()`` never hangs on a vanished peer), bounded
high-water marks, and ``ROUTER_MANDATORY`` on the router (sending to a peer that is gone raises instead of
silently dropping, and the coordinator logs and carries on). Frames are ``shared.transport.messages`` encodings;
a frame that does not decode is returned as a ``MessageError`` to the caller, who logs it — one bad frame
never stops a loop.

Sends on the router never block: each peer has its own queue of at most ``ROUTER_SNDHWM`` messages, and a
send to a peer whose queue is full (it does not read) raises ``zmq.Again`` at once, so no peer can stall
the coordinator's loop or its signal handling; the caller decides what a failed send means (the coordinator
records a lease or delivery only once its send has succeeded).

Addresses: ``ipc://<run_dir>/coord.sock`` by default (the run directory is mode 0700; for a run directory too deep
for an ipc socket's path, a socket in the user's private 0700 directory, ``RunDir.socket_file``), or
``tcp://127.0.0.1:<port>`` when asked for.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import zmq

from specring.shared.errors import MessageError, PeerTimeout
from specring.shared.paths import IPC_PATH_MAX
from specring.shared.transport import messages

log = logging.getLogger(__name__)

LINGER_MS = 500
HWM = 10000
ROUTER_SNDHWM = 1000  # messages queued to one peer of the router; a child legitimately has a handful


def coordinator_address(socket_file: str | os.PathLike, tcp: str = "") -> str:
    """The coordinator's endpoint for a run: ``tcp`` when given, else ``ipc://`` of ``socket_file`` made absolute
    (the run directory's ``RunDir.socket_file``; ``RunDir.coordinator_address`` is the call). Raises ``ValueError``
    when that path is too long for an ipc socket."""
    if tcp:
        return tcp
    path = os.path.abspath(socket_file)
    if len(path) > IPC_PATH_MAX:
        raise ValueError(f"the coordinator's socket path is too long for an ipc socket ({len(path)} chars, at most "
                         f"{IPC_PATH_MAX}): {path}; use a shorter TMPDIR or --run-dir, or --tcp")
    return "ipc://" + path


def bind_router(ctx: zmq.Context, address: str) -> zmq.Socket:
    """Bind the coordinator's ROUTER socket to ``address``. Raises ``zmq.ZMQError`` naming the address."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES + 1024)
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(0)
        raise zmq.ZMQError(e.errno, f"cannot bind coordinator socket {address}: {e}") from None
    if address.startswith("ipc://"):
        os.chmod(address[len("ipc://"):], 0o600)
    return sock


def connect_dealer(ctx: zmq.Context, address: str, identity: str) -> zmq.Socket:
    """Connect a child's DEALER socket with routing identity ``identity`` (e.g. ``"producer-0"``)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: Any, to: bytes | None = None, block: bool = True) -> None:
    """Send one message.

    On a ROUTER, ``to`` is the peer identity and the send never blocks: ``zmq.Again`` when that peer's queue
    is full (it is not reading), ``zmq.ZMQError`` (EHOSTUNREACH) when no such peer is connected. On a
    DEALER it blocks while the queue is full unless ``block`` is False (then ``zmq.Again``).
    """
    data = messages.encode(msg)
    if to is None:
        sock.send(data, flags=0 if block else zmq.NOBLOCK, copy=True)
    else:
        sock.send_multipart([to, data], flags=zmq.NOBLOCK, copy=True)


def recv(sock: zmq.Socket, timeout_s: float | None) -> Any:
    """Receive one message from a DEALER (``None`` when ``timeout_s`` passes with nothing).

    A frame that does not decode is returned as a ``MessageError`` instance (not raised).
    """
    if timeout_s is not None and not sock.poll(int(timeout_s * 1000)):
        return None
    data = sock.recv()
    try:
        return messages.decode(data)
    except MessageError as e:
        return e


def recv_from(sock: zmq.Socket, timeout_s: float | None) -> tuple[bytes, Any] | None:
    """Receive ``(peer identity, message)`` from a ROUTER; ``None`` on timeout.

    A bad frame (undecodable, or not exactly one payload frame) comes back as a ``MessageError`` instance.
    """
    if timeout_s is not None and not sock.poll(int(timeout_s * 1000)):
        return None
    frames = sock.recv_multipart()
    peer = frames[0]
    if len(frames) != 2:
        return peer, MessageError(f"expected 1 payload frame from {peer!r}, got {len(frames) - 1}")
    try:
        return peer, messages.decode(frames[1])
    except MessageError as e:
        return peer, e


def request(address: str, msg: Any, timeout_s: float = 5.0) -> Any:
    """One-shot request/answer with the coordinator (used by ``launch.py status``/``restart``).

    Raises ``PeerTimeout`` naming the address and duration if no answer comes.
    """
    ctx = zmq.Context.instance()
    # random, not the pid: CLIs in other PID namespaces (containers) have the same pids, and a ROUTER ignores
    # a second peer with an identity it already has
    sock = connect_dealer(ctx, address, f"cli-{secrets.token_hex(8)}")
    try:
        send(sock, msg)
        reply = recv(sock, timeout_s)
        if reply is None:
            raise PeerTimeout(f"no answer from the coordinator at {address} within {timeout_s:.1f} s "
                              f"(is the run still going?)")
        if isinstance(reply, MessageError):
            raise reply
        return reply
    finally:
        sock.close(0)
