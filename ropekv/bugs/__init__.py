"""Bug classes as plug-ins: one module per class, each with the explanation that names it, the
catalogued faults that show it on ropekv's engine, the cases that expose it, generated variants for
the confusion table and, in its docstring, its documentation entry. :mod:`.registry` orders them."""
