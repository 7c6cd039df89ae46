"""Reference: Flower's own built-in ``FedAvg`` and its ``Strategy.start`` loop.

Not a Tessera scheme but the yardstick for the framework-overhead benchmark
(``benchmarks/overhead.py``): the same task, model and clients as ``fedavg`` with
``fedavg-arch`` set, driven by Flower's unmodified round loop (a train exchange and
an evaluate exchange per round, ``Grid.send_and_receive``). Requires run-config
``fedavg-arch``. Results are written in the same format as every scheme.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from models.spec import ModelRef
from strategies.core.client import ClientAlgorithm
from strategies.core.context import ServerEnv
from strategies.core.exchange import wait_for_nodes
from strategies.core.nodes import NodeInfo
from strategies.core.registry import WEIGHT_ONLY_KEYS, Scheme, register_scheme
from tessera import wire
from tessera.config import ConfigError, ConfigReader, RunConfig
from tessera.results import ResultsWriter
from tessera.training import evaluate_model

log = logging.getLogger("flwr.tessera")


@dataclass(frozen=True)
class FlowerFedAvgOptions:
    """``fedavg-arch`` is required: every client trains it."""

    arch: str

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FlowerFedAvgOptions:
        """Read the options from the run config."""
        arch = ConfigReader(run_config, "run-config").optional_str("fedavg-arch")
        if arch is None:
            raise ConfigError(
                "strategy 'flwr-fedavg' needs run-config 'fedavg-arch', e.g. "
                "--run-config \"fedavg-arch='cnn-3'\""
            )
        return cls(arch=arch)


class _RecordingFedAvg(FedAvg):
    """Flower's FedAvg; ``aggregate_train`` also keeps the replies' metrics."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last_clients: list[dict[str, Any]] = []

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.last_clients = [
            {
                "node": int(m.metadata.src_node_id),
                **{
                    k: float(v)
                    for k, v in m.content.metric_records[wire.METRICS].items()
                    if isinstance(v, (int, float))
                },
                "bytes_up": wire.payload_bytes(m.content),
            }
            for m in replies
            if m.has_content() and wire.METRICS in m.content.metric_records
        ]
        return super().aggregate_train(server_round, replies)


class FlowerFedAvgRunner:
    """Runs Flower's ``FedAvg.start`` and writes Tessera-format results."""

    name: ClassVar[str] = "hetero"
    """Set by :func:`~strategies.core.registry.register_scheme`."""

    def __init__(
        self, *, env: ServerEnv, options: FlowerFedAvgOptions, results: ResultsWriter | None
    ) -> None:
        self.env = env
        self.options = options
        self.results = results
        self.rounds: list[dict[str, Any]] = []
        self.nodes: dict[int, NodeInfo] = {}
        self.final_metrics: dict[str, Any] = {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Not supported: Flower's own loop keeps no resumable state.

        Raises
        ------
        ConfigError
            Always.
        """
        raise ConfigError(
            "strategy 'flwr-fedavg' (Flower's own loop, a benchmark reference) cannot "
            "resume; leave run-config 'resume' empty"
        )

    def _model(self) -> torch.nn.Module:
        from models import get_model

        torch.manual_seed(self.env.run.seed)
        return get_model(
            self.options.arch,
            input_shape=self.env.input_shape,
            num_classes=self.env.num_classes,
            norm=self.env.run.scheme.norm,
            flat_input=self.env.run.scheme.flat_input,
        )

    def start(self, grid: Grid, *, num_rounds: int, timeout: float) -> Result:
        """Run Flower's loop for ``num_rounds`` rounds."""
        nodes = wait_for_nodes(
            grid,
            min_nodes=self.env.run.deployment.min_nodes,
            timeout=self.env.run.deployment.node_wait_timeout,
        )
        strategy = _RecordingFedAvg(
            min_available_nodes=len(nodes),
            min_train_nodes=len(nodes),
            min_evaluate_nodes=len(nodes),
        )
        initial = wire.state_to_record(self._model().state_dict())
        if self.results is not None:
            self.results.write_config(
                {
                    "run_config": self.env.run.to_dict(),
                    "scheme": self.name,
                    "arch": self.options.arch,
                    "nodes": nodes,
                }
            )
        marks = [time.monotonic()]

        def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = self._model()
            model.load_state_dict(arrays.to_torch_state_dict(), strict=False)
            _, acc = evaluate_model(
                model, self.env.global_test, batch_size=256, device=torch.device("cpu")
            )
            if server_round > 0:
                now = time.monotonic()
                clients = strategy.last_clients
                slowest = max((c.get(wire.TRAIN_SECONDS, 0.0) for c in clients), default=0.0)
                record = {
                    "round": server_round,
                    "strategy": self.name,
                    "clients": [
                        {
                            "node": c["node"],
                            "arch": self.options.arch,
                            "num_examples": int(c[wire.NUM_EXAMPLES]),
                            "train_loss": c.get(wire.TRAIN_LOSS),
                            "train_seconds": c.get(wire.TRAIN_SECONDS),
                            "bytes_up": c["bytes_up"],
                        }
                        for c in clients
                    ],
                    "num_sent": len(nodes),
                    "num_ok": len(clients),
                    "num_rejected": 0,
                    "num_failed": len(nodes) - len(clients),
                    "global_accuracy": acc,
                    "bytes_up_total": sum(c["bytes_up"] for c in clients),
                    "bytes_down_total": 0,
                    "round_seconds": now - marks[-1],
                    "slowest_train_seconds": slowest,
                    "overhead_seconds": now - marks[-1] - slowest,
                }
                marks.append(now)
                self.rounds.append(record)
                if self.results is not None:
                    self.results.append_round(record)
            else:
                marks[-1] = time.monotonic()
            return MetricRecord({"accuracy": acc})

        return strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=ConfigRecord(),
            evaluate_config=ConfigRecord(),
            evaluate_fn=evaluate_fn,
        )


class FlowerFedAvgClient(ClientAlgorithm[FlowerFedAvgOptions]):
    """Trains ``fedavg-arch``; Flower's messages name no architecture."""

    def arch_for(self, config: ConfigRecord) -> ModelRef:
        """Return the model named by ``fedavg-arch``."""
        return ModelRef(str(self.options.arch))


DEFENCE_KEYS = (
    *WEIGHT_ONLY_KEYS,
    "trim-fraction",
    "weight-cap",
    "weight-trim",
    "bound-stretch",
)
"""Run-config keys of Tessera's aggregation and its bounds, none of which Flower's
``FedAvg`` reads."""


def refuse_defence_keys(run: RunConfig, options: FlowerFedAvgOptions) -> None:
    """Refuse a changed :data:`DEFENCE_KEYS` key: Flower's ``FedAvg`` would ignore it.

    Flower's strategy weighs each reply by the ``num-examples`` it states and bounds
    nothing; a user who sets ``aggregator=median`` or ``weight-cap=1`` for it would
    believe the run defended when it is not.

    Raises
    ------
    ConfigError
        Naming the changed keys and the fix.
    """
    from tessera.config.declared import changed_keys

    changed = changed_keys(run.to_dict(), DEFENCE_KEYS)
    if changed:
        raise ConfigError(
            f"run-config {', '.join(repr(k) for k in changed)} set, but 'flwr-fedavg' is "
            "Flower's unmodified FedAvg (the overhead benchmark's yardstick): it weighs "
            "each reply by the num-examples it states and bounds nothing, so they would "
            "be ignored; leave them at their defaults, or use strategy='fedavg' for the "
            "bounded and checked FedAvg"
        )


SCHEME = register_scheme(
    Scheme(
        name="flwr-fedavg",
        server=FlowerFedAvgRunner,
        client=FlowerFedAvgClient,
        parse_options=FlowerFedAvgOptions.parse,
        default_family="cnn",
        description="reference: Flower's built-in FedAvg and round loop (benchmark yardstick)",
        validate=refuse_defence_keys,
    )
)
