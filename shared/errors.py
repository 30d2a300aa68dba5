"""Exception types shared by every specring process.

The name of each exception says whether the caller may retry:

* ``ConfigError`` (a ``ValueError``): bad configuration or flag; fix the input, do not retry.
* ``MessageError`` (a ``ValueError``): a control message that cannot be decoded or is not of a known
  kind/version; the receiver logs it and carries on, it never kills a loop.
* ``PayloadTooLarge`` (a ``ValueError``): tensors that do not fit in a slot; raise the slot size.
* ``ShmSpaceError`` (an ``OSError``): ``/dev/shm`` has less free space than the rings need.
* ``SlotError``: a slot header that does not match the control message that names it (stale
  generation, wrong batch id, unpublished slot).
* ``PeerTimeout``: waiting for a peer's answer ran past its deadline; the message names the duration and
  the peer.
* ``BadBatch``: a batch whose data cannot be trained on (non-finite hidden states, bad token ids).
* ``CorruptFile`` (a ``ValueError``): a file that is not what its name says (an empty, truncated or garbage
  safetensors, trainer state or JSON file); the message names the file. Restore or replace the file.
"""

from __future__ import annotations


class SpecringError(Exception):
    """Base class of every specring-specific error."""


class ConfigError(SpecringError, ValueError):
    """Invalid configuration; the message names the field or flag.

    ``key``: the configuration key at fault when one is (``"ring.slot_bytes"``, or a bare field name
    before the section is known), so that a front end can name the flag or file the value came from;
    ``detail``: the message without the key.
    """

    def __init__(self, message: str, *, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key = key
        self.detail = message if detail is None else detail


class MessageError(SpecringError, ValueError):
    """A control message that is malformed, of an unknown kind, or of an unknown schema version."""


class PayloadTooLarge(SpecringError, ValueError):
    """The tensors to write do not fit in a slot; the message gives both sizes in bytes."""


class ShmSpaceError(SpecringError, OSError):
    """Not enough free space in /dev/shm for the requested segments."""


class SlotError(SpecringError):
    """A slot's header disagrees with the message that names it."""


class PeerTimeout(SpecringError, TimeoutError):
    """Waiting for a peer's message ran past its deadline."""


class BadBatch(SpecringError):
    """A batch's data must not be trained on (non-finite values, out-of-range ids)."""


class CorruptFile(SpecringError, ValueError):
    """A file that cannot be read as what it should be (empty, truncated, garbage); the message names it.

    ``path``: the file."""

    def __init__(self, message: str, *, path: str = ""):
        super().__init__(message)
        self.path = path
