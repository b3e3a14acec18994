"""gla_inductor's benchmarks as one tool: ``python -m benchmarks NAME`` (see README.md here).

``harness`` times and measures, ``inputs`` makes inputs and the naive programs, ``report`` stamps
and writes results, ``internals`` holds every import of the package's internals; ``registry``
names the benchmarks, one module each.
"""
