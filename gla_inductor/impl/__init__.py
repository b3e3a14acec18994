"""The ops' implementations in PyTorch and C++: the chunked algorithm (``chunked``, with the
buffers it keeps between calls, ``scratch``), the C++ step loop for CPU (``step_loop``), and the
time loop of the decode op (``recurrent``). ``ops.dispatch`` chooses among them and the kernels."""
