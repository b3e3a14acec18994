"""The float64 certificate runs the user's subgraph on the CPU whatever device the code targets:
factories with a GPU device (``torch.zeros(..., device=q.device)`` traces to a constant device),
``.to("cuda")`` and ``.cuda()`` are run on the CPU, so a GPU model's code certifies as a CPU one
does (on a machine without a GPU the graph's CUDA factories would otherwise fail to run, and on
one with a GPU they would meet the certificate's CPU inputs)."""

import torch
import torch.fx as fx

from gla_inductor.recognize.certify.certificate import Float64Interpreter


def test_devices_in_the_subgraph_run_on_the_cpu():
    g = fx.Graph()
    x = g.placeholder("x")
    zeros = g.call_function(torch.zeros, (3,), {"device": torch.device("cuda", 0), "dtype": torch.float32})
    steps = g.call_function(torch.arange, (3,), {"device": "cuda", "dtype": torch.float16})
    moved = g.call_method("cuda", (g.call_method("to", (x, "cuda:0")),))
    cast = g.call_method("to", (moved, torch.device("cuda"), torch.bfloat16))
    g.output(g.call_function(torch.add, (g.call_function(torch.add, (cast, zeros)), steps)))
    out = Float64Interpreter(fx.GraphModule(torch.nn.Module(), g)).run(torch.full((3,), 0.1, dtype=torch.float64))
    assert out.device.type == "cpu" and out.dtype == torch.float64
    assert torch.equal(out, torch.tensor([0.1, 1.1, 2.1], dtype=torch.float64))
