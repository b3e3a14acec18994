"""What every form of the recognizer builds on, in import order (each module imports only
those above it):

    consts      nodes whose values depend only on constants and sizes; in-place writes
    match       Match, NearMiss, Reject
    op_names    one canonical name per torch function or method a node calls
    algebra     the normal form: monomials of factors indexed by index variables
    versions    what a read sees after in-place writes; value numbering
    rules       the normal form of each operation from its operands'
    analyzer    Analyzer: the normal form of every node of one graph, and its memory facts
    assembly    outputs assembled over time (stack, cat, a buffer filled step by step)
    placement_dtensor  the op call for DTensor inputs sharded over time (context parallelism)
    emit        Transaction, Emitter, and the GLA op call from a GLACall (``emit_op``)
    placement   where the op goes, and the write-back of a decode step's state
    clean       dead code after a rewrite
"""
