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
- :func:`coverage_average` and :func:`scalable_aggregate` (FedFA Algorithm 1,
  lines 12-22, streamed by :class:`ScalableAccumulator`; the reading of its
  ambiguous parts, and how its scaling is made a bound (:func:`reference_norm`,
  :func:`effective_norm`), are in :mod:`~strategies.submodel.aggregate`).
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
from strategies.submodel.aggregate import (
    ScalableAccumulator,
    coverage_average,
    effective_norm,
    layer_norms,
    reference_norm,
    scalable_aggregate,
    scale_state,
    scaling_factors,
    trimmed_norm,
)
from strategies.submodel.extract import coverage_index, extract, prefix_index, roll_channels
from strategies.submodel.graft import graft

__all__ = [
    "Layout",
    "ScalableAccumulator",
    "SubModelError",
    "SubModelSpec",
    "coverage_average",
    "coverage_index",
    "effective_norm",
    "extract",
    "graft",
    "layer_norms",
    "prefix_index",
    "reference_norm",
    "roll_channels",
    "scalable_aggregate",
    "scale_state",
    "scaling_factors",
    "section_depths",
    "shapes_of",
    "sub_channels",
    "sub_shape",
    "trimmed_norm",
]
