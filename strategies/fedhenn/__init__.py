"""FedHeNN: CKA alignment of client representations on a server-sent RAD.

``from strategies.fedhenn import linear_cka, rbf_cka, kernel_cka`` gives the maths
(:mod:`strategies.fedhenn.cka`, with ``K_bar``'s factor in :mod:`~strategies.fedhenn.kbar`).
The scheme is one module per part: :mod:`~strategies.fedhenn.options`,
:mod:`~strategies.fedhenn.payload` (keys and reply checks),
:mod:`~strategies.fedhenn.server` (both modes), :mod:`~strategies.fedhenn.client`,
and :mod:`~strategies.fedhenn.scheme`, which registers ``strategy="fedhenn"`` on
import.
"""

from strategies.fedhenn import scheme
from strategies.fedhenn.cka import kernel_cka, linear_cka, rbf_cka
from strategies.fedhenn.options import FedHeNNOptions

__all__ = ["FedHeNNOptions", "kernel_cka", "linear_cka", "rbf_cka", "scheme"]
