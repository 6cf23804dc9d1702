"""llmc: an ahead-of-time compiler for large language models.

Kept light on purpose: importing `llmc` pulls in nothing heavy. The pieces are
`llmc.frontend` (model files to IR), `llmc.ir` (dialects, weight store, numpy
reference), `llmc.passes` (phases), `llmc.backends` and `llmc.runtime`.
"""

__version__ = "0.1.0"
