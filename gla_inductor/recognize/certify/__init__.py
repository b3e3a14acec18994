"""The float64 certificate that a chunked candidate equals its replacement.

    subgraph         the nodes between a candidate's inputs and outputs, and its constants
    spec             the proposed replacement (Spec) and the op it inserts
    summed_products  sums of broadcast products evaluated as einsums
    shrink           the subgraph at 2 batches and 2 heads, where it treats them all alike
    certificate      the comparison at random float64 inputs, within a memory budget
    probe            a constant decay read off one run (a guess the certificate checks)
    trial            a match applied, run against the user's nodes in float64, undone (for
                     rewrites that keep user nodes between the op and the outputs); both
                     sides as modules for timing (``recognize/measure.py``)
"""
