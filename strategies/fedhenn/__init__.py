"""FedHeNN: CKA alignment of client representations on a server-sent RAD.

``from strategies.fedhenn import linear_cka, rbf_cka, kernel_cka`` gives the maths
(:mod:`strategies.fedhenn.cka`); the scheme itself (server strategies of both modes,
the client objective, the payload schema) is :mod:`strategies.fedhenn.scheme`, which
registers ``strategy="fedhenn"`` on import.
"""

from strategies.fedhenn import scheme
from strategies.fedhenn.cka import kernel_cka, linear_cka, rbf_cka
from strategies.fedhenn.scheme import FedHeNNOptions

__all__ = ["FedHeNNOptions", "kernel_cka", "linear_cka", "rbf_cka", "scheme"]
