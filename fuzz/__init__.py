"""Coverage-guided fuzzing of llmc's readers of untrusted input (see benchmarks/README.md, Fuzzing)."""
