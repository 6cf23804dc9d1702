"""IR of llmc: the `llm` graph dialect, the weight store and the numpy reference."""
