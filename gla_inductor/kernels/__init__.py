"""The Triton kernels: jinja templates (``templates/``), rendered standalone for eager calls
(``standalone``) and by Inductor in compiled graphs (``gla_inductor.lowerings``); tiles and
options (``configs``) and host launchers (``chunk``, ``recurrent``) shared by both."""
