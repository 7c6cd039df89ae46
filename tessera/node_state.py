"""A node's persistent state: Flower's ``context.state``, mirrored to disk on request.

Within a run, Flower keeps ``context.state`` in the SuperNode's memory and hands it
to each ClientApp process; it is lost when the SuperNode (or its container, or the
device) restarts. With node-config ``state-dir`` the node also writes the state to
``<state-dir>/<federation>/node-state.pb`` after every round (protobuf, Flower's
own encoding of a :class:`~flwr.app.RecordDict`; written to a temporary file,
fsynced and renamed, so a crash leaves the previous round's file) and reloads it
when ``context.state`` comes up empty after a restart.

``<federation>`` is the id the server sends with every message (it survives a
server ``resume``), so state of one federation never leaks into another. The file
also records which federation and which node it belongs to (partition id or data
path); a state written for another federation (a file copied between folders) or
by a different node configuration is ignored with a warning.

What is read back is checked before use, and a node never fails every round
because of what it stored: a file that cannot be decoded, whose records are
malformed (an array whose bytes do not hold its declared shape and dtype, a
metadata record of the wrong types) or that belongs elsewhere is ignored with a
warning, :meth:`NodeState.fitting_arrays` forgets a stored model that no longer
fits (other names, shapes or dtypes, or NaN) with a warning, so the node starts it
afresh, and :meth:`NodeState.checked_config` forgets a config record its reader
finds malformed (a device profile lacking a key, a round count that is text) with a
warning, so the node rebuilds it (measures its device again, counts its rounds
afresh).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.common.typing import ConfigRecordValues
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from tessera.checkpoint import write_atomic
from tessera.config import ConfigError
from tessera.state_checks import SAFE_ID, dtype_name, npy_bytes_problem

log = logging.getLogger("flwr.tessera")

META = "tessera.state-meta"
"""ConfigRecord: ``federation``, ``owner``, ``round`` (last round saved)."""
FILE_NAME = "node-state.pb"

RecordCheck = Callable[[ConfigRecord], str | None]
"""Says why a stored :class:`ConfigRecord` is malformed (``None``: it is not)."""


def check_federation_id(value: str) -> str:
    """Return ``value`` if it is a safe folder name, else raise :class:`ConfigError`."""
    if not SAFE_ID.match(value) or ".." in value:
        raise ConfigError(
            f"the server sent federation id {value!r}, which is not a safe folder name "
            "(letters, digits, '_', '.', '-'; at most 128); server and client run "
            "different Tessera versions"
        )
    return value


def record_problem(record: ArrayRecord) -> str | None:
    """Say why an :class:`ArrayRecord` read back is malformed (``None``: it is not).

    Each array must be a numpy serialisation whose bytes hold exactly the shape and
    dtype it declares; only headers are parsed, so nothing of a declared size is
    allocated.
    """
    for name, array in record.items():
        if array.stype != "numpy.ndarray":
            return f"array '{name}' is serialised as {array.stype!r}, not numpy"
        problem = npy_bytes_problem(
            array.data, shape=tuple(int(d) for d in array.shape), dtype=str(array.dtype)
        )
        if problem is not None:
            return f"array '{name}': {problem}"
    return None


def model_problem(record: ArrayRecord, like: Mapping[str, Any]) -> str | None:
    """Say why stored weights do not fit a model (``None``: they fit).

    Parameters
    ----------
    record : ArrayRecord
        The stored weights.
    like : Mapping[str, Any]
        The model's own exchanged entries (torch tensors or numpy arrays): the
        names, shapes and dtypes the record must have.

    Returns
    -------
    str or None
        Missing or unexpected names, a shape or dtype that differs, bytes that do
        not hold the declared array, or an entry holding NaN or an infinity.
    """
    missing = sorted(set(like) - set(record))
    unexpected = sorted(set(record) - set(like))
    if missing or unexpected:
        return (
            f"its names differ from the model's: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, want in like.items():
        array = record[name]
        shape, dtype = tuple(int(d) for d in want.shape), dtype_name(want.dtype)
        if tuple(int(d) for d in array.shape) != shape or str(array.dtype) != dtype:
            return (
                f"'{name}' is {array.dtype} {tuple(array.shape)} but the model has {dtype} {shape}"
            )
    problem = record_problem(record)
    if problem is not None:
        return problem
    for name in like:
        value = record[name].numpy()
        if value.dtype.kind in "fc" and not bool(np.isfinite(value).all()):
            return f"'{name}' holds NaN or infinite values"
    return None


class NodeState:
    """Typed access to a node's persistent records.

    Parameters
    ----------
    records : RecordDict
        ``context.state`` (changed in place, so Flower keeps it between rounds).
    path : Path | None
        The file that mirrors it (``None``: memory only).
    owner : str
        Which node configuration the state belongs to (e.g. ``partition-3``).
    federation : str | None
        The federation the state belongs to (``None`` before the server named one).
    """

    def __init__(
        self,
        records: RecordDict,
        *,
        path: Path | None = None,
        owner: str = "",
        federation: str | None = None,
    ) -> None:
        self.records = records
        self.path = path
        self.owner = owner
        self.federation = federation
        self.restored_from_disk = False

    @classmethod
    def open(
        cls,
        records: RecordDict,
        *,
        state_dir: str | None,
        federation: str | None,
        owner: str,
    ) -> NodeState:
        """Wrap ``context.state``; reload it from ``state_dir`` after a restart.

        Parameters
        ----------
        records : RecordDict
            ``context.state``.
        state_dir : str | None
            node-config ``state-dir`` (``None``: nothing is written to disk).
        federation : str | None
            The federation id the server sent (``None`` before it sent one).
        owner : str
            This node's identity (partition id or data path).
        """
        path = None
        if state_dir is not None and federation is not None:
            path = Path(state_dir).expanduser() / check_federation_id(federation) / FILE_NAME
        state = cls(records, path=path, owner=owner, federation=federation)
        if path is not None and META not in records and path.is_file():
            state._restore(path)
        return state

    def _restore(self, path: Path) -> None:
        try:
            loaded = recorddict_from_proto(ProtoRecordDict.FromString(path.read_bytes()))
        except Exception as err:
            log.warning("node state %s cannot be read (%s); starting without it", path, err)
            return
        meta = loaded.config_records.get(META, ConfigRecord())
        federation, owner, saved = meta.get("federation"), meta.get("owner"), meta.get("round")
        if not isinstance(owner, str) or not isinstance(saved, int) or saved < 0:
            log.warning(
                "node state %s has no valid record '%s' (owner %r, round %r); starting without it",
                path,
                META,
                owner,
                saved,
            )
            return
        if federation != self.federation:
            log.warning(
                "node state %s was written for federation %r but this is %r (a file copied "
                "from another federation's folder, or written by an older version); "
                "starting without it",
                path,
                federation,
                self.federation,
            )
            return
        if owner != self.owner:
            log.warning(
                "node state %s belongs to '%s' but this node is '%s'; ignoring it (give "
                "each node its own node-config 'state-dir')",
                path,
                owner,
                self.owner,
            )
            return
        for name, arrays in loaded.array_records.items():
            problem = record_problem(arrays)
            if problem is not None:
                log.warning(
                    "node state %s: record '%s' is malformed (%s); starting without the file",
                    path,
                    name,
                    problem,
                )
                return
        for name, record in loaded.items():
            self.records[name] = record
        self.restored_from_disk = True
        log.info("node state restored from %s (saved after round %s)", path, meta.get("round", "?"))

    # ------------------------------------------------------------------ records
    def arrays(self, name: str) -> ArrayRecord | None:
        """Return the ArrayRecord ``name``, or ``None``."""
        return self.records.array_records.get(name)

    def fitting_arrays(
        self, name: str, *, like: Mapping[str, Any], forget: Sequence[str] = ()
    ) -> ArrayRecord | None:
        """Return the ArrayRecord ``name`` if it fits a model; else forget it and say so.

        A stored model that no longer fits (:func:`model_problem`: other names,
        shapes or dtypes, bytes that do not hold them, NaN) would make the node fail
        every round, for ever: it is removed, with the records ``forget`` that
        describe it, and a warning is logged, so the node starts afresh.

        Parameters
        ----------
        name : str
            The record.
        like : Mapping[str, Any]
            The model's own exchanged entries (names, shapes and dtypes to match).
        forget : Sequence[str]
            Records removed with it (its metadata).

        Returns
        -------
        ArrayRecord or None
            The record, or ``None`` if there is none or it was forgotten.
        """
        record = self.arrays(name)
        if record is None:
            return None
        problem = model_problem(record, like)
        if problem is None:
            return record
        log.warning(
            "node state: stored '%s' does not fit the model (%s); discarding it and starting "
            "afresh",
            name,
            problem,
        )
        for gone in (name, *forget):
            self.remove(gone)
        return None

    def config(self, name: str) -> ConfigRecord | None:
        """Return the ConfigRecord ``name``, or ``None``."""
        return self.records.config_records.get(name)

    def checked_config(
        self, name: str, check: RecordCheck, *, forget: Sequence[str] = ()
    ) -> ConfigRecord | None:
        """Return the ConfigRecord ``name`` if ``check`` accepts it; else forget it and say so.

        A stored record its reader cannot use (a key missing, a value of the wrong
        type or range: a damaged file, a record an older version wrote) would make
        the node fail every round, for ever: it is removed, with the records
        ``forget`` that depend on it, and a warning is logged, so the node rebuilds
        it.

        Parameters
        ----------
        name : str
            The record.
        check : RecordCheck
            Says why the record is malformed (``None``: it is not); it must not raise.
        forget : Sequence[str]
            Records removed with it (those it describes).

        Returns
        -------
        ConfigRecord or None
            The record, or ``None`` if there is none or it was forgotten.
        """
        record = self.config(name)
        if record is None:
            return None
        problem = check(record)
        if problem is None:
            return record
        log.warning(
            "node state: stored '%s' is malformed (%s); discarding it and rebuilding it",
            name,
            problem,
        )
        for gone in (name, *forget):
            self.remove(gone)
        return None

    def put(self, name: str, record: ArrayRecord | ConfigRecord) -> None:
        """Store a record under ``name`` (replacing any)."""
        self.records[name] = record

    def remove(self, name: str) -> None:
        """Forget the record ``name`` if present."""
        if name in self.records:
            del self.records[name]

    @property
    def saved_round(self) -> int:
        """The last round whose state was saved (0 if none)."""
        meta = self.config(META)
        value = meta.get("round", 0) if meta is not None else 0
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

    def save(self, server_round: int) -> None:
        """Mark the state as of ``server_round`` and write it to disk (if mirrored)."""
        meta: dict[str, ConfigRecordValues] = {"owner": self.owner, "round": int(server_round)}
        if self.federation is not None:
            meta["federation"] = self.federation
        self.records[META] = ConfigRecord(meta)
        if self.path is None:
            return
        data = recorddict_to_proto(self.records).SerializeToString()
        write_atomic(self.path, data)
