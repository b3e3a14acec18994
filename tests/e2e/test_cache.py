"""Inductor's FX-graph and AOTAutograd caches stay correct with the rewrite."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import gla_inductor
from gla_inductor.cache_key import cache_key_pass

pytestmark = pytest.mark.compat  # run again on the newest torch and triton (.ci/run)

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
    script = SCRIPT.format(tests=str(pathlib.Path(__file__).parents[1]))
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
    files = cache_key_pass().files
    root = pathlib.Path(gla_inductor.__file__).parent
    want = {str(p) for p in root.rglob("*") if p.suffix in (".py", ".jinja", ".cpp")}
    assert want and set(files) == want
    assert any(f.endswith("recurrent_cpu.cpp") for f in files)
    assert any(f.endswith(".jinja") for f in files) or not list(root.rglob("*.jinja"))


TEMPLATE_SCRIPT = r"""
import json, os, sys, torch
if not torch.cuda.is_available():  # Inductor's Triton on CPU tensors, under the interpreter
    import torch._inductor.codegen.triton as codegen_triton, torch.utils._triton as utils_triton
    utils_triton.triton_hash_with_backend = codegen_triton.triton_hash_with_backend = lambda: "interpreter"
    torch._inductor.config.cpu_backend = "triton"
import gla_inductor, gla_inductor.lowerings, gla_inductor.reference
from torch._dynamo.utils import counters
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 9, 2, 16, generator=gen).to(device) for _ in range(3))
out = torch.compile(lambda q, k, v: gla_inductor.chunk_gla(q, k, v)[0], fullgraph=True)(q, k, v)
ref = gla_inductor.reference.naive_recurrent_gla(q.double(), k.double(), v.double())[0]
print(json.dumps({{"ratio": (out.double() * ref).sum().item() / (ref * ref).sum().item(),
                  "file": gla_inductor.__file__, "fx_hit": counters["inductor"]["fxgraph_cache_hit"]}}))
"""


def test_template_change_invalidates_warm_caches(tmp_path):
    """Compile through our templates, edit a template (the output doubled), compile again in a new
    process with the warm cache: the new template runs, not the cached code of the old one."""
    import shutil

    package = tmp_path / "src" / "gla_inductor"
    shutil.copytree(pathlib.Path(gla_inductor.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path / "src"))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"

    def run_copy():
        res = subprocess.run([sys.executable, "-c", TEMPLATE_SCRIPT.format()], env=env, capture_output=True,
                             text=True, timeout=600, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    first, again = run_copy(), run_copy()
    assert first["file"].startswith(str(tmp_path)) and abs(first["ratio"] - 1) < 1e-4
    assert again["fx_hit"] >= 1 and abs(again["ratio"] - 1) < 1e-4  # the cache works
    # the forward without a gate: the carry computing its chunk terms (kernels/configs.py)
    carry = package / "kernels" / "templates" / "gla_chunk_carry.py.jinja"
    source = carry.read_text()
    anchor = "b_o = b_o + _gla_dot(b_s.to(DOT_DTYPE), tl.trans(b_x), F32_PRECISION) * b_xf[None, :]"
    assert anchor in source
    carry.write_text(source.replace(anchor, anchor + "\n        b_o = 2 * b_o"))
    changed = run_copy()
    assert abs(changed["ratio"] - 2) < 1e-4, changed


def test_users_own_post_grad_pass_still_runs_and_keys_the_cache():
    """A user's post_grad_custom_post_pass (global config or options=) runs under our backend, and
    the cache key covers it and our sources both."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from gla_inductor.backend import config_patches

    class Mine(CustomGraphPass):
        def __init__(self):
            self.calls = 0

        def __call__(self, graph):
            self.calls += 1

        def uuid(self):
            return b"mine"

    for how in ("config", "options"):
        mine = Mine()
        torch._dynamo.reset()
        options = {"post_grad_custom_post_pass": mine} if how == "options" else None
        # caches off: a cache hit (this test run before) skips the passes, as it should
        with torch._inductor.config.patch(post_grad_custom_post_pass=mine if how == "config" else None,
                                          force_disable_caches=True):
            patched = config_patches(options=options)["post_grad_custom_post_pass"]
            out = torch.compile(lambda x: x * 2 + 1, backend=gla_inductor.backend, options=options)(torch.ones(3))
        assert mine.calls >= 1, how
        assert b"mine" in patched.uuid() and patched.uuid() != cache_key_pass().uuid()
        assert torch.equal(out, torch.full((3,), 3.0))
