"""A few eager forwards at one shape, for Nsight Compute (bf16, vector gate):

    ncu --set full --import-source yes -k regex:gla_chunk_carry --launch-skip 3 -c 1 -f -o carry \
        python benchmarks/ncu_forward.py 8,2048,4,256,512
    ncu --import carry.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_hot.py sass.csv
"""

import sys

import torch

from gla_inductor.triton_chunk import chunk_fwd_triton
from gpu_schedule import sweep_inputs

B, T, H, K, V = map(int, sys.argv[1].split(","))
q, k, v, g = sweep_inputs(B, T, H, K, V, "vector")
for _ in range(6):
    chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, False, False)
torch.cuda.synchronize()
