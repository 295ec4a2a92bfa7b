"""A family's network from ``model.net``: a partial class the config names, completed by the LightningModule.

``model.net`` is ``{_target_: src.models.<module>.<Class or builder>, _partial_: true, <sizes>}`` (the
lightning-hydra-template convention): the sizes are written once, in the network's own signature, and the config
fills them in. The LightningModule adds what only the run knows — the data's dimensions, the noise levels, the
``deq`` group parsed into a :class:`src.deq.config.DEQConfig` (once, by the family's rules:
:func:`src.deq.config.deq_setting`) and ``depth`` — with :func:`complete_net`, which refuses, in one line, a size
the network does not take and a key the module sets itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from src.config.partials import partial_config, partial_of, partial_parameters, partial_target

WHERE = "model.net"
HINT = ("model.net is a partial network class: model.net={_target_: src.models.<module>.<Class>, _partial_: true, "
        "<its sizes>} (conf/model/<family>.yaml)")


def net_factory(spec: Any) -> Callable:
    """The partial network of ``model.net`` (a ``functools.partial``, or the same ``{_target_: …}`` mapping)."""
    if spec is None:
        raise ValueError(f"{WHERE} is missing: {HINT}")
    return partial_of(spec, WHERE, HINT)


def complete_net(factory: Callable, **given: Any):
    """The network: ``factory`` (the config's sizes) called with ``given`` (what the module knows)."""
    target = partial_target(factory)
    name = getattr(target, "__qualname__", str(target))
    configured = set(getattr(factory, "keywords", None) or {})
    params = partial_parameters(factory)
    clash = sorted(configured & set(given))
    if clash:
        raise ValueError(f"{WHERE}.{clash[0]}: the LightningModule sets {', '.join(clash)} of {name} itself (from the "
                         f"data, the deq group and depth); remove it from {WHERE}")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(configured - set(params))
        if unknown:
            takes = sorted(set(params) - set(given))
            raise ValueError(f"{WHERE}: {name} takes no argument {', '.join(unknown)}; its sizes: {', '.join(takes)}")
    return factory(**given)


def net_hparams(factory: Callable) -> dict[str, Any]:
    """``model.net`` as plain values, for the checkpoint's hyper-parameters."""
    return partial_config(factory)
