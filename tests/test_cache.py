"""Inductor's FX-graph and AOTAutograd caches stay correct with the rewrite."""

import json
import os
import pathlib
import subprocess
import sys

import gla_inductor
from gla_inductor.backend import _cache_key_pass

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, {tests!r})
import gla_inductor
from torch._dynamo.utils import counters
from spellings import SPELLINGS
sp = SPELLINGS[0]
torch.manual_seed(0)
args = [a.requires_grad_() for a in sp.make(torch.float32)]
out = torch.compile(sp.fn, backend=gla_inductor.backend, fullgraph=True)(*args)
out.sum().backward()
ref_args = [a.detach().double().requires_grad_() for a in args]
ref = sp.fn(*ref_args)
ref.sum().backward()
err = max((out.double() - ref).abs().max().item(),
          *[(a.grad.double() - r.grad).abs().max().item() for a, r in zip(args, ref_args)])
print(json.dumps({{"err": err, "rewrites": counters["gla_inductor"]["rewrites"],
                  "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}}))
"""


def run(cache_dir):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    script = SCRIPT.format(tests=str(pathlib.Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_warm_cache_in_a_second_process(tmp_path):
    cold = run(tmp_path)
    warm = run(tmp_path)
    assert cold["rewrites"] == 1 and warm["rewrites"] == 1
    assert cold["err"] < 1e-4 and warm["err"] < 1e-4
    assert warm["aot_hit"] >= 1 or warm["fx_hit"] >= 1, warm


def test_cache_key_covers_sources_and_templates():
    files = _cache_key_pass().files
    root = pathlib.Path(gla_inductor.__file__).parent
    want = {str(p) for p in root.rglob("*") if p.suffix in (".py", ".jinja")}
    assert want and set(files) == want
    assert any(f.endswith(".jinja") for f in files) or not list(root.rglob("*.jinja"))
