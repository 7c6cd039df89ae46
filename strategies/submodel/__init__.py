"""Sub-models of one global model: layouts, extraction, grafting, coverage and scaling.

Pure numpy on state dicts (``dict[str, np.ndarray]``), shared by the sub-model
schemes (HeteroFL, FlexiFed, NeFL, FedFA):

- :mod:`models.spec` (re-exported here): :class:`Layout` (how a family names its
  section blocks, which entries keep whole channels) and :class:`SubModelSpec`
  (width ratio, blocks kept per section);
- :func:`extract`: FedFA Algorithm 3, drop each section's last blocks, then keep
  the channel prefix ``[:c_out, :c_in]``; also returns the coverage index;
- :func:`graft`: FedFA Algorithm 2, repeat each section's last block up to the
  global depth;
- :class:`ScalableAccumulator`: FedFA Algorithm 1, lines 12-22, streamed (the
  reading of its ambiguous parts, and how its scaling is made a bound
  (:func:`reference_norm`, :func:`effective_norm`), are in
  :mod:`~strategies.submodel.aggregate`; the list form it is tested against is a
  test oracle, ``tests/oracles.py``).

What the four schemes share besides the maths, one concern a module:
:mod:`~strategies.submodel.options` (run-config ``submodel-*`` and the slices a
scheme allows), :mod:`~strategies.submodel.client` (masked cross-entropy, the
scaler, the node's slice) and :mod:`~strategies.submodel.server` (the strategy that
sends slices and folds them back by coverage). Each scheme has its own module:
:mod:`~strategies.submodel.heterofl`, :mod:`~strategies.submodel.flexifed`,
:mod:`~strategies.submodel.nefl` and :mod:`~strategies.submodel.fedfa`.
"""

from models.spec import (
    Layout,
    SubModelError,
    SubModelSpec,
    section_depths,
    shapes_of,
    sub_channels,
    sub_shape,
)
from strategies.submodel.aggregate import ScalableAccumulator
from strategies.submodel.extract import coverage_index, extract, prefix_index, roll_channels
from strategies.submodel.graft import graft
from strategies.submodel.norms import effective_norm, reference_norm, trimmed_norm

__all__ = [
    "Layout",
    "ScalableAccumulator",
    "SubModelError",
    "SubModelSpec",
    "coverage_index",
    "effective_norm",
    "extract",
    "graft",
    "prefix_index",
    "reference_norm",
    "roll_channels",
    "section_depths",
    "shapes_of",
    "sub_channels",
    "sub_shape",
    "trimmed_norm",
]
