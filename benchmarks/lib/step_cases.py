"""The training step of each family and variant, the one place that builds them for the step tools: one
LightningModule per family and variant, built as the family's config builds it, with its own ``training_step``
and optimisers (run outside a Trainer by :func:`benchmarks.lib.step.training_step`), and the batches it trains on.
``benchmarks.tools.profile_step`` profiles :data:`CASES`; the step-cost tables (``benchmarks.tools.step_cost``)
build their modules with :func:`dkef_module`, :func:`ncsn_module` and :func:`vae_module` too.

Only constructor arguments that every revision since b3facaa accepts are used, so ``profile_step --at REV`` can
build the same cases from an older checkout of ``src`` and ``conf`` (:func:`snapshot`).

=============  ========================================================================================
case           what one step is
=============  ========================================================================================
dkef/deq       DKEF on RedWine (D = 11), M = 200 inducing points, exact SM, α on 16 points and the loss on
dkef/3-layer   16 others (the reference protocol, ``conf/model/dkef.yaml`` otherwise); DEQ features (Picard,
               K = 2 phantom steps, ``conf/deq/true.yaml``) or the explicit 3-layer ones
nice/deq-ssm   NICE on MNIST-sized inputs (D = 784, batch 128), SSM with one Rademacher projection; DEQ
nice/ssm       couplings 1000 wide or the reference 5-layer MLPs (``experiment=nice_mnist``)
ncsn/deq       NCSN at 3×32×32, ngf 128, batch 2 (``benchmarks/lib/step_cost/ncsn.py``'s CPU size), the σ²-weighted
ncsn/twores    noise-conditional SSM-VR step; DEQ-ResBlock or one plain ResBlock (TwoRes)
vae/deq        SSM-VAE at the CIFAR-10 size, batch 8, m = 64, D_z = 32 (``benchmarks/lib/step_cost/vae.py``): one
vae/ssm        SSM update of the score estimator and one ELBO update; DEQ score estimator or the plain one
=============  ========================================================================================
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = ("dkef/deq", "dkef/3-layer", "nice/deq-ssm", "nice/ssm", "ncsn/deq", "ncsn/twores", "vae/deq", "vae/ssm")
# the DEQ case of each family and the explicit case it is compared with
PAIRS = {"dkef": ("dkef/deq", "dkef/3-layer"), "nice": ("nice/deq-ssm", "nice/ssm"),
         "ncsn": ("ncsn/deq", "ncsn/twores"), "vae": ("vae/deq", "vae/ssm")}
N_BATCHES = 4  # distinct batches each case cycles through (seeded)


def deq_settings(enabled: bool, **overrides) -> dict:
    """The DEQ settings every step case ran with (``enabled`` switched as asked; ``overrides`` on top): written
    out, so that a revision whose ``src`` has another DEQ settings class builds the same block.

    Pinned, not read from the defaults (``src.deq.config.DEQConfig``, their one definition: relative 1e-4 since
    issue 41): the committed step figures (``benchmarks/results/profile_step.md``, ``speed.md``, the step-cost
    tables ``*_memory.md``) were made with the earlier absolute 1e-5 stop rule and the paper's Frobenius block (λ = 2), which
    :data:`benchmarks.lib.paper.PAPER_STOP` / ``PAPER_DEQ`` name for the grids."""
    return {"enabled": enabled, "solver": "picard", "tol": 1e-5, "stop_mode": "abs", "max_iter": 128,
            "phantom_steps": 2, "warm_start": True, "norm_lambda": 2.0, "norm": "frobenius",
            "backward": "phantom", "anderson_m": 5, "anderson_beta": 1.0, "injection": None, **overrides}


def optimizer_of(family: str, root: Path = ROOT) -> dict:
    """The optimiser settings of ``conf/model/<family>.yaml`` (of the tree at ``root``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(root / "conf" / "model" / f"{family}.yaml").optimizer)


# NCSN's model/net choice of each ``arch`` (conf/model/net/<choice>.yaml)
NCSN_NET_CHOICES = {"deq": "twores", "refinenet": "refinenet", "mdeq": "mdeq"}


def net_of(family: str, root: Path = ROOT, choice: str | None = None, **sizes) -> dict:
    """``model.net`` of ``conf/model/<family>.yaml`` (NCSN: ``conf/model/net/<choice>.yaml``) of the tree at ``root``,
    with ``sizes`` over its own."""
    from omegaconf import OmegaConf

    conf = root / "conf" / "model"
    net = OmegaConf.load(conf / "net" / f"{choice}.yaml") if choice else OmegaConf.load(conf / f"{family}.yaml").net
    return {**OmegaConf.to_container(net), **sizes}


def net_arguments(module_cls, family: str, choice: str | None = None, **sizes) -> dict:
    """The network arguments of ``module_cls``: ``net``, the config's ``model.net`` with ``sizes`` over its own
    (:func:`net_of`), where the module takes one; else ``sizes`` as the flat keyword arguments of a revision written
    before ``model.net`` (``profile_step --at``)."""
    import inspect

    if "net" not in inspect.signature(module_cls.__init__).parameters:
        return dict(sizes)
    return {"net": net_of(family, choice=choice, **sizes)}


def dkef_module(dim: int, deq: bool, depth: int | None, loss: str = "sm", optimizer: dict | None = None,
                **sizes):
    """The ``model=dkef`` module on D = ``dim``: DEQ features (:func:`deq_settings`) or ``depth`` explicit layers,
    the ``loss`` objective, ``sizes`` (``hidden``, ``deq_width``, …) as ``model.net`` takes them."""
    from src.lit.dkef import DKEFLitModule

    extra = {} if optimizer is None else {"optimizer": optimizer}
    return DKEFLitModule(dim, loss={"name": loss}, deq=deq_settings(deq), depth=depth, **extra,
                         **net_arguments(DKEFLitModule, "dkef", **sizes))


def ncsn_module(arch: str, deq: bool, depth: int | None, ngf: int = 128, optimizer: dict | None = None,
                loss: dict | None = None, deq_overrides: dict | None = None, conditioning: str = "cond_norm",
                **settings):
    """The ``model=ncsn`` module at 3×32×32: ``arch`` (``deq``: the DEQ-ResBlock network, ``model/net=twores``, a
    DEQ or ``depth`` plain ResBlocks; ``refinenet``; ``mdeq``), ngf and ``conditioning`` (its ``model.net``), the
    SSM-VR loss (``loss``), the optimiser of ``conf/model/ncsn.yaml``; ``settings`` (``noise``) as
    ``NCSNLitModule`` takes them."""
    from src.lit.ncsn import NCSNLitModule

    net = net_arguments(NCSNLitModule, "ncsn", choice=NCSN_NET_CHOICES[arch], arch=arch, ngf=ngf,
                        conditioning=conditioning)
    return NCSNLitModule((3, 32, 32), loss=loss or {"name": "ssm_vr"}, deq=deq_settings(deq, **(deq_overrides or {})),
                         depth=depth, optimizer=optimizer or optimizer_of("ncsn"), **net, **settings)


def vae_module(shape: tuple[int, ...], depth: int | None, deq: bool, latent: int = 32, channels: int = 64,
               optimizer: dict | None = None):
    """The ``model=vae`` module at ``shape``: conv architecture (paper Table 6), m = ``channels``, D_z =
    ``latent``, Gaussian decoder with a learned σ, the SSM score estimator — DEQ (linear injection) or ``depth``
    explicit layers (0: the plain SSM VAE, k: Aug(k)) — and the optimisers of ``conf/model/vae.yaml``."""
    from src.lit.vae import VAELitModule

    deq_cfg = {"enabled": True, "injection": "linear"} if deq else None
    net = net_arguments(VAELitModule, "vae", arch="conv", latent_dim=latent, hidden=256, channels=channels,
                        enc_channels=channels, likelihood="gaussian", learn_sigma=True)
    return VAELitModule(shape, loss={"name": "ssm"}, deq=deq_cfg, depth=depth,
                        optimizer=optimizer or optimizer_of("vae"), **net)


def redwine_rows(data_root: str | None, n: int, generator):
    """``n`` rows of whitened RedWine (D = 11; the UCI file under ``data_root``), or N(0, I₁₁) rows when the file
    is not there. Returns ``(rows, source)``."""
    import torch

    if data_root:
        try:
            from src.data.uci import load_uci

            values, _ = load_uci("redwine", data_root, download=False)
            data = torch.as_tensor(values, dtype=torch.float32)
            data = (data - data.mean(0)) / data.std(0).clamp_min(1e-8)
            idx = torch.randperm(data.shape[0], generator=generator)[:n]
            return data[idx], "redwine"
        except (FileNotFoundError, OSError, ValueError, ImportError):
            pass
    return torch.randn(n, 11, generator=generator), "N(0, I_11)"


def build_case(case: str, root: Path, data_root: str | None = None):
    """``(module, batches, facts)`` of one case: the LightningModule (seed 0), a list of ``N_BATCHES`` seeded
    batches, and what the case is (a dict for the results)."""
    import torch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    family, variant = case.split("/")
    if family == "dkef":
        rows, source = redwine_rows(data_root, 32 * N_BATCHES + 200, g)
        module = dkef_module(11, variant == "deq", None, optimizer=optimizer_of("dkef", root))
        with torch.no_grad():  # inducing points at training points (the module's setup does this from its data)
            module.net.inducing.copy_(rows[-200:])
        batches = [rows[32 * k: 32 * (k + 1)] for k in range(N_BATCHES)]
        facts = {"data": source, "D": 11, "batch": "16 + 16", "loss": "sm (exact)", "M": 200}
    elif family == "nice":
        from src.lit.nice import NICELitModule

        module = NICELitModule(784, loss={"name": "ssm"}, deq=deq_settings(variant == "deq-ssm"), depth=None,
                               optimizer=optimizer_of("nice", root))
        batches = [torch.logit(torch.rand(128, 784, generator=g).clamp(0.05, 0.95)) for _ in range(N_BATCHES)]
        facts = {"data": "random logit-space images", "D": 784, "batch": 128, "loss": "ssm (1 Rademacher)"}
    elif family == "ncsn":
        module = ncsn_module("deq", variant == "deq", None if variant == "deq" else 1,
                             optimizer=optimizer_of("ncsn", root))
        batches = [torch.rand(2, 3, 32, 32, generator=g) for _ in range(N_BATCHES)]
        facts = {"data": "uniform images", "shape": "3x32x32", "ngf": 128, "batch": 2, "loss": "ssm_vr (noise-conditional)"}
    elif family == "vae":
        module = vae_module((3, 32, 32), None if variant == "deq" else 0, variant == "deq",
                            optimizer=optimizer_of("vae", root))
        batches = [torch.rand(8, 3, 32, 32, generator=g) * 2 - 1 for _ in range(N_BATCHES)]
        facts = {"data": "uniform images in [-1, 1]", "shape": "3x32x32", "m": 64, "D_z": 32, "batch": 8,
                 "loss": "ssm (score estimator) + surrogate ELBO"}
    else:
        raise ValueError(f"unknown case {case!r}; valid: {', '.join(CASES)}")
    facts["params"] = sum(p.numel() for p in module.parameters())
    return module, batches, facts


def deq_iterations(module) -> float | None:
    """Mean forward solver iterations over the module's DEQ blocks at the last step (None: no DEQ)."""
    its = [m.last_stats.get("iterations") for m in module.modules()
           if hasattr(m, "last_stats") and isinstance(m.last_stats, dict) and m.last_stats]
    its = [i for i in its if i is not None]
    return sum(its) / len(its) if its else None


def commit_of(rev: str) -> str:
    """The short hash of ``rev`` in this repository."""
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def snapshot(rev: str, dest: Path) -> Path:
    """``src`` and ``conf`` of commit ``rev`` unpacked into ``dest`` (``git archive``): code to measure that
    no concurrent edit of the working tree can change or break mid-run. Returns ``dest``."""
    archive = subprocess.run(["git", "archive", rev, "src", "conf"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return Path(dest)


def rev_trees(revs: list[str], folder: Path) -> dict[str, Path]:
    """``{rev: tree}``: each revision's ``src`` and ``conf`` unpacked (:func:`snapshot`) into its own sub-folder of
    ``folder``, to be measured side by side with :func:`rev_env`."""
    trees = {}
    for i, rev in enumerate(revs):
        (Path(folder) / f"rev{i}").mkdir(parents=True, exist_ok=True)
        trees[rev] = snapshot(rev, Path(folder) / f"rev{i}")
    return trees


def rev_env(tree: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a worker process of the revision unpacked at ``tree`` (:func:`rev_trees`): its ``src`` first on
    the path, this repository's ``benchmarks`` after it. Run the worker with the tree as its working directory, so
    that ``python -m`` does not put this repository's ``src`` first."""
    import os

    return dict(env, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]))
