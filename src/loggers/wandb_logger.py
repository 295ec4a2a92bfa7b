"""Lightning's W&B logger without the argument that makes every run print a deprecation warning.

Lightning 2.6's ``WandbLogger`` always hands ``anonymous=None`` to ``wandb.init`` (``"allow" if anonymous else
None``); wandb >= 0.2x deprecated that setting and warns whenever it is passed at all, even as None:
``wandb: WARNING The anonymous setting has no effect and will be removed in a future version.`` — on every run
with the default logger, a warning the user did not cause. :class:`WandbLogger` drops the argument when it is
unset (a user who passes ``anonymous=true`` still gets it, and wandb's word on it); everything else is Lightning's.
``conf/logger/wandb.yaml`` builds this class.
"""

from __future__ import annotations

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # unset: let wandb.init keep its own default
            self._wandb_init.pop("anonymous", None)
