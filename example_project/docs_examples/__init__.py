"""The code shown in the documentation, one section per block (``--8<-- [start:name]``).

The docs pages hold copies of these sections (``tests/docs_code.py`` keeps them in sync,
``make docs-code`` writes them), and ``tests/test_docs.py`` imports and runs them; mypy
type-checks them with the example project.
"""
