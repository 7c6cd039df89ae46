"""One evaluation protocol for every scheme (``python -m benchmarks.compare``).

- :mod:`tessera.compare.metrics`: the pure maths: what a run's round records say
  under the protocol (the same fields for every scheme), the plateau round, the
  spread over seeds, whether a scheme beats the floor.
- :mod:`tessera.compare.ceiling`: centralised training of the fleet's architectures
  on the pooled client training data with the same budget (the ceiling).
- :mod:`tessera.compare.report`: the results folder's CSV, Markdown tables and plots.

The protocol itself is written down in ``docs/pages/protocol.md``.
"""
