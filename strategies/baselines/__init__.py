"""The baselines: weight averaging over one model or per architecture, and no federation.

One module per scheme, as :mod:`strategies.submodel` holds the sub-model schemes:

- :mod:`~strategies.baselines.fedavg_groups` (``fedavg-groups``): FedAvg within each
  architecture group, the weight-averaging server the other weight-sharing schemes
  build on;
- :mod:`~strategies.baselines.fedavg` (``fedavg``): one shared architecture for the
  whole fleet (the family's smallest, unless ``fedavg-arch`` names one);
- :mod:`~strategies.baselines.fedprox` (``fedprox``): FedAvg with the proximal term;
- :mod:`~strategies.baselines.local` (``local``): every node trains alone, the floor
  of the leaderboard;
- :mod:`~strategies.baselines.flwr_fedavg` (``flwr-fedavg``): Flower's own FedAvg and
  round loop, the yardstick of the overhead benchmark.

Each module holds its scheme's options, server, client and registration.
"""

from strategies.baselines import fedavg, fedavg_groups, fedprox, flwr_fedavg, local

__all__ = ["fedavg", "fedavg_groups", "fedprox", "flwr_fedavg", "local"]
