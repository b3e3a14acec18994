"""GPU time of each kernel launch of one eager packed call (mixed 12 and 8 x 2048, scalar and
vector forward, vector forward + backward), median of 20 calls. Run on the GPU machine from the
repository root (or a variant's folder): PYTHONPATH=/tmp/site:$PWD python <this file>"""
import sys
import torch
import gla_inductor
from benchmarks import inputs

MIXED12 = [4096, 517, 3001, 1024, 64, 2048, 5999, 1, 777, 2500, 3900, 1773]
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_split import split  # noqa: E402


def call(lengths, gate, train=False):
    T = sum(lengths)
    q, k, v, g = inputs.gla_inputs(1, T, 16, 128, 128, gate=gate, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=train)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.cuda()
    if not train:
        def f():
            with torch.no_grad():
                gla_inductor.chunk_gla(q, k, v, g, cu_seqlens=cu)
        return f
    do = torch.randn(1, T, 16, 128, device="cuda", dtype=torch.bfloat16)

    def f():
        o = gla_inductor.chunk_gla(q, k, v, g, cu_seqlens=cu)[0]
        torch.autograd.grad(o, (q, k, v, g), do)
    return f


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| call | kernels (us) | total us |\n|---|---|---|")
    for name, lengths in (("mixed12", MIXED12), ("8x2048", [2048] * 8)):
        split(f"{name} scalar fwd", call(lengths, "scalar"))
        split(f"{name} vector fwd", call(lengths, "vector"))
        split(f"{name} vector fwd+bwd", call(lengths, "vector", True))
