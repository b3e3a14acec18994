"""One recognizer per form of naive GLA, and the parts they share. Each form module has
``recognize(an) -> (matches, near_misses)``.

    loop            a time loop unrolled by Dynamo          (steps, step_walk, periodic)
    decode          one step on a cached state              (loop's one-step case)
    parallel        one contraction under a decay mask      (parallel_decay, static_decay,
                                                             toeplitz_decay)
    chunked         chunked scans and chunk loops           (chunk_loop, intra_chunk,
                                                             chunk_candidate, grouped_heads)
"""
