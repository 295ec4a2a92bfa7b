"""Maximum likelihood baseline: per sample −log p(x) with a normalized density (NICE, paper §4.3)."""

from __future__ import annotations

from torch import Tensor

from .base import ObjectiveOutput, finalize


def mle(model, x: Tensor, *, create_graph: bool = True, **_) -> ObjectiveOutput:
    """Negative log-likelihood ``−log p(x)`` per sample; needs ``model.log_likelihood(x) -> [B]``.

    Only models with a tractable, normalized likelihood have one (NICE, by change of variables). Extra
    keyword arguments are accepted and ignored so that every objective can be called alike.
    With ``create_graph=False`` the values are detached. Part: ``nll`` (mean −log p).
    """
    if not callable(getattr(model, "log_likelihood", None)):
        raise ValueError(  # noqa: TRY004 (a config error: loss=mle with the wrong model)
            "loss=mle needs a model with a tractable likelihood (e.g. model=nice); "
            f"{type(model).__name__} has none"
        )
    ll = model.log_likelihood(x)
    if ll.shape != (x.shape[0],):
        raise ValueError(
            f"{type(model).__name__}.log_likelihood(x) must return shape [B] = ({x.shape[0]},), got {tuple(ll.shape)}"
        )
    nll = -ll
    return finalize(nll, {"nll": nll.mean()}, create_graph)
