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
also records which node it belongs to (partition id or data path); a state written
by a different node configuration is ignored with a warning.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from tessera.checkpoint import write_atomic
from tessera.config import ConfigError

log = logging.getLogger("flwr.tessera")

META = "tessera.state-meta"
"""ConfigRecord: ``federation``, ``owner``, ``round`` (last round saved)."""
FILE_NAME = "node-state.pb"
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_federation_id(value: str) -> str:
    """Return ``value`` if it is a safe folder name, else raise :class:`ConfigError`."""
    if not _SAFE_ID.match(value) or ".." in value:
        raise ConfigError(
            f"the server sent federation id {value!r}, which is not a safe folder name "
            "(letters, digits, '_', '.', '-'; at most 128); server and client run "
            "different Tessera versions"
        )
    return value


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
    """

    def __init__(self, records: RecordDict, *, path: Path | None = None, owner: str = "") -> None:
        self.records = records
        self.path = path
        self.owner = owner
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
        state = cls(records, path=path, owner=owner)
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
        if str(meta.get("owner", "")) != self.owner:
            log.warning(
                "node state %s belongs to '%s' but this node is '%s'; ignoring it (give "
                "each node its own node-config 'state-dir')",
                path,
                meta.get("owner"),
                self.owner,
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

    def config(self, name: str) -> ConfigRecord | None:
        """Return the ConfigRecord ``name``, or ``None``."""
        return self.records.config_records.get(name)

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
        return int(meta.get("round", 0)) if meta is not None else 0  # type: ignore[arg-type]

    def save(self, server_round: int) -> None:
        """Mark the state as of ``server_round`` and write it to disk (if mirrored)."""
        self.records[META] = ConfigRecord({"owner": self.owner, "round": int(server_round)})
        if self.path is None:
            return
        data = recorddict_to_proto(self.records).SerializeToString()
        write_atomic(self.path, data)
