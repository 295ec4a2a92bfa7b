"""Helpers the float64 derivative tests share (test-only): the relative error, and an SM loss through a small energy
head whose score, Hessian trace and parameter gradient exercise first to third order derivatives of a network."""

from __future__ import annotations

import torch


def rel(a, b):
    """‖a − b‖ / ‖b‖ (b the reference)."""
    return ((a - b).norm() / b.norm()).item()


def sm_loss_and_grads(fn, x, head, params):
    """Score s = ∇ₓ e(x) of a small energy head on fn(x), its Hessian trace (second order in x) and the SM loss's
    parameter gradient (one order more)."""
    x = x.clone().requires_grad_(True)
    e = torch.nn.functional.softplus(fn(x).flatten(1) @ head[0]) @ head[1]
    (s,) = torch.autograd.grad(e.sum(), x, create_graph=True)
    sf = s.flatten(1)
    tr = sum(torch.autograd.grad(sf[:, i].sum(), x, create_graph=True)[0].flatten(1)[:, i] for i in range(sf.shape[1]))
    loss = (0.5 * sf.pow(2).sum(1) + tr).mean()
    return s, tr, torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
