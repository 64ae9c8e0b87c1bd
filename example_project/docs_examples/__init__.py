"""The code shown in the documentation, one section per block (``--8<-- [start:name]``).

The docs site includes these sections (pymdownx.snippets), the README copies some of them
byte for byte, and ``tests/test_docs.py`` imports and runs them; mypy type-checks them with
the example project.
"""
