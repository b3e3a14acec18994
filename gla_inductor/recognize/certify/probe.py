"""A constant decay per head read off one run of the user's subgraph: a guess at the gate of a
chunked computation that holds its decay as numbers (0.9 ** distance), which the certificate
then checks like any other reading."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..core.analyzer import Analyzer
from .certificate import CertificateTooLarge, Float64Interpreter, one_thread, plan_certificate
from .spec import Spec
from .subgraph import evaluate_consts, subgraph


def fitted_gamma(an: Analyzer, spec: Spec) -> Optional[Spec]:
    """A constant decay per head that the code holds as numbers (0.9 ** distance), read off
    one probe run: q at step 1 reading k, v of step 0 gives scale * exp(gamma[h]). Only a
    guess: the certificate then checks it."""
    if spec.sizes["t"] < 2 or any(lf.select or lf.unflatten for lf in (spec.q, spec.k, spec.v)):
        return None
    leaves = spec.leaves()
    nodes, frontier, consts = subgraph(an, [spec.out], set(leaves.values()), static=spec.static_tables)
    if frontier or not evaluate_consts(an, consts) or any(len(g) > 1 for g in spec.out_groups):
        return None
    try:
        plan = plan_certificate(an, spec, nodes, consts, [spec.out])
    except CertificateTooLarge:
        return None
    sizes = plan.spec.sizes
    probe = {r: torch.zeros(sizes["b"], sizes["t"], sizes["h"], sizes[d]) for r, d in (("q", "k"), ("k", "k"), ("v", "v"))}
    probe["q"][:, 1, :, 0] = probe["k"][:, 0, :, 0] = probe["v"][:, 0, :, 0] = 1.0
    args = []
    for role in leaves:
        lf = {"q": spec.q, "k": spec.k, "v": spec.v}.get(role)
        args.append(_unlift(probe[role], lf.letters) if lf else torch.zeros(plan.shapes[role]))
    try:
        with one_thread(plan.reduced):
            (o,) = Float64Interpreter(plan.original).run(*[a.double() for a in args])
    except Exception:  # noqa: BLE001 - no reading: no candidate
        return None
    letters = "".join(spec.out_groups).replace("1", "")
    present = "".join(c for c in "bthv" if c in letters)  # size-1 roles have no letter
    o = torch.einsum(f"{letters}->{present}", o.reshape([s for s in o.shape if s != 1] or [1]))
    for axis, c in enumerate("bthv"):
        if c not in letters:
            o = o.unsqueeze(axis)
    decay = o[:, 1, :, 0] / spec.scale
    if not bool((decay > 0).all()) or not torch.allclose(decay, decay[:1].expand_as(decay)):
        return None
    gamma = decay[0].log().tolist()
    if len(gamma) != spec.sizes["h"]:  # read at fewer heads, proven alike: the same for all
        if len(set(gamma)) != 1:
            return None
        gamma = gamma[:1] * spec.sizes["h"]
    return replace(spec, gate="constant", gamma=tuple(gamma))


def _unlift(x: torch.Tensor, letters: str) -> torch.Tensor:
    """A [B, T, H, D] tensor laid out as a leaf lettered `letters`."""
    d = "v" if "v" in letters else "k"
    y = torch.einsum(f"bth{d}->{letters.replace('1', '')}", x)
    it = iter(y.shape)
    return y.reshape([1 if c == "1" else next(it) for c in letters])
