"""The deployable ensemble: one ``.npz`` file, and the code that loads and applies it.

The file (written by the ``ensemble`` scheme at the end of a run as
``<results>/ensemble.npz``) holds, with no pickled objects:

- ``manifest``: a JSON string: format tag, the group models' architecture names
  (in ``alpha``'s row order), input shape, number of classes, class names,
  normalisation, the optimiser that chose ``alpha``, and the run it came from;
- ``alpha``: the ``(N models, C classes)`` weights;
- ``m{i}/{key}``: the weights of model ``i`` (its state dict, as exchanged).

:func:`load_ensemble` checks all of it before building anything, and bounds every
size before allocating it: each entry's declared size by the file's own
(:func:`tessera.state_checks.read_npz`), the manifest's fields by their schema (a
sample of at most :data:`MAX_INPUT_VALUES` values), and each model's weights by
building it first on PyTorch's ``meta`` device (shapes, no memory) and comparing its
entries' names, shapes and dtypes with the file's, which must also be finite. Any
failure is an :class:`ArtifactError` naming the file and the field.
:meth:`Ensemble.predict` labels a batch on CPU or CUDA. The command line is
``python -m strategies.ensemble predict``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from strategies.ensemble.weights import combine
from tessera import wire
from tessera.state_checks import (
    StateFileError,
    arrays_problem,
    get_int,
    get_list,
    get_mapping,
    get_str,
    int_list,
    read_npz,
)

__all__ = [
    "FORMAT",
    "Ensemble",
    "class_probabilities",
    "load_ensemble",
    "save_ensemble",
]

FORMAT: Final = "tessera-ensemble/1"
"""Format tag in every artifact's manifest."""
MAX_INPUT_VALUES: Final = 1 << 24
"""Most values one sample may have (``prod(input_shape)``); a manifest declaring more
is refused before any model is built."""
MODEL_KWARGS: Final = ("flat_input",)
"""Keys a manifest's ``model_kwargs`` may hold (passed on to ``models.get_model``)."""
_MODEL_ENTRY = re.compile(r"^m(0|[1-9][0-9]*)/(.+)$")


class ArtifactError(ValueError):
    """An ensemble artifact that cannot be loaded (the message says what is wrong)."""


@torch.no_grad()
def class_probabilities(
    model: nn.Module, x: np.ndarray, *, batch_size: int = 256, device: str | torch.device = "cpu"
) -> np.ndarray:
    """Return the softmax outputs ``(S, C)`` of ``model`` on the float32 samples ``x``."""
    model.to(device)
    model.eval()
    out = []
    for begin in range(0, len(x), batch_size):
        batch = torch.from_numpy(np.ascontiguousarray(x[begin : begin + batch_size])).to(device)
        out.append(torch.softmax(model(batch).double(), dim=1).cpu().numpy())
    if not out:
        return np.zeros((0, 0))
    return np.concatenate(out)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Turn TF32 off for CUDA convolutions and matrix products inside the block.

    cuDNN computes float32 convolutions in TF32 by default on Ampere and later GPUs
    (10 bits of mantissa); inside the block they, and matrix products, use full
    float32, as on the CPU. The previous settings are restored on leaving.
    """
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@dataclass
class Ensemble:
    """A loaded ensemble: the group models, ``alpha`` and what they expect.

    Attributes
    ----------
    archs : list[str]
        Architecture names, one per row of ``alpha``.
    alpha : np.ndarray
        ``(N, C)`` weights.
    input_shape : tuple[int, ...]
        Shape of one sample.
    class_names : list[str]
        One name per class.
    norm : str
        Normalisation the models were built with.
    manifest : dict
        The whole manifest.
    models : list[nn.Module]
        The models, in eval mode.
    """

    archs: list[str]
    alpha: np.ndarray
    input_shape: tuple[int, ...]
    class_names: list[str]
    norm: str
    manifest: dict[str, Any]
    models: list[nn.Module] = field(repr=False)

    def probabilities(
        self, x: np.ndarray, *, batch_size: int = 256, device: str | torch.device = "cpu"
    ) -> np.ndarray:
        """Return each model's class probabilities ``(N, S, C)`` on ``x``.

        On CUDA the models run in full float32 (:func:`full_float32`): cuDNN's
        default TF32 convolutions changed 1 label of 360 against the CPU on an H200
        (a near tie), and a label should not depend on the device it was computed on.
        """
        array = np.asarray(x, dtype=np.float32)
        if tuple(array.shape[1:]) != self.input_shape:
            raise ValueError(
                f"the samples have shape {tuple(array.shape[1:])} but this ensemble was "
                f"trained on {self.input_shape}; give an array of shape "
                f"(N, {', '.join(map(str, self.input_shape))})"
            )
        with full_float32():
            return np.stack(
                [
                    class_probabilities(m, array, batch_size=batch_size, device=device)
                    for m in self.models
                ]
            )

    def scores(self, x: np.ndarray, **kwargs: Any) -> np.ndarray:
        """Return the ensemble's class scores ``(S, C)`` on ``x``."""
        return combine(self.probabilities(x, **kwargs), self.alpha)

    def predict(self, x: np.ndarray, **kwargs: Any) -> np.ndarray:
        """Return the predicted class of every sample of ``x``."""
        labels: np.ndarray = self.scores(x, **kwargs).argmax(axis=1)
        return labels


def save_ensemble(
    path: Path,
    *,
    archs: Sequence[str],
    weights: Sequence[Mapping[str, np.ndarray]],
    alpha: np.ndarray,
    input_shape: Sequence[int],
    class_names: Sequence[str],
    norm: str,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write an ensemble artifact (module docstring); return its path.

    The file is written next to ``path`` and renamed into place, so a crash never
    leaves half an artifact.
    """
    a = np.asarray(alpha, dtype=np.float64)
    if a.shape != (len(archs), len(class_names)) or len(weights) != len(archs):
        raise ValueError(
            f"alpha is {a.shape} for {len(archs)} architectures, {len(weights)} weight sets "
            f"and {len(class_names)} classes"
        )
    manifest = {
        "format": FORMAT,
        "archs": list(archs),
        "input_shape": [int(n) for n in input_shape],
        "num_classes": len(class_names),
        "class_names": [str(c) for c in class_names],
        "norm": norm,
        **(dict(extra) if extra else {}),
    }
    arrays: dict[str, np.ndarray] = {"manifest": np.array(json.dumps(manifest)), "alpha": a}
    for i, state in enumerate(weights):
        arrays.update({f"m{i}/{k}": np.asarray(v) for k, v in state.items()})
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class Manifest:
    """The checked fields of an artifact's manifest.

    Attributes
    ----------
    archs : list[str]
        Architecture names, one per model.
    input_shape : tuple[int, ...]
        Shape of one sample.
    class_names : list[str]
        One name per class.
    norm : str
        Normalisation the models were built with.
    model_kwargs : dict[str, Any]
        Further arguments of ``models.get_model`` (only :data:`MODEL_KWARGS`).
    raw : dict[str, Any]
        The whole manifest.
    """

    archs: list[str]
    input_shape: tuple[int, ...]
    class_names: list[str]
    norm: str
    model_kwargs: dict[str, Any]
    raw: dict[str, Any]


def parse_manifest(raw: Any) -> Manifest:
    """Check a decoded manifest against its schema (nothing is built or allocated).

    Parameters
    ----------
    raw : Any
        The manifest's JSON value.

    Returns
    -------
    Manifest
        Its checked fields.

    Raises
    ------
    StateFileError
        Naming the first field that is missing, of the wrong type or out of range.
    """
    from models import FLAT_INPUTS, list_norms

    if not isinstance(raw, dict):
        raise StateFileError("manifest", f"is {type(raw).__name__}; expected a mapping")
    tag = raw.get("format")
    if tag != FORMAT:
        raise StateFileError("manifest.format", f"is {tag!r}; this code reads {FORMAT!r}")
    archs = get_list(raw, "archs", where="manifest")
    if not archs:
        raise StateFileError("manifest.archs", "is empty; an ensemble has at least one model")
    archs = [get_str({"": a}, "", where=f"manifest.archs[{i}]") for i, a in enumerate(archs)]
    shape = tuple(
        int_list(
            get_list(raw, "input_shape", where="manifest"), where="manifest.input_shape", minimum=1
        )
    )
    if not 1 <= len(shape) <= 3 or math.prod(shape) > MAX_INPUT_VALUES:
        raise StateFileError(
            "manifest.input_shape",
            f"is {list(shape)}; expected 1 to 3 dimensions of at most {MAX_INPUT_VALUES} "
            "values in all",
        )
    names = get_list(raw, "class_names", where="manifest")
    names = [get_str({"": c}, "", where=f"manifest.class_names[{i}]") for i, c in enumerate(names)]
    num_classes = get_int(raw, "num_classes", where="manifest", minimum=2, default=len(names))
    if num_classes != len(names) or num_classes < 2:
        raise StateFileError(
            "manifest.class_names",
            f"names {len(names)} classes but num_classes is {num_classes}; expected the "
            "same number, at least 2",
        )
    norm = get_str(raw, "norm", where="manifest", default="batch")
    if norm not in list_norms():
        raise StateFileError("manifest.norm", f"is {norm!r}; expected one of {list_norms()}")
    kwargs = dict(get_mapping(raw, "model_kwargs", where="manifest", default={}))
    unknown = sorted(set(kwargs) - set(MODEL_KWARGS))
    if unknown:
        raise StateFileError("manifest.model_kwargs", f"has unknown keys {unknown}")
    if "flat_input" in kwargs and kwargs["flat_input"] not in FLAT_INPUTS:
        raise StateFileError(
            "manifest.model_kwargs.flat_input",
            f"is {kwargs['flat_input']!r}; expected one of {list(FLAT_INPUTS)}",
        )
    return Manifest(
        archs=archs,
        input_shape=shape,
        class_names=names,
        norm=norm,
        model_kwargs=kwargs,
        raw=raw,
    )


def _read_artifact(file: Path) -> tuple[Manifest, np.ndarray, list[dict[str, np.ndarray]]]:
    """Read and check an artifact's manifest, ``alpha`` and weight entries.

    Raises
    ------
    StateFileError
        Naming the first entry or field that fails.
    """
    arrays = read_npz(file)  # every entry's size bounded by the file's before it is read
    if "manifest" not in arrays:
        raise StateFileError("manifest", f"is missing; the file holds {sorted(arrays)[:5]}")
    text = arrays.pop("manifest")
    if text.ndim != 0 or text.dtype.kind != "U":
        raise StateFileError("manifest", f"is {text.dtype} {text.shape}; expected one string")
    try:
        raw = json.loads(str(text))
    except (ValueError, RecursionError) as err:
        raise StateFileError("manifest", f"is not JSON ({err})") from err
    manifest = parse_manifest(raw)
    if "alpha" not in arrays:
        raise StateFileError("alpha", "is missing")
    alpha = arrays.pop("alpha")
    want = (len(manifest.archs), len(manifest.class_names))
    if alpha.dtype.kind != "f" or alpha.shape != want or not bool(np.isfinite(alpha).all()):
        raise StateFileError(
            "alpha",
            f"is {alpha.dtype} {alpha.shape}; expected finite floats of shape {want} "
            f"({want[0]} models x {want[1]} classes)",
        )
    weights: list[dict[str, np.ndarray]] = [{} for _ in manifest.archs]
    for name, value in arrays.items():
        match = _MODEL_ENTRY.match(name)
        if match is None or int(match.group(1)) >= len(weights):
            raise StateFileError(
                name, f"is not an entry of the {len(weights)} model(s) the manifest names"
            )
        weights[int(match.group(1))][match.group(2)] = value
    return manifest, alpha.astype(np.float64), weights


def _skeleton(arch: str, manifest: Manifest, *, where: str) -> dict[str, torch.Tensor]:
    """Build ``arch`` on the meta device (no memory); return its exchanged entries."""
    from models import get_model

    try:
        with torch.device("meta"):
            model = get_model(
                arch,
                input_shape=manifest.input_shape,
                num_classes=len(manifest.class_names),
                norm=manifest.norm,
                **manifest.model_kwargs,
            )
    except Exception as err:  # an unknown name or a shape it cannot take
        raise StateFileError(
            where, f"names architecture {arch!r}, which cannot be built ({err})"
        ) from err
    return {k: v for k, v in model.state_dict().items() if wire.is_exchanged(k)}


def load_ensemble(path: str | Path, *, device: str | torch.device = "cpu") -> Ensemble:
    """Load an artifact written by :func:`save_ensemble` and build its models.

    Everything is checked before a model is built for real (module docstring).

    Raises
    ------
    ArtifactError
        If the file is missing, not an ensemble artifact, or inconsistent (the
        message names what and where).
    """
    from models import get_model

    file = Path(path)
    if not file.is_file():
        raise ArtifactError(f"no ensemble artifact at {file}; give the ensemble.npz of a run")
    try:
        manifest, alpha, weights = _read_artifact(file)
        for i, arch in enumerate(manifest.archs):
            expected = _skeleton(arch, manifest, where=f"manifest.archs[{i}]")
            problem = arrays_problem(weights[i], expected, where=f"m{i}")
            if problem is not None:
                raise problem
    except StateFileError as err:
        raise ArtifactError(
            f"{file} is not a Tessera ensemble artifact this code can use: {err}; export "
            "it again from the run's checkpoint, or give the ensemble.npz of an intact run"
        ) from err
    models: list[nn.Module] = []
    for i, arch in enumerate(manifest.archs):
        model = get_model(
            arch,
            input_shape=manifest.input_shape,
            num_classes=len(manifest.class_names),
            norm=manifest.norm,
            **manifest.model_kwargs,
        )
        try:
            state = {k: torch.from_numpy(v) for k, v in weights[i].items()}
            model.load_state_dict(state, strict=False)
        except (RuntimeError, TypeError, ValueError) as err:
            raise ArtifactError(
                f"{file}: the weights of model {i} ({arch}) do not fit: {err}; export it "
                "again from the run's checkpoint, or give the ensemble.npz of an intact run"
            ) from err
        models.append(model.to(device).eval())
    return Ensemble(
        archs=manifest.archs,
        alpha=alpha,
        input_shape=manifest.input_shape,
        class_names=manifest.class_names,
        norm=manifest.norm,
        manifest=manifest.raw,
        models=models,
    )
